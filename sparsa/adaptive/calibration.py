"""Cost model calibrated on this machine: per layer shape, dense time and sparse time vs density.

At a layer's first use the runtime times, on the layer's real activation, PyTorch's dense
forward+backward and the sparse path at the activation's own density and at a sparser version of
it (the same activation with its smallest values zeroed, so the zero pattern stays realistic). The
sparse time is modelled as ``fixed + slope * density``; the predicted speedup at density ``d`` is
``dense / (fixed + slope * d)``. Convolutions with the dY-driven backward (stride 1) are also timed
with output gradients of 30% and 10% density, fitting ``dy_fixed + slope * d / 3 + dy_slope * g``;
at a monitored dY density ``g`` the cheaper of the two models counts. Entries are fitted models of sparsa's
one cost table (:class:`sparsa.cost_model.CostModel`, one file per CPU model; ``SPARSA_COST_DIR`` moves it),
keyed by CPU model and kernel ISA, shape, memory format, thread count and kernel version, so a cache carried
to another CPU is not reused there; ``sparsa cost`` lists them, and ``sparsa cost --clear``,
:meth:`Calibration.clear` or ``enable(..., recalibrate=True)`` measures again.

Example::

    >>> from sparsa.adaptive.calibration import CostEntry
    >>> e = CostEntry(dense_ms=10.0, fixed_ms=1.0, slope_ms=12.0)
    >>> round(e.speedup(density=0.25), 2)
    2.5
    >>> e2 = CostEntry(dense_ms=10.0, fixed_ms=1.0, slope_ms=12.0, dy_path=True, dy_fixed_ms=1.0, dy_slope_ms=12.0)
    >>> round(e2.speedup(density=0.5, grad_density=0.16), 2)   # backward driven by the sparser dY
    2.03
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import cpu
from ..cost_model import CostModel, default_cost_model
from ..kernels import loader
from ..timing import round_robin_ms
from .autocast import autocast_bf16, sparse_under_autocast
from .conv import dy_path_supported, relu_conv2d
from .conv_union import union_path_supported, union_path_supported_for
from ..kernels.adaptive_union import union_operand
from .linear import relu_linear

__all__ = ["CostEntry", "Calibration", "default_calibration", "layer_key", "KERNEL_VERSION"]

#: bumped whenever the sparse kernels change speed, so cached entries of older kernels are re-measured
KERNEL_VERSION = 26


#: output-gradient densities at which the dY-driven backward is timed
_DY_DENSITIES = (0.5, 0.15)


@dataclass
class CostEntry:
    """Forward+backward milliseconds: dense, and sparse = ``fixed_ms + slope_ms * density``.

    The slope is measured with a dense output gradient, so all three GEMMs scale with the activation
    density. Where the layer has the dY-driven backward (``dy_path``) its own measured model
    ``dy_fixed_ms + slope_ms * density / 3 + dy_slope_ms * grad_density`` also counts, and the cheaper
    of the two predicts. Without that measurement (``dy_fixed_ms`` / ``dy_slope_ms`` None) nothing is
    assumed about the dY path: the activation-driven model alone predicts.
    """

    dense_ms: float
    fixed_ms: float
    slope_ms: float
    dy_path: bool = False
    #: measured dY-driven time ``dy_fixed_ms + slope_ms * density / 3 + dy_slope_ms * grad_density``
    #: (when calibrated; the sparse time is then the cheaper of the two paths)
    dy_fixed_ms: Optional[float] = None
    dy_slope_ms: Optional[float] = None
    #: UnionOperand.union_ratio of the calibration input (union kernels only): the activation-driven
    #: work of the 4-pixel kernels scales with it, and inputs of the same shape differ (BatchNorm nets'
    #: zeros are less clustered than plain ReLU nets'), so a layer's own ratio rescales ``slope_ms``
    union_ratio: Optional[float] = None

    def _scale(self, union_ratio: Optional[float]) -> float:
        if union_ratio is None or not self.union_ratio:
            return 1.0
        return min(2.0, max(0.5, float(union_ratio) / self.union_ratio))

    def sparse_ms(
        self, density: float, grad_density: Optional[float] = None, union_ratio: Optional[float] = None
    ) -> float:
        d = float(density) * self._scale(union_ratio)
        t = self.fixed_ms + self.slope_ms * d
        if not self.dy_path or grad_density is None:
            return t
        if self.dy_fixed_ms is None or self.dy_slope_ms is None:
            return t
        return min(t, self.dy_fixed_ms + self.slope_ms * d / 3.0 + self.dy_slope_ms * float(grad_density))

    def speedup(
        self, density: float, grad_density: Optional[float] = None, union_ratio: Optional[float] = None
    ) -> float:
        return self.dense_ms / max(1e-9, self.sparse_ms(density, grad_density, union_ratio))


def _machine() -> str:
    """The CPU model and the kernel ISA in force: timings of one CPU say nothing about another."""
    model = "-".join(cpu.cpu_model().split())
    return f"{model}/{cpu.isa()}"


def layer_key(kind: str, x_shape, w_shape, conv_args: dict, channels_last: bool) -> str:
    """Cache key of a layer: CPU and ISA, kind, shapes, conv arguments, memory format, threads, native or not."""
    args = ",".join(f"{k}={tuple(v) if isinstance(v, (list, tuple)) else v}" for k, v in sorted(conv_args.items()))
    return (
        f"{_machine()}|{kind}|x={tuple(x_shape)}|w={tuple(w_shape)}|{args}|cl={int(channels_last)}"
        f"|t={torch.get_num_threads()}|native={int(loader.native_enabled())}|kernels={KERNEL_VERSION}"
    )


def _thresholded(x: Tensor, density: float) -> Tensor:
    """``x`` with its smallest positive values zeroed so that about ``density`` of it stays nonzero."""
    flat = x.detach().reshape(-1)
    sample = flat[torch.randint(0, flat.numel(), (min(flat.numel(), 200_000),))]
    t = torch.quantile(sample.float(), 1.0 - density)
    return torch.where(x > t, x, torch.zeros((), dtype=x.dtype))


def _union_ratio(kind: str, a: Tensor, weight: Tensor) -> Optional[float]:
    """UnionOperand.union_ratio of the (relu'd) calibration input when the layer runs the union kernels."""
    x4 = a if kind == "conv2d" else a.reshape(-1, a.shape[-1]).t().unsqueeze(0).unsqueeze(-1)
    w4 = weight if kind == "conv2d" else weight.unsqueeze(-1).unsqueeze(-1)
    if not union_path_supported(x4, w4, None):
        return None
    return union_operand(x4.detach()).union_ratio()


class Calibration:
    """The per-machine cost models of adaptive layers; :meth:`entry` measures missing layers.

    Entries live in a :class:`~sparsa.cost_model.CostModel` under keys starting with ``adaptive|``: the
    process's default table (:func:`sparsa.cost_model.default_cost_model`), or a table of their own at
    ``path`` (tests, or a calibration kept apart).
    """

    PREFIX = "adaptive|"

    def __init__(self, path: Optional[os.PathLike] = None, reps: int = 2, *, cost_model: Optional[CostModel] = None):
        if path is not None and cost_model is not None:
            raise ValueError("Calibration: pass path or cost_model, not both")
        self.store = (
            cost_model
            if cost_model is not None
            else (CostModel(Path(path)) if path is not None else default_cost_model())
        )
        self.reps = int(reps)
        self._lock = threading.Lock()
        self._table: Dict[str, CostEntry] = {}
        for k in self.store.fit_keys(self.PREFIX):
            try:
                self._table[k[len(self.PREFIX) :]] = CostEntry(**self.store.fit(k))
            except TypeError:
                pass  # written by another version of CostEntry: measured again when needed

    def __reduce__(self):
        # A saved model must not carry one machine's timings to another: the process-wide table is
        # restored as the loading process's own, a file-backed one is re-read from its file there.
        if self.store is default_cost_model():
            return (default_calibration, ())
        if self.store.path is not None:
            return (Calibration, (self.store.path, self.reps))
        return (_calibration_in_memory, (self.store, self.reps))

    @property
    def path(self) -> Optional[Path]:
        """The file behind the table (None when it is kept in memory only)."""
        return self.store.path

    def __len__(self) -> int:
        return len(self._table)

    def get(self, key: str) -> Optional[CostEntry]:
        return self._table.get(key)

    def clear(self) -> None:
        """Forget every entry: the next use measures again (other timings in the table stay)."""
        with self._lock:
            self._table.clear()
        self.store.forget(self.PREFIX)

    def save(self) -> None:
        with self._lock:
            items = list(self._table.items())
        for k, v in items:
            self.store.set_fit(self.PREFIX + k, asdict(v), save=False)
        self.store.save()

    def entry(
        self, kind: str, x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_args: dict, slice: int
    ) -> CostEntry:
        """The cached entry for this layer, measuring it on ``x`` (its real input) if missing."""
        cl = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        key = layer_key(kind, x.shape, weight.shape, conv_args, cl)
        if autocast_bf16():
            key += "|autocast=bf16"  # the dense side is bf16 here
        e = self._table.get(key)
        if e is None:
            e = self.measure(kind, x, weight, bias, conv_args, slice)
            self._table[key] = e
            self.save()
        return e

    def measure(
        self, kind: str, x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_args: dict, slice: int
    ) -> CostEntry:
        """Time dense and sparse forward+backward on ``relu(x)`` and on a sparser copy of it (both as the
        training step runs them: under bf16 autocast, dense in bf16 and sparse through the fp32 kernels)."""
        a = x.detach().relu()
        w = weight.detach().clone().requires_grad_(True)
        b = None if bias is None else bias.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            if kind == "conv2d":
                y0 = F.conv2d(a, w, b, **conv_args)
                dense = lambda xi: F.conv2d(xi, w, b, **conv_args)  # noqa: E731
                bf16_ops = union_path_supported_for(torch.bfloat16, x.device, w, b)
                sparse = lambda xi: sparse_under_autocast(  # noqa: E731
                    lambda t: relu_conv2d(t, w, b, slice=slice, **conv_args), xi, bf16_operands=bf16_ops
                )
            else:
                y0 = F.linear(a, w, b)
                dense = lambda xi: F.linear(xi, w, b)  # noqa: E731
                sparse = lambda xi: sparse_under_autocast(  # noqa: E731
                    lambda t: relu_linear(t, w, b, slice=slice), xi
                )
            gy = torch.randn_like(y0)

            def run(f, xi, g=gy):
                with torch.no_grad():
                    w.mul_(1.0)  # a new weight version, as after an optimizer step (re-packs the weight)
                xi = xi.detach().requires_grad_(True)
                y = f(xi)
                with torch.autocast("cpu", enabled=False):  # backward as a training loop runs it: outside autocast
                    y.backward(g)

            d1 = float((a != 0).float().mean())
            d2 = d1 / 4
            fns = {"dense": lambda: run(dense, a), "t1": lambda: run(sparse, a)}
            if d1 > 0.02:
                a2 = _thresholded(a, d2)
                d2 = float((a2 != 0).float().mean())
                fns["t2"] = lambda: run(sparse, a2)
            # a bf16 input (under autocast) has the dY-driven backward wherever an fp32 one has it (the bf16
            # union kernels', or the fp32 kernels' on the widened input)
            x32 = torch.empty(x.shape, dtype=torch.float32, device="meta")  # the check reads shape and dtype only
            dyp = kind == "conv2d" and dy_path_supported(x32, weight, **conv_args)
            if dyp:
                # the dY-driven backward at two output-gradient densities. dY's zeros are where the next
                # ReLU is inactive, i.e. where this layer's output is small: keep gy where y0 is largest.
                # (Independent random zeros would overstate the union kernels' cost: 4 neighbouring pixels
                # share far fewer zeros at random than real ReLU patterns do.)
                ys = y0.detach()
                for i, gd in enumerate(_DY_DENSITIES):
                    g = torch.where(_thresholded(ys - ys.min(), gd) != 0, gy, torch.zeros(()))
                    fns[f"u{i}"] = lambda g=g: run(sparse, a, g)
            t = round_robin_ms(fns, 2 * self.reps + 1)
        ur = _union_ratio(kind, a.float(), weight)
        dense_ms, t1 = t["dense"], t["t1"]
        if d1 <= 0.02 or d1 - d2 < 0.01:  # too sparse for a second point: a fixed share is assumed
            fixed, slope = 0.1 * t1, 0.9 * t1 / max(d1, 1e-3)
        else:
            slope = max(0.0, (t1 - t["t2"]) / (d1 - d2))
            fixed = max(0.0, t1 - slope * d1)
        if not dyp:
            return CostEntry(dense_ms, fixed, slope, union_ratio=ur)
        (g1, g2), u1, u2 = _DY_DENSITIES, t["u0"], t["u1"]
        dy_slope = max(0.0, (u1 - u2) / (g1 - g2))
        dy_fixed = max(0.0, u1 - dy_slope * g1 - slope * d1 / 3.0)
        return CostEntry(dense_ms, fixed, slope, True, dy_fixed, dy_slope, union_ratio=ur)


def _calibration_in_memory(store: CostModel, reps: int) -> Calibration:
    return Calibration(reps=reps, cost_model=store)


_DEFAULT: Dict[int, Calibration] = {}


def default_calibration() -> Calibration:
    """The process-wide calibration: the adaptive entries of :func:`sparsa.cost_model.default_cost_model`."""
    cm = default_cost_model()
    cal = _DEFAULT.get(id(cm))
    if cal is None:
        cal = _DEFAULT[id(cm)] = Calibration(cost_model=cm)
    return cal
