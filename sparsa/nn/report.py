"""Per-tensor sparsity report of a model: :func:`sparsity_report` rows and :func:`format_report`.

>>> import torch.nn as nn, sparsa
>>> m = sparsa.sparsify(nn.Linear(8, 8), sparsa.sparsifiers.Magnitude(0.5))
>>> rows = sparsa.sparsity_report(m)
>>> [(r["name"], r["layout"], r["sparsity"]) for r in rows]
[('weight', 'masked', 0.5), ('bias', 'dense', 0.0)]
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

from ..tensor import SparseTensor
from .hooks import GradLayout, OutputSparsifier

__all__ = ["sparsity_report", "format_report", "PATH_ATTR"]

#: the module attribute holding ``(layout, decision)``: ``only_if_faster``'s decision for its weight
PATH_ATTR = "_sparsa_weight_path"


def _row(name: str, t: torch.Tensor, target: str) -> Dict[str, Any]:
    dense_nbytes = t.numel() * t.element_size()
    if isinstance(t, SparseTensor):
        lay = t.sparse_layout
        layout, sparsity, nbytes = type(lay).name, lay.sparsity, lay.nbytes
        params = lay.params()
    else:
        layout, nbytes, params = "dense", dense_nbytes, {}
        sparsity = float((t.detach() == 0).sum()) / t.numel() if t.numel() else 0.0
    return {
        "name": name,
        "target": target,
        "layout": layout,
        "shape": tuple(t.shape),
        "sparsity": sparsity,
        "nbytes": nbytes,
        "dense_nbytes": dense_nbytes,
        "params": params,
    }


def sparsity_report(model: nn.Module) -> List[Dict[str, Any]]:
    """One row per parameter and sparse buffer, plus one per sparsified module output.

    Row keys: ``name``, ``target`` (``"weight"``/``"buffer"``/``"output"``), ``layout``, ``shape``,
    ``sparsity`` (fraction of unstored values; for dense tensors the fraction of exact zeros),
    ``nbytes`` (bytes actually stored), ``dense_nbytes``, ``params`` (layout parameters) and, for
    sparse parameters, ``grad_layout`` when a gradient layout is attached. Weights pruned by
    :class:`sparsa.methods.OneShot` also carry ``path``, ``ratio_vs_dense``, ``ratio_vs_best_dense`` and
    ``best_dense`` (its ``only_if_faster`` decision; None where not measured). Output rows describe the
    last forward pass (``shape`` is None before the first one).
    """
    rows = []
    paths = {
        f"{n}.weight" if n else "weight": getattr(m, PATH_ATTR)
        for n, m in model.named_modules()
        if hasattr(m, PATH_ATTR)
    }
    for name, p in model.named_parameters():
        r = _row(name, p, "weight")
        layout, decision = paths.get(name, (None, None))
        if decision is not None and layout == r["layout"]:
            r.update(decision)
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        gl = [h.layout.name for h in hooks.values() if isinstance(h, GradLayout)]
        if gl:
            r["grad_layout"] = gl[-1]
        rows.append(r)
    for name, b in model.named_buffers():
        if isinstance(b, SparseTensor):
            rows.append(_row(name, b, "buffer"))
    for mname, mod in model.named_modules():
        for h in mod._forward_hooks.values():
            if isinstance(h, OutputSparsifier):
                shape, sp, nb, dnb = h.last if h.last is not None else (None, None, None, None)
                rows.append(
                    {
                        "name": f"{mname}:output" if mname else "output",
                        "target": "output",
                        "layout": h.layout.name,
                        "shape": shape,
                        "sparsity": sp,
                        "nbytes": nb,
                        "dense_nbytes": dnb,
                        "params": dict(h.params),
                    }
                )
    return rows


def _kib(n: Any) -> str:
    return "-" if n is None else f"{n / 1024:.1f}"


def format_report(rows: List[Dict[str, Any]]) -> str:
    """A plain-text table of :func:`sparsity_report` rows with a total line (weights/buffers only).

    A row that ``only_if_faster`` turned dense shows the measured sparse speed-up; a sparse row measured
    against several dense paths shows its speed-up over the fastest of them."""
    head = ["name", "layout", "shape", "sparsity", "KiB", "dense KiB", "ratio"]
    body = []
    for r in rows:
        shape = "-" if r["shape"] is None else "x".join(map(str, r["shape"])) or "scalar"
        sp = "-" if r["sparsity"] is None else f"{100 * r['sparsity']:.1f}%"
        ratio = "-" if not r["nbytes"] else f"{r['dense_nbytes'] / r['nbytes']:.2f}x"
        layout = r["layout"] + (f" (grad: {r['grad_layout']})" if r.get("grad_layout") else "")
        if r.get("path", "sparse") != "sparse" and r.get("ratio_vs_dense") is not None:  # only_if_faster fell back
            layout += f" (sparse was {r['ratio_vs_dense']:.2f}x)"
            if r["path"] != "dense":
                layout += f" -> {r['path']}"
        elif r.get("path") == "sparse" and r.get("ratio_vs_best_dense") is not None and r.get("best_dense"):
            layout += f" ({r['ratio_vs_best_dense']:.2f}x vs {r['best_dense'].replace('dense_', 'dense ')})"
        body.append([r["name"], layout, shape, sp, _kib(r["nbytes"]), _kib(r["dense_nbytes"]), ratio])
    stored = [r for r in rows if r["target"] != "output"]
    tot, dtot = sum(r["nbytes"] for r in stored), sum(r["dense_nbytes"] for r in stored)
    body.append(["total (parameters)", "", "", "", _kib(tot), _kib(dtot), f"{dtot / tot:.2f}x" if tot else "-"])
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]

    def fmt(cells):
        return "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(head), sep] + [fmt(b) for b in body[:-1]] + [sep, fmt(body[-1])])
