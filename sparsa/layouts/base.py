"""The layout protocol, the layout registry and the conversion graph.

A *layout* is a storage format: a few component tensors plus the logical (dense) shape and dtype.
Every layout can be built from a dense tensor (optionally with an explicit boolean ``mask`` of kept
positions) and turned back into one. Layouts are plain data containers; the tensor subclass
:class:`sparsa.SparseTensor` wraps one so it can live inside a model.

Example::

    >>> import torch, sparsa
    >>> x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    >>> csr = sparsa.layouts.CSR.from_dense(x)
    >>> csr.nnz, csr.density
    (2, 0.5)
    >>> torch.equal(csr.to_dense(), x)
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import heapq
import math
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Tuple, Type

import torch
import torch._guards  # noqa: F401  (detect_fake_mode: skip validation while tracing)
from torch import Tensor

__all__ = [
    "Layout",
    "register_layout",
    "get_layout",
    "registered_layouts",
    "register_conversion",
    "convert",
    "conversion_path",
    "check_float",
    "check_fraction",
    "mark_restricted",
    "is_restricted",
]

_LAYOUTS: Dict[str, Type["Layout"]] = {}
# conversion graph: src class -> dst class -> (cost, fn)
_CONVERSIONS: Dict[type, Dict[type, Tuple[float, Callable[["Layout"], "Layout"]]]] = {}


def check_float(t: Tensor, arg: str) -> None:
    """Raise a clear TypeError unless ``t`` is a floating-point tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{arg} must have a floating-point dtype, got {t.dtype}; convert it first, e.g. {arg}.float()")


def check_fraction(value: float, arg: str) -> float:
    """Raise a clear ValueError unless ``0 <= value < 1``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{arg} must be a number in [0, 1), got {value!r}") from None
    if not (0.0 <= v < 1.0) or math.isnan(v):
        raise ValueError(f"{arg} must be in [0, 1) (fraction of values removed), got {value!r}")
    return v


class Layout(ABC):
    """Base class of every storage format.

    Subclasses set ``name`` (the registry key), implement :meth:`from_dense`, :meth:`to_dense`,
    :meth:`components`, :meth:`from_components` and :meth:`validate`, and may override
    :meth:`mask`, :meth:`refill` and :meth:`nnz` for speed.
    """

    name: ClassVar[str] = ""
    #: component name -> tensor; filled by subclasses
    shape: torch.Size
    dtype: torch.dtype

    # ------------------------------------------------------------------ required
    @classmethod
    @abstractmethod
    def from_dense(cls, dense: Tensor, mask: Optional[Tensor] = None, **params: Any) -> "Layout":
        """Build from a dense tensor. ``mask`` (bool, same shape) names the kept positions;
        without it the nonzeros of ``dense`` are kept (structured layouts keep the largest
        magnitudes that fit their structure)."""

    @abstractmethod
    def to_dense(self) -> Tensor:
        """The logical dense tensor (zeros where nothing is stored)."""

    @abstractmethod
    def components(self) -> Dict[str, Tensor]:
        """The component tensors, by name (what is saved and what ``nbytes`` counts)."""

    @classmethod
    @abstractmethod
    def from_components(cls, components: Dict[str, Tensor], shape: Iterable[int], **params: Any) -> "Layout":
        """Rebuild from :meth:`components` and :meth:`params`; validates."""

    @abstractmethod
    def validate(self) -> None:
        """Raise ValueError naming the malformed component."""

    # ------------------------------------------------------------------ defaults
    def derived_components(self) -> Dict[str, Tensor]:
        """Tensors the kernels derive from the components once and cache (e.g. an N:M weight's bit rows).
        ``torch.compile`` carries them into the graph as inputs beside the components, so a compiled
        graph does not rebuild them on every call; :meth:`adopt_derived` takes them back."""
        return {}

    def adopt_derived(self, derived: Dict[str, Tensor]) -> None:
        """Cache ``derived`` (what :meth:`derived_components` returned for the same components)."""
        if derived:
            raise TypeError(f"{type(self).__name__} derives no tensors, got {sorted(derived)}")

    def params(self) -> Dict[str, Any]:
        """Non-tensor metadata (JSON-serialisable) needed by :meth:`from_components`."""
        return {}

    @property
    def device(self) -> torch.device:
        return next(iter(self.components().values())).device

    def mask(self) -> Tensor:
        """Boolean tensor of the stored (kept) positions."""
        return self.to_dense() != 0

    def restrict(self, dense: Tensor) -> Tensor:
        """``dense`` (of the logical shape) with the positions outside the stored pattern set to 0: the
        gradient of a conversion to this layout with respect to its dense input. Layouts whose
        ``mask()`` costs a dense rebuild override it; a gradient marked by :func:`mark_restricted` skips it."""
        return dense * self.mask().to(dense.dtype)

    @property
    def nnz(self) -> int:
        """Number of stored values (explicit zeros that are part of the pattern count)."""
        return int(self.mask().sum())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def density(self) -> float:
        n = self.numel
        return self.nnz / n if n else 0.0

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density if self.numel else 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of all component tensors."""
        return sum(t.numel() * t.element_size() for t in self.components().values())

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> "Layout":
        """A new layout of the same class with ``fn`` applied to every component."""
        comps = {k: fn(v) for k, v in self.components().items()}
        return type(self).from_components(comps, self.shape, **self.params())

    def refill(self, dense: Tensor) -> "Layout":
        """Same pattern, values taken from ``dense`` (used after optimizer steps)."""
        return type(self).from_dense(dense.to(self.dtype), mask=self.mask(), **self.params())

    def to(self, *args: Any, **kwargs: Any) -> "Layout":
        return self.map_tensors(
            lambda t: t.to(*args, **kwargs) if t.is_floating_point() else t.to(device=_device_of(args, kwargs, t))
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, nnz={self.nnz}, "
            f"density={self.density:.3f}{''.join(f', {k}={v}' for k, v in self.params().items())})"
        )


def _device_of(args: tuple, kwargs: dict, t: Tensor) -> torch.device:
    dev = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            dev = a
    return torch.device(dev) if dev is not None else t.device


# ---------------------------------------------------------------------- registry
def register_layout(cls: Type[Layout], replace: bool = False) -> Type[Layout]:
    """Register a layout class under ``cls.name``. Usable as a decorator.

    A duplicate name is an error unless ``replace=True``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Layout)):
        raise TypeError(f"register_layout expects a Layout subclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"layout class {cls.__name__} must set a non-empty `name`")
    _wrap_validate(cls)
    if cls.name in _LAYOUTS and _LAYOUTS[cls.name] is not cls and not replace:
        raise ValueError(
            f"a layout named {cls.name!r} is already registered ({_LAYOUTS[cls.name].__name__}); "
            "pass replace=True to replace it"
        )
    _LAYOUTS[cls.name] = cls
    return cls


_SKIP_VALIDATION: contextvars.ContextVar[bool] = contextvars.ContextVar("sparsa_skip_validation", default=False)


def _wrap_validate(cls: type) -> None:
    """Make ``cls.validate`` a no-op while tracing (fake tensors carry no data to check) and inside
    :func:`unchecked` (rebuilding from already-validated components)."""
    orig = cls.__dict__.get("validate")
    if orig is None or getattr(orig, "_sparsa_wrapped", False):
        return

    @functools.wraps(orig)
    def validate(self: Layout) -> None:
        if _SKIP_VALIDATION.get() or torch._guards.detect_fake_mode() is not None:
            return
        return orig(self)

    validate._sparsa_wrapped = True  # type: ignore[attr-defined]
    cls.validate = validate  # type: ignore[assignment]


@contextlib.contextmanager
def unchecked():
    """Skip layout validation inside the block (components known to be valid)."""
    tok = _SKIP_VALIDATION.set(True)
    try:
        yield
    finally:
        _SKIP_VALIDATION.reset(tok)


def get_layout(name: str) -> Type[Layout]:
    try:
        return _LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; registered: {sorted(_LAYOUTS)}") from None


def registered_layouts() -> Dict[str, Type[Layout]]:
    return dict(_LAYOUTS)


def register_conversion(
    src: type, dst: type, fn: Optional[Callable] = None, *, cost: float = 1.0, replace: bool = False
):
    """Register a direct conversion ``fn(src_layout) -> dst_layout`` with a relative ``cost``.

    Use as ``register_conversion(A, B, fn)`` or as a decorator ``@register_conversion(A, B)``.
    ``src``/``dst`` may be :class:`~sparsa.layouts.Dense` (meaning a plain tensor).
    """

    def deco(f: Callable) -> Callable:
        edges = _CONVERSIONS.setdefault(src, {})
        if dst in edges and not replace:
            raise ValueError(
                f"a conversion {src.__name__} -> {dst.__name__} is already registered; pass replace=True to replace it"
            )
        edges[dst] = (float(cost), f)
        conversion_path.cache_clear()
        return f

    return deco(fn) if fn is not None else deco


def _dijkstra(src: type, dst: type) -> Optional[Tuple[float, List[Callable]]]:
    best: Dict[type, float] = {src: 0.0}
    heap: List[Tuple[float, int, type, List[Callable]]] = [(0.0, 0, src, [])]
    counter = 1
    while heap:
        cost, _, node, path = heapq.heappop(heap)
        if node is dst:
            return cost, path
        if cost > best.get(node, math.inf):
            continue
        for nxt, (c, fn) in _CONVERSIONS.get(node, {}).items():
            nc = cost + c
            if nc < best.get(nxt, math.inf):
                best[nxt] = nc
                heapq.heappush(heap, (nc, counter, nxt, path + [fn]))
                counter += 1
    return None


@functools.lru_cache(maxsize=None)
def conversion_path(src: type, dst: type) -> Optional[Tuple[float, Tuple[Callable, ...]]]:
    """Cheapest registered path ``src -> dst`` as (cost, functions), or None if there is none."""
    if src is dst:
        return 0.0, ()
    r = _dijkstra(src, dst)
    return None if r is None else (r[0], tuple(r[1]))


def convert(layout: Layout, dst: Type[Layout], **params: Any) -> Layout:
    """Convert ``layout`` to class ``dst``.

    Uses the direct conversion if registered, else the cheapest registered path, else goes through
    dense (``dst.from_dense(layout.to_dense(), mask=layout.mask(), **params)``). ``params`` force the
    dense route (they parametrise the destination, e.g. ``n``/``m``).
    """
    if isinstance(dst, str):
        dst = get_layout(dst)
    if type(layout) is dst and not params:
        return layout
    if not params:
        p = conversion_path(type(layout), dst)
        if p is not None:
            out = layout
            for fn in p[1]:
                out = fn(out)
            return out
    return dst.from_dense(layout.to_dense(), mask=layout.mask(), **params)


_RESTRICTED = "_sparsa_restricted_to"


def mark_restricted(grad: Tensor, layout: Layout) -> Tensor:
    """Mark ``grad`` as already zero outside ``layout``'s stored pattern (an input gradient a kernel
    computed on the pattern only), so the backward of the conversion to ``layout`` does not restrict it
    again. The mark lapses once ``grad`` changes in place (autograd accumulating a second gradient into
    it, a hook): it holds ``grad``'s version at marking."""
    setattr(grad, _RESTRICTED, (layout, grad._version))
    return grad


def is_restricted(grad: Tensor, layout: Layout) -> bool:
    """Whether ``grad`` carries :func:`mark_restricted`'s mark for ``layout``, unmodified since."""
    mark = getattr(grad, _RESTRICTED, None)
    return mark is not None and mark[0] is layout and mark[1] == grad._version
