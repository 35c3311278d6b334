"""The per-layer report of the adaptive runtime: sparsity, chosen path, predicted and measured time.

Example::

    >>> import torch, sparsa.adaptive as sa
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    >>> rt = sa.enable(net, policy=sa.Policy(force="sparse"))
    >>> _ = net(torch.randn(4, 8))
    >>> print(sa.format_report(rt.report()).splitlines()[0].split()[:3])
    ['layer', 'kind', 'sparsity']
"""

from __future__ import annotations

from typing import List

__all__ = ["report", "format_report"]

_COLUMNS = [
    ("layer", 18),
    ("kind", 7),
    ("sparsity", 9),
    ("dy_sparsity", 12),
    ("union_ratio", 12),
    ("source", 7),
    ("path", 7),
    ("kernels", 8),
    ("pred_speedup", 13),
    ("kappa", 6),
    ("dense_ms", 9),
    ("sparse_ms", 10),
    ("fwd_ms", 8),
    ("calls", 6),
]


def report(runtime) -> List[dict]:
    """One dict per adaptive layer of ``runtime`` (an :class:`~sparsa.adaptive.AdaptiveRuntime`).

    Keys: ``layer``, ``kind``, ``sparsity`` (monitored, element-wise), ``dy_sparsity`` (zero fraction of
    the output gradient, sampled in backward on refresh calls), ``union_ratio`` (how clustered the zeros
    are, 1-4, union kernels only), ``empty_slices`` (fraction of empty (pixel, slice) lists), ``source``
    (sample/count), ``path``, ``kernels`` (union/list), ``pred_speedup`` (the cost model's, times the
    measured correction), ``model_speedup`` (the cost model's alone), ``kappa`` (the correction from
    forward+backward times measured in training, see :mod:`~sparsa.adaptive.feedback`; None when not
    measured), ``measured_speedup`` (median measured dense over sparse time), ``probes`` (dense calls run to
    measure), ``dense_ms`` / ``sparse_ms`` (calibrated forward+backward at the monitored sparsity),
    ``fwd_ms`` (measured forward on the current path), ``calls``, ``paired_calls``, ``sparse_calls``,
    ``switches``.
    """
    rows = []
    for name, st in runtime.layers.items():
        m = st.monitor
        cost = st.cost
        rows.append(
            {
                "layer": name,
                "kind": st.kind,
                "sparsity": m.sparsity,
                "dy_sparsity": st.grad_sparsity,
                "union_ratio": st.union_ratio,
                "empty_slices": m.empty_slices,
                "source": m.source,
                "path": st.path if st.paired_calls else "dense",
                "kernels": st.kernels,
                "supported": st.supported,
                "pred_speedup": st.speedup,
                "model_speedup": st.model_speedup,
                "kappa": st.feedback.kappa(),
                "measured_speedup": st.feedback.measured_speedup(),
                "probes": st.feedback.probes,
                "dense_ms": None if cost is None else cost.dense_ms,
                "sparse_ms": st.predicted_ms("sparse"),
                "fwd_ms": st.fwd_ms.get(st.path),
                "calls": st.calls,
                "paired_calls": st.paired_calls,
                "sparse_calls": st.sparse_calls,
                "switches": st.switches,
            }
        )
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def format_report(rows: List[dict]) -> str:
    """A fixed-width text table of :func:`report` rows."""
    head = " ".join(name.ljust(w) for name, w in _COLUMNS)
    lines = [head]
    for r in rows:
        lines.append(" ".join(_fmt(r.get(name)).ljust(w) for name, w in _COLUMNS))
    return "\n".join(lines)
