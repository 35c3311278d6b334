"""The :class:`Rule` config object: which tensors of a model become sparse, and how.

>>> import torch.nn as nn, sparsa
>>> from sparsa.sparsifiers import NM
>>> r = sparsa.Rule(sparsifier=NM(2, 4), layout="masked", module_types=nn.Linear, names="encoder.*")
>>> r.matches("encoder.fc1", nn.Linear(4, 4)), r.matches("head", nn.Linear(4, 4))
(True, False)
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple, Type, Union

from torch import nn

from ..layouts.base import Layout, get_layout
from ..sparsifiers.base import Sparsifier, check_sparsifier, layout_params_of

__all__ = ["Rule", "TARGETS"]

TARGETS = ("weight", "output", "grad")
NamePattern = Union[str, "re.Pattern[str]", Sequence[Union[str, "re.Pattern[str]"]]]


@dataclass(kw_only=True)
class Rule:
    """One line of a sparsification config.

    Args:
        target: ``"weight"`` (a parameter, see ``param``), ``"output"`` (the module's output,
            sparsified by a forward hook) or ``"grad"`` (the gradient of an already-sparse parameter
            is stored in ``layout``, restricted to the parameter's pattern).
        sparsifier: which values survive: a :class:`Sparsifier` or any object with a
            ``mask(dense) -> bool tensor`` method (:func:`sparsa.sparsifiers.is_sparsifier`).
            ``None`` keeps the current pattern of an already-sparse tensor (or the nonzeros of a
            dense one), which is how to change a model's layout.
        layout: a layout class or registered name (``"masked"``, ``"csr"``, ``"nm"``...).
        layout_params: extra layout parameters; they default to ``sparsifier.layout_params()``.
        names: module-name filter: a glob (``"encoder.*.fc?"``, matched against the full dotted
            name), a compiled ``re.Pattern`` (``fullmatch``), a ``"re:<regex>"`` string, or a list of
            these (any matches). ``None`` matches every name.
        module_types: a module class or tuple of them; ``None`` matches every type.
        param: the parameter name for ``target="weight"``/``"grad"`` (default ``"weight"``).
        inline: for ``target="weight"``: ``False`` keeps the pattern fixed through optimizer steps,
            ``True`` re-applies ``sparsifier`` after every update, a :class:`Sparsifier` re-applies
            that one (STen's inline sparsifier).
    """

    target: str = "weight"
    sparsifier: Optional[Sparsifier] = None
    layout: Union[str, Type[Layout]] = "masked"
    layout_params: Dict[str, Any] = field(default_factory=dict)
    names: Optional[NamePattern] = None
    module_types: Optional[Union[type, Tuple[type, ...]]] = None
    param: str = "weight"
    inline: Union[bool, Sparsifier] = False

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        check_sparsifier(self.sparsifier, "sparsifier")
        if isinstance(self.layout, str):
            self.layout = get_layout(self.layout)
        elif not (isinstance(self.layout, type) and issubclass(self.layout, Layout)):
            raise TypeError(f"layout must be a registered layout name or Layout class, got {self.layout!r}")
        if not isinstance(self.layout_params, dict):
            raise TypeError(f"layout_params must be a dict, got {type(self.layout_params).__name__}")
        if self.module_types is not None:
            types = self.module_types if isinstance(self.module_types, tuple) else (self.module_types,)
            for t in types:
                if not (isinstance(t, type) and issubclass(t, nn.Module)):
                    raise TypeError(f"module_types must be nn.Module subclasses, got {t!r}")
            self.module_types = types
        if not isinstance(self.param, str) or not self.param:
            raise ValueError(f"param must be a parameter name such as 'weight', got {self.param!r}")
        if self.inline is not False and self.target != "weight":
            raise ValueError(f"inline only applies to target='weight', got target={self.target!r}")
        if self.inline is True and self.sparsifier is None:
            raise ValueError(
                "inline=True re-applies the rule's sparsifier, but sparsifier is None; "
                "pass sparsifier=... or inline=<Sparsifier>"
            )
        if not isinstance(self.inline, bool):
            check_sparsifier(self.inline, "inline (True, False or a sparsifier)", allow_none=False)
        self._patterns = _compile_names(self.names)

    # ------------------------------------------------------------------ matching
    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether this rule applies to ``module`` called ``name`` (ignores ``param``)."""
        if self.module_types is not None and not isinstance(module, self.module_types):
            return False
        return self._patterns is None or any(p(name) for p in self._patterns)

    def resolved_layout_params(self) -> Dict[str, Any]:
        """``layout_params`` on top of the sparsifier's ``layout_params()``; the latter only for the
        parameters the layout's ``from_dense`` names explicitly (e.g. ``n``/``m`` go to ``"nm"`` but
        not to ``"masked"``)."""
        base = layout_params_of(self.sparsifier) if self.sparsifier is not None else {}
        accepted = _named_params(self.layout)
        return {**{k: v for k, v in base.items() if k in accepted}, **self.layout_params}

    def inline_sparsifier(self) -> Optional[Sparsifier]:
        if self.inline is True:
            return self.sparsifier
        return self.inline or None

    def describe(self) -> str:
        what = f"names={self.names!r}" if self.names is not None else "any name"
        types = ", ".join(t.__name__ for t in self.module_types) if self.module_types else "any type"
        return f"Rule(target={self.target!r}, param={self.param!r}, {what}, module_types=({types}))"


def _named_params(layout: type) -> frozenset:
    try:
        sig = inspect.signature(layout.from_dense)
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return frozenset()
    return frozenset(
        n
        for n, p in sig.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in ("dense", "mask")
    )


def _compile_names(names: Optional[NamePattern]):
    if names is None:
        return None
    items = [names] if isinstance(names, (str, re.Pattern)) else list(names)
    if not items:
        raise ValueError("names must not be empty; use None to match every module")
    out = []
    for it in items:
        if isinstance(it, re.Pattern):
            out.append(lambda s, p=it: p.fullmatch(s) is not None)
        elif isinstance(it, str) and it.startswith("re:"):
            try:
                rx = re.compile(it[3:])
            except re.error as e:
                raise ValueError(f"names: invalid regex {it[3:]!r}: {e}") from None
            out.append(lambda s, p=rx: p.fullmatch(s) is not None)
        elif isinstance(it, str):
            out.append(lambda s, p=it: fnmatch.fnmatchcase(s, p))
        else:
            raise TypeError(f"names entries must be glob strings, 're:' strings or re.Pattern, got {it!r}")
    return out
