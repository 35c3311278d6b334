"""Acceptance #8: a new layout + sparsifier + linear implementation, defined here, plug into sparsify
and the dispatcher with no library change."""

import torch
import torch.nn as nn

import sparsa
from sparsa.layouts import Dense, Layout, register_layout
from sparsa.sparsifiers import Sparsifier


# ---------------------------------------------------------------- the user's code (~60 lines)
class RowsKept(Layout):
    """Row sparsity: the indices of the kept rows and their values."""

    name = "rows_kept"

    def __init__(self, rows, values, shape):
        self.rows, self.values, self.shape, self.dtype = rows, values, torch.Size(shape), values.dtype

    @classmethod
    def from_dense(cls, dense, mask=None, **params):
        keep = (dense != 0).any(-1) if mask is None else mask.any(-1)
        rows = keep.nonzero().flatten()
        return cls(rows, dense[rows], dense.shape)

    def to_dense(self):
        out = self.values.new_zeros(self.shape)
        out[self.rows] = self.values
        return out

    def components(self):
        return {"rows": self.rows, "values": self.values}

    @classmethod
    def from_components(cls, components, shape, **params):
        return cls(components["rows"], components["values"], shape)

    def validate(self):
        assert self.values.shape == (len(self.rows),) + tuple(self.shape[1:])


register_layout(RowsKept, replace=True)


class TopRows(Sparsifier):
    """Keep the ``k`` rows with the largest L2 norm."""

    def __init__(self, k):
        self.k = k

    def _mask(self, dense):
        keep = torch.zeros(dense.shape[0], dtype=torch.bool)
        keep[dense.norm(dim=-1).topk(self.k).indices] = True
        return keep[:, None].expand_as(dense).clone()


CALLS = []


@sparsa.implements("linear", (Dense, RowsKept, Dense), replace=True)
class RowsKeptLinear:
    @staticmethod
    def forward(ctx, x, w, b):
        CALLS.append(x.shape)
        ctx.save_for_backward(x, w.rows, w.values)
        out = x.new_zeros(x.shape[:-1] + (w.shape[0],))
        out[..., w.rows] = x @ w.values.T
        return out if b is None else out + b

    @staticmethod
    def backward(ctx, g):
        x, rows, values = ctx.saved_tensors
        gw = g.new_zeros(g.shape[-1], x.shape[-1])
        gw[rows] = g[..., rows].reshape(-1, len(rows)).T @ x.reshape(-1, x.shape[-1])
        return g[..., rows] @ values, gw, g.reshape(-1, g.shape[-1]).sum(0)


# ---------------------------------------------------------------- end of the user's code


def test_new_layout_sparsifier_and_op_plug_in():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    masked = sparsa.sparsify(model, sparsa.Rule(sparsifier=TopRows(6), names="0"), inplace=False)
    dense = sparsa.densify(masked)  # reference: plain weights with the same rows zeroed
    sparsa.sparsify(model, sparsa.Rule(sparsifier=TopRows(6), layout="rows_kept", names="0"))
    w = model[0].weight
    assert w.layout_name == "rows_kept" and w.nnz == 6 * 12 and len(w.sparse_layout.rows) == 6
    sparsa.reset_fallback_counts()
    CALLS.clear()
    x = torch.randn(5, 12, requires_grad=True)
    xd = x.detach().clone().requires_grad_(True)
    out, ref = model(x), dense(xd)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, xd.grad)
    torch.testing.assert_close(model[0].weight.grad * w.pattern(), dense[0].weight.grad * w.pattern())
    torch.testing.assert_close(model[0].bias.grad, dense[0].bias.grad)
    assert CALLS == [(5, 12)]
    assert not [k for k in sparsa.fallback_counts() if k[0] == "linear"]  # no dense fallback
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    pattern = w.pattern().clone()
    opt.step()  # the pattern survives an optimizer step through the layout's default refill
    assert model[0].weight.layout_name == "rows_kept" and torch.equal(model[0].weight.pattern(), pattern)
