"""One conformance suite for every registered layout (as scipy.sparse runs one test class per format).

``SPECS`` says, for every layout that ``sparsa.layouts`` registers, how to build valid instances
from a dense tensor (parameters and a mask the layout accepts). :class:`TestLayoutConformance` then
runs the same property tests on each of them against the dense reference: ``from_dense`` /
``to_dense`` round trip and pattern bookkeeping, conversions, ``F.linear`` forward and backward,
an optimizer step, ``sparsa.save`` / ``sparsa.load`` and ``copy.deepcopy``.

A layout registered without a ``SPECS`` entry fails :func:`test_every_library_layout_has_a_spec`,
so a new layout cannot escape the suite. What a layout legitimately cannot do is listed in
``EXCEPTIONS`` (with the reason), and the suite checks the documented behaviour there instead of
skipping.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import Tensor

import sparsa
from sparsa.layouts import (
    GroupedNM,
    conversion_path,
    convert,
    grouped_nm_mask,
    nm_mask,
    registered_layouts,
    row_group_mask,
)

SETTINGS = settings(max_examples=10, deadline=None)

MaskFn = Callable[[Tensor, Dict[str, Any], torch.Generator], Tensor]


def _random_mask(x: Tensor, params: Dict[str, Any], gen: torch.Generator) -> Tensor:
    """Any pattern: density drawn per call (empty and full masks included)."""
    density = [0.0, 0.3, 0.7, 1.0][int(torch.randint(4, (), generator=gen))]
    return torch.rand(x.shape, generator=gen) < density


def _scores(x: Tensor, gen: torch.Generator) -> Tensor:
    # a pattern independent of the values, so explicit zeros of x can be inside it
    return torch.rand(x.shape, generator=gen) + 0.1


def _thinned(mask: Tensor, gen: torch.Generator) -> Tensor:
    """Half the time drop some kept positions: a sparser mask than the structure allows is valid too."""
    if bool(torch.randint(2, (), generator=gen)):
        return mask & (torch.rand(mask.shape, generator=gen) < 0.6)
    return mask


def _positive(x, p, gen):
    """Any pattern of positive values (a ReLU output's pattern)."""
    return _random_mask(x, p, gen) & (x > 0)


def _nm(x, p, gen):
    return _thinned(nm_mask(_scores(x, gen), p["n"], p["m"]), gen)


def _grouped_nm(x, p, gen):
    return _thinned(grouped_nm_mask(_scores(x, gen), p["n"], p["m"], p["g"]), gen)


def _row_group(x, p, gen):
    sparsity = [0.0, 0.5, 0.8][int(torch.randint(3, (), generator=gen))]
    permute = bool(torch.randint(2, (), generator=gen))
    return row_group_mask(_scores(x, gen), sparsity, p["group"], permute=permute)


@dataclass(frozen=True)
class Spec:
    """How to build valid instances of one layout.

    ``variants``: parameter sets passed to ``from_dense`` / expected back from ``params()``;
    ``mask``: a mask the layout accepts for a variant; ``exact``: ``mask()`` is exactly the given
    mask (else a documented superset: structured layouts fill their structure with stored zeros,
    Dense stores everything); ``any_mask``: accepts every pattern (so it is a target of the dense
    conversion route from any layout); ``auto``: extra ``from_dense`` arguments when no mask is
    given; ``ndims``: tensor ranks it stores.
    """

    variants: Tuple[Dict[str, Any], ...] = ({},)
    mask: MaskFn = _random_mask
    exact: bool = True
    any_mask: bool = True
    auto: Dict[str, Any] = field(default_factory=dict)
    ndims: Tuple[int, ...] = (2,)


SPECS: Dict[str, Spec] = {
    "dense": Spec(exact=False, ndims=(1, 2, 3)),
    "masked": Spec(ndims=(1, 2, 3)),
    "coo": Spec(ndims=(1, 2, 3)),
    "csr": Spec(),
    "bsr": Spec(variants=({"blocksize": (2, 3)}, {"blocksize": (4, 4)}, {"blocksize": (1, 1)})),
    "bitmask": Spec(),
    "sliced_ell": Spec(),
    "nm": Spec(variants=({"n": 2, "m": 4}, {"n": 1, "m": 3}), mask=_nm, exact=False, any_mask=False, ndims=(2, 3)),
    "grouped_nm": Spec(
        variants=({"n": 2, "m": 4, "g": 2}, {"n": 1, "m": 3, "g": 3}), mask=_grouped_nm, exact=False, any_mask=False
    ),
    "row_group": Spec(
        variants=({"group": 4}, {"group": 8}), mask=_row_group, exact=False, any_mask=False, auto={"sparsity": 0.5}
    ),
    "relu_compact": Spec(variants=({"slice": 128}, {"slice": 3}), mask=_positive, ndims=(2, 4)),
}

#: (layout, capability) -> a bug this suite found and did not fix here; the test is xfail(strict=True)
KNOWN_BUGS: Dict[Tuple[str, str], str] = {}

#: (layout, capability) -> why the layout cannot do it; the test asserts the documented behaviour
EXCEPTIONS: Dict[Tuple[str, str], str] = {
    ("dense", "sparse_linear"): "Dense is the dispatcher's name for a plain tensor: no sparse kernel exists, so "
    "F.linear runs densely through the counted fallback (and raises in strict mode)",
    ("dense", "structured_target"): "Dense stores every position: converting it to a structured layout passes "
    "the full pattern, which the target rejects with a ValueError naming the "
    "mask unless it fits (e.g. RowGroup, or N:M with fewer than n+1 columns)",
    ("relu_compact", "negative_values"): "ReluCompact stores relu(x): from_dense without a mask keeps the positive "
    "values (not every nonzero); a mask, a refill (so an optimizer step) or a "
    "conversion that would store a negative value raises a ValueError naming "
    "the mask. The suite checks that, and the value properties on data >= 0",
}


def _relu_only(name: str) -> bool:
    return (name, "negative_values") in EXCEPTIONS


def _library_layouts() -> Dict[str, type]:
    """Layouts the library itself registers (tests may register their own at run time)."""
    return {k: v for k, v in registered_layouts().items() if v.__module__.startswith("sparsa.layouts.")}


NAMES = sorted(SPECS)


def test_every_library_layout_has_a_spec():
    missing = sorted(set(_library_layouts()) - set(SPECS))
    assert not missing, (
        f"layouts {missing} are registered but have no entry in SPECS of "
        f"{os.path.basename(__file__)}: add one so the conformance suite covers them"
    )
    stale = sorted(set(SPECS) - set(_library_layouts()))
    assert not stale, f"SPECS names layouts that are not registered: {stale}"
    bad = sorted(k for k in list(EXCEPTIONS) + list(KNOWN_BUGS) if k[0] not in SPECS)
    assert not bad, f"EXCEPTIONS names unknown layouts: {bad}"


# ----------------------------------------------------------------------------- helpers
def _shape(data, name: str, ndim: int = 2, empty: bool = False) -> Tuple[int, ...]:
    sizes = st.sampled_from(([0] if empty else []) + [1, 2, 3, 5, 7, 9, 13])
    return tuple(data.draw(st.lists(sizes, min_size=ndim, max_size=ndim), label="shape"))


def _case(data, name: str, ndim: int = 2, empty: bool = False):
    """(layout class, params, x with explicit zeros, a valid mask, generator); ``empty``: sizes of 0 too."""
    spec = SPECS[name]
    params = data.draw(st.sampled_from(spec.variants), label="params")
    shape = _shape(data, name, ndim, empty)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x = torch.randn(shape, generator=gen)
    x[torch.rand(shape, generator=gen) < 0.2] = 0.0  # explicit zeros inside masks
    mask = spec.mask(x, params, gen)
    return registered_layouts()[name], params, x, mask, gen


def _params_equal(got: Dict[str, Any], want: Dict[str, Any]) -> None:
    norm = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in got.items()}
    for k, v in want.items():
        assert norm[k] == (tuple(v) if isinstance(v, (list, tuple)) else v), (k, got)


def _check_pattern(name: str, lay, mask: Tensor) -> None:
    got = lay.mask()
    assert got.dtype == torch.bool and got.shape == mask.shape
    if SPECS[name].exact:
        assert torch.equal(got, mask)
    else:
        assert bool((got | ~mask).all()), "the stored pattern must contain the given mask"


def _components_equal(a, b) -> None:
    ca, cb = a.components(), b.components()
    assert list(ca) == list(cb)
    for k in ca:
        assert ca[k].dtype == cb[k].dtype and torch.equal(ca[k], cb[k]), k


def _no_fallback() -> bool:
    return not [k for k in sparsa.fallback_counts() if k[0] == "linear"]


# ----------------------------------------------------------------------------- the suite
@pytest.mark.parametrize("name", NAMES)
class TestLayoutConformance:
    @SETTINGS
    @given(data=st.data())
    def test_roundtrip_and_counts(self, name, data):
        ndim = data.draw(st.sampled_from(SPECS[name].ndims), label="ndim")
        cls, params, x, mask, gen = _case(data, name, ndim, empty=True)
        lay = cls.from_dense(x, mask=mask, **params)
        lay.validate()
        assert type(lay) is cls and type(lay).name == name
        d = lay.to_dense()
        assert d.shape == x.shape and d.dtype == x.dtype and lay.dtype == x.dtype
        assert tuple(lay.shape) == tuple(x.shape)
        assert torch.equal(d, x * mask), "values where the mask keeps, zeros elsewhere"
        _check_pattern(name, lay, mask)
        pattern = lay.mask()
        assert torch.equal(d, d * pattern), "nothing stored outside mask()"
        assert lay.nnz == int(pattern.sum())
        g = torch.randn(x.shape, generator=gen)
        assert torch.equal(lay.restrict(g), g * pattern), "restrict keeps the stored pattern only"
        numel = math.prod(x.shape)
        assert lay.density == pytest.approx(lay.nnz / numel if numel else 0.0)
        assert lay.sparsity == pytest.approx(1.0 - lay.nnz / numel if numel else 0.0)
        assert lay.nbytes == sum(t.numel() * t.element_size() for t in lay.components().values())
        _params_equal(lay.params(), params)
        # from_components(components(), shape, **params()) rebuilds the same layout
        again = cls.from_components(lay.components(), lay.shape, **lay.params())
        _components_equal(again, lay)
        assert torch.equal(again.to_dense(), d) and torch.equal(again.mask(), pattern)
        # refill keeps the pattern and takes new values
        y = torch.randn(x.shape, generator=gen)
        if _relu_only(name):
            if bool((y < 0)[pattern].any()):
                with pytest.raises(ValueError, match="mask"):
                    lay.refill(y)
            y = y.abs()
        r = lay.refill(y)
        r.validate()
        assert type(r) is cls and torch.equal(r.mask(), pattern)
        assert torch.equal(r.to_dense(), y * pattern)
        # map_tensors / to() keep the layout
        d64 = lay.to(torch.float64)
        assert d64.dtype == torch.float64 and torch.equal(d64.mask(), pattern)
        assert torch.equal(d64.to_dense(), d.double())

    @SETTINGS
    @given(data=st.data())
    def test_from_dense_without_mask(self, name, data):
        spec = SPECS[name]
        ndim = data.draw(st.sampled_from(spec.ndims), label="ndim")
        cls, params, x, _, _ = _case(data, name, ndim, empty=True)
        lay = cls.from_dense(x, **params, **spec.auto)
        lay.validate()
        pattern = lay.mask()
        assert torch.equal(lay.to_dense(), x * pattern)
        if _relu_only(name):
            assert torch.equal(pattern, x > 0), "without a mask relu(x) is stored"
        elif spec.exact and not spec.auto:
            assert torch.equal(pattern, x != 0), "without a mask the nonzeros are kept"

    @pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
    def test_empty(self, name, shape):
        """Weights with no rows or no columns (regression: RowGroup with 0 columns used to crash in
        _slot_groups / _kept_count)."""
        cls = registered_layouts()[name]
        params = SPECS[name].variants[0]
        x = torch.zeros(shape)
        mask = torch.zeros(shape, dtype=torch.bool)
        key = (name, "empty")
        if key in EXCEPTIONS:
            with pytest.raises(ValueError):
                cls.from_dense(x, mask=mask, **params)
            return
        lay = cls.from_dense(x, mask=mask, **params)
        lay.validate()
        assert lay.to_dense().shape == shape and lay.density == 0.0
        assert lay.nnz == (0 if name != "dense" else math.prod(shape))
        again = cls.from_components(lay.components(), lay.shape, **lay.params())
        assert again.to_dense().shape == shape
        auto = cls.from_dense(x, **params, **SPECS[name].auto)  # the mask-free route too
        assert auto.to_dense().shape == shape and auto.density == 0.0

    @pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
    def test_empty_linear(self, name, shape):
        """F.linear with an empty weight (no outputs, or no inputs: the bias), forward and backward; there
        is nothing to compute, so it is not a dense fallback (it runs under sparsa.strict())."""
        cls = registered_layouts()[name]
        lay = cls.from_dense(torch.zeros(shape), mask=torch.zeros(shape, dtype=torch.bool), **SPECS[name].variants[0])
        R, K = shape
        xs = torch.randn(3, K, requires_grad=True)
        b = torch.randn(R, requires_grad=True)
        p = nn.Parameter(sparsa.SparseTensor(lay))
        with sparsa.strict():
            out = F.linear(xs, p, b)
            assert out.shape == (3, R)
            torch.testing.assert_close(out, b.detach().expand(3, R))
            out.sum().backward()
        assert xs.grad.shape == (3, K) and not bool(xs.grad.any())
        torch.testing.assert_close(b.grad, torch.full((R,), 3.0))

    def test_linear_no_tokens(self, name):
        """An input with no tokens (a leading dim of 0) gives an empty output and empty gradients."""
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(9, 13, generator=gen)
        params = SPECS[name].variants[0]
        lay = registered_layouts()[name].from_dense(w, mask=SPECS[name].mask(w, params, gen), **params)
        p = nn.Parameter(sparsa.SparseTensor(lay))
        for lead in [(0,), (2, 0)]:
            xs = torch.randn(lead + (13,), requires_grad=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
                out = F.linear(xs, p, torch.ones(9))
                assert out.shape == lead + (9,)
                out.sum().backward()
            assert xs.grad.shape == xs.shape
            g = p.grad.to_dense() if isinstance(p.grad, sparsa.SparseTensor) else p.grad
            assert g.shape == (9, 13) and not bool(g.any())
            p.grad = None

    @SETTINGS
    @given(data=st.data())
    def test_conversions(self, name, data):
        """To every layout: through the conversion graph where a path exists, else the dense route
        (any-pattern targets take any source; structured targets take a source built on their mask)."""
        cls, params, x, mask, gen = _case(data, name)
        lay = cls.from_dense(x, mask=mask, **params)
        dense, pattern = lay.to_dense(), lay.mask()
        # the tensor-level entry points: sparsa.to_sparse and SparseTensor.to_layout
        t = sparsa.to_sparse(x, name, mask=mask, requires_grad=True, **params)
        assert t.layout_name == name and t.requires_grad and torch.equal(t.to_dense().detach(), dense)
        for dst_name, dst in sorted(_library_layouts().items()):
            if dst is cls:
                assert convert(lay, cls) is lay
                continue
            dst_spec = SPECS[dst_name]
            if _relu_only(dst_name):
                src = lay
                if bool((dense < 0).any()):
                    with pytest.raises(ValueError, match="mask"):
                        convert(lay, dst)
                    src = cls.from_dense(x.abs(), mask=mask, **params)  # the same pattern, values >= 0
                out = convert(src, dst)
                out.validate()
                assert type(out) is dst and torch.equal(out.to_dense(), src.to_dense()), dst_name
                assert torch.equal(out.mask(), src.to_dense() > 0), "relu(x) stores no explicit zeros"
                continue
            if conversion_path(cls, dst) is not None or dst_spec.any_mask:
                out = convert(lay, dst)
                out.validate()
                assert type(out) is dst, dst_name
                assert torch.equal(out.to_dense(), dense), dst_name
                _check_pattern(dst_name, out, pattern)
                tt = t.to_layout(dst_name)
                assert tt.layout_name == dst_name and tt.requires_grad
                assert torch.equal(tt.to_dense().detach(), dense) and torch.equal(tt.pattern(), out.mask())
                if torch.equal(out.mask(), pattern):  # and back (not from Dense: see its structured_target)
                    back = convert(out, cls, **params) if params else convert(out, cls)
                    assert torch.equal(back.to_dense(), dense) and torch.equal(back.mask(), pattern), dst_name
                continue
            # a structured target: build this layout on a pattern the target accepts
            dst_params = dst_spec.variants[0]
            if (name, "structured_target") in EXCEPTIONS:
                try:
                    out = convert(lay, dst, **dst_params)
                except ValueError as e:  # the full pattern does not fit: a clear error naming the mask
                    assert "mask" in str(e), e
                else:
                    assert torch.equal(out.to_dense(), dense), dst_name
                continue
            if not SPECS[name].any_mask:
                continue  # two structured layouts with no edge: no common pattern to build on
            xs = x.abs() + 0.5 if _relu_only(name) else x  # positive: every kept position is stored
            dmask = dst_spec.mask(xs, dst_params, gen)
            src = cls.from_dense(xs, mask=dmask, **params)
            out = convert(src, dst, **dst_params)
            out.validate()
            assert type(out) is dst and torch.equal(out.to_dense(), xs * dmask), dst_name
            _check_pattern(dst_name, out, dmask)

    @SETTINGS
    @given(data=st.data())
    def test_linear_forward_backward(self, name, data):
        cls, params, w, mask, gen = _case(data, name)
        lay = cls.from_dense(w, mask=mask, **params)
        R, K = lay.shape
        lead = data.draw(st.sampled_from([(1,), (4,), (2, 3), (0,)]), label="lead")  # (0,): no tokens
        use_bias = data.draw(st.booleans(), label="bias")
        x = torch.randn(lead + (K,), generator=gen)
        b = torch.randn(R, generator=gen) if use_bias else None
        wd = lay.to_dense().clone().requires_grad_(True)
        xd = x.clone().requires_grad_(True)
        bd = b.clone().requires_grad_(True) if use_bias else None
        ref = F.linear(xd, wd, bd)
        gy = torch.randn(ref.shape, generator=gen)
        ref.backward(gy)

        p = nn.Parameter(sparsa.SparseTensor(lay), requires_grad=True)
        xs = x.clone().requires_grad_(True)
        bs = b.clone().requires_grad_(True) if use_bias else None
        sparsa.reset_fallback_counts()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
            out = F.linear(xs, p, bs)
        assert type(out) is torch.Tensor and out.shape == ref.shape
        torch.testing.assert_close(out, ref.detach(), rtol=1e-4, atol=1e-5)
        if (name, "sparse_linear") not in EXCEPTIONS:
            assert _no_fallback(), f"F.linear with a {name} weight ran the dense fallback"
        else:
            assert not _no_fallback(), "the dense fallback is counted"
            with sparsa.strict(), pytest.raises(sparsa.SparseFallbackError, match="linear"):
                F.linear(x, p, b)
        out.backward(gy)
        torch.testing.assert_close(xs.grad, xd.grad, rtol=1e-4, atol=1e-5)
        if use_bias:
            torch.testing.assert_close(bs.grad, bd.grad, rtol=1e-4, atol=1e-5)
        assert p.grad is not None, "the weight receives a gradient"
        g = p.grad.to_dense() if isinstance(p.grad, sparsa.SparseTensor) else p.grad
        assert g.shape == (R, K)
        pattern = lay.mask()
        torch.testing.assert_close(g * pattern, wd.grad * pattern, rtol=1e-4, atol=1e-5)
        assert not bool(g[~pattern].any()), "no weight gradient outside the stored pattern"
        # an optimizer step trains the stored values and keeps the pattern and layout
        if _relu_only(name):
            step = (lay.to_dense() - 0.5 * g) * pattern
            if bool((step < 0).any()):
                with pytest.raises(ValueError, match="mask"):
                    torch.optim.SGD([p], lr=0.5).step()
                return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
            torch.optim.SGD([p], lr=0.5).step()
        assert isinstance(p, sparsa.SparseTensor) and p.layout_name == name
        assert torch.equal(p.pattern(), pattern)
        torch.testing.assert_close(p.to_dense(), (lay.to_dense() - 0.5 * g) * pattern, rtol=1e-5, atol=1e-6)

    @settings(max_examples=10, deadline=None)
    @given(data=st.data())
    def test_linear_bf16(self, name, data):
        # a bf16 weight runs (native kernel, torch.sparse or the dense fallback) and matches a float64 product
        cls, params, w, mask, gen = _case(data, name)
        lay = cls.from_dense(w.to(torch.bfloat16), mask=mask, **params)
        x = torch.randn(3, lay.shape[1], generator=gen).to(torch.bfloat16)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
            out = F.linear(x, sparsa.SparseTensor(lay))
        assert out.dtype == torch.bfloat16
        ref = x.double() @ lay.to_dense().double().t()
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * (1 + ref.abs().max().item()))

    @settings(max_examples=5, deadline=None)
    @given(data=st.data())
    def test_save_load(self, name, data):
        lay, model, _ = _sparse_linear(data, name, bias=True)
        R, K = lay.shape
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "m.safetensors")
            sparsa.save(model, path)
            state = sparsa.io.load_state(path)
            fresh = sparsa.load(nn.Linear(K, R), path)
        s = state["weight"]
        assert isinstance(s, sparsa.SparseTensor) and s.layout_name == name
        assert s.sparse_layout.params() == lay.params()
        _components_equal(s.sparse_layout, lay)  # narrowed index dtypes come back as saved
        fw = fresh.weight
        assert isinstance(fw, nn.Parameter) and isinstance(fw, sparsa.SparseTensor) and fw.requires_grad
        assert fw.layout_name == name and torch.equal(fw.to_dense(), lay.to_dense())
        assert torch.equal(fw.pattern(), lay.mask()) and torch.equal(fresh.bias, model.bias)

    @settings(max_examples=5, deadline=None)
    @given(data=st.data())
    def test_deepcopy(self, name, data):
        lay, model, gen = _sparse_linear(data, name, bias=False)
        K = lay.shape[1]
        twin = copy.deepcopy(model)
        tw = twin.weight
        assert isinstance(tw, nn.Parameter) and isinstance(tw, sparsa.SparseTensor) and tw.requires_grad
        assert tw.layout_name == name and tw.sparse_layout.params() == lay.params()
        _components_equal(tw.sparse_layout, lay)
        x = torch.randn(3, K, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sparsa.SparseFallbackWarning)
            torch.testing.assert_close(twin(x), model(x))
        # independent storage: changing the copy leaves the original alone
        before = lay.to_dense().clone()
        for t in tw.sparse_layout.components().values():
            if t.is_floating_point():
                t.add_(1.0)
        assert torch.equal(model.weight.to_dense(), before)
        t2 = copy.deepcopy(sparsa.SparseTensor(lay))
        assert not t2.requires_grad and torch.equal(t2.to_dense(), before)

    @settings(max_examples=5, deadline=None)
    @given(data=st.data())
    def test_to_in_inference_mode(self, name, data):
        """Under ``torch.inference_mode`` ``aten.to`` and ``type_as`` reach the layout undecomposed: they convert
        the layout (``model.to(torch.bfloat16)`` keeps a sparse weight whose values are bf16), return the tensor
        itself when nothing changes, and never run densely; ``detach`` works there too."""
        lay, model, _ = _sparse_linear(data, name, bias=True)
        want = lay.to_dense().to(torch.bfloat16)
        w = sparsa.SparseTensor(lay)  # a normal tensor, used under inference mode
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("error", sparsa.SparseFallbackWarning)
            assert w.to(torch.float32) is w and w.to("cpu") is w
            for conv in (
                lambda t: t.to(torch.bfloat16),
                lambda t: t.to("cpu", torch.bfloat16),
                lambda t: t.to(dtype=torch.bfloat16),
                lambda t: t.to(torch.zeros(1, dtype=torch.bfloat16)),
            ):
                b = conv(w)
                assert isinstance(b, sparsa.SparseTensor) and b.layout_name == name and b.dtype == torch.bfloat16
                assert b.sparse_layout.dtype == torch.bfloat16 and torch.equal(b.to_dense(), want)
            copied = w.to(torch.float32, copy=True)
            assert copied is not w and torch.equal(copied.to_dense(), lay.to_dense())
            t = w.type_as(torch.zeros(1, dtype=torch.bfloat16))
            assert isinstance(t, sparsa.SparseTensor) and t.dtype == t.sparse_layout.dtype == torch.bfloat16
            d = w.detach()  # a view of a normal tensor: a normal tensor, as PyTorch's own views are
            assert isinstance(d, sparsa.SparseTensor) and not d.is_inference() and d.sparse_layout is lay
            model.to(torch.bfloat16)
        mw = model.weight
        assert isinstance(mw, sparsa.SparseTensor) and mw.layout_name == name
        assert mw.dtype == mw.sparse_layout.dtype == torch.bfloat16 and torch.equal(mw.to_dense(), want)

    @settings(max_examples=5, deadline=None)
    @given(data=st.data())
    def test_weights_made_in_inference_mode_are_normal_tensors(self, name, data):
        """A sparse weight built, converted, copied or loaded under ``torch.inference_mode`` holds normal
        tensors (an inference tensor has no version counter, so the kernels' caches would be rebuilt on every
        call), also where its source is an inference tensor, and it equals the one built outside."""
        cls, params, w, mask, _ = _case(data, name)
        want = cls.from_dense(w, mask=mask, **params).to_dense()

        def normal(t):
            assert isinstance(t, sparsa.SparseTensor) and not t.is_inference()
            for cname, c in t.sparse_layout.components().items():
                assert not c.is_inference(), cname
            return t

        with torch.inference_mode():
            wi = w.clone()  # an inference tensor
            made = [sparsa.to_sparse(src, name, mask=mask, **params) for src in (w, wi)]
            for t in made:
                assert torch.equal(normal(t).to_dense(), want)
            inner = sparsa.SparseTensor(cls.from_dense(wi, mask=mask, **params))  # every component inference
            normal(inner.clone())
            b = normal(inner.to(torch.bfloat16))
            assert torch.equal(b.to_dense(), want.to(torch.bfloat16))
            model = nn.Linear(w.shape[1], w.shape[0])
            model.weight = nn.Parameter(made[0])
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "m.safetensors")
                sparsa.save(model, path)
                loaded = normal(sparsa.io.load_state(path)["weight"])
            assert torch.equal(loaded.to_dense(), want)

    @settings(max_examples=5, deadline=None)
    @given(data=st.data())
    def test_compile_cache_key(self, name, data):
        """``_stable_hash_for_caching`` (torch.compile's AOT autograd cache key): the same for another tensor
        of the same layout metadata, different when the pattern's size or the dtype differ."""
        lay, model, gen = _sparse_linear(data, name, bias=False)
        w = sparsa.SparseTensor(lay)
        key = w._stable_hash_for_caching()
        assert isinstance(key, str) and len(key) == 32 and key == w._stable_hash_for_caching()
        twin_lay = copy.deepcopy(lay)  # same sizes and strides, own storage
        for t in twin_lay.components().values():
            if t.is_floating_point():
                t.mul_(2)
        twin = sparsa.SparseTensor(twin_lay)
        assert twin._stable_hash_for_caching() == key  # values are not part of the key
        assert sparsa.SparseTensor(lay.to(torch.float64))._stable_hash_for_caching() != key

    @settings(max_examples=5, deadline=None)
    @given(data=st.data())
    def test_flatten_round_trip(self, name, data):
        """``__tensor_flatten__`` / ``__tensor_unflatten__`` (how torch.compile unwraps a weight): the same
        tensor comes back, holding the very derived tensors (kernel plans, row ids) that travelled beside the
        components, so a compiled graph takes them as inputs instead of rebuilding them; a derived set of
        other names is refused."""
        lay, _, _ = _sparse_linear(data, name, bias=False)
        w = sparsa.SparseTensor(lay)
        for n, t in lay.components().items():  # readable as soon as the tensor exists, before any flatten
            assert getattr(w, f"_c_{n}") is t
        assert not hasattr(w, "_dynamo_dynamic_indices") and not hasattr(w, "_c_not_a_component")
        names, ctx = w.__tensor_flatten__()
        back = type(w).__tensor_unflatten__({n: getattr(w, n) for n in names}, ctx, w.shape, w.stride())
        assert back.layout_name == name and back.sparse_layout.params() == lay.params()
        torch.testing.assert_close(back.to_dense(), lay.to_dense(), rtol=0, atol=0)
        derived = lay.derived_components()
        assert sorted(n[3:] for n in names if n.startswith("_d_")) == sorted(derived)
        for n, t in derived.items():
            assert back.sparse_layout.derived_components()[n] is t
        with pytest.raises(TypeError, match="derives"):
            back.sparse_layout.adopt_derived({"not_a_derived_tensor": torch.zeros(1)})


def _sparse_linear(data, name, bias):
    """A drawn layout of ``name``, an ``nn.Linear`` whose weight is that layout as a Parameter, and the
    case's generator."""
    cls, params, w, mask, gen = _case(data, name)
    lay = cls.from_dense(w, mask=mask, **params)
    R, K = lay.shape
    model = nn.Linear(K, R, bias=bias)
    model.weight = nn.Parameter(sparsa.SparseTensor(lay))
    return lay, model, gen


def test_grouped_nm_accepts_a_sparser_mask():
    """A mask inside a valid grouped n:m mask is valid; the greedy pattern search used to miss this one
    (the exact matching behind it finds the assignment)."""
    # 2:4, g=2, one 12-column chunk (7 columns + 5 padding), 6 patterns used twice each. ``full`` uses
    # (0,1) (0,1) (1,3) (0,2) (0,2) (1,3) (0,3) and the padding (0,3) (2,3) (2,3) (1,2) (1,2).
    full = torch.tensor(
        [[1, 1, 0, 1, 1, 0, 1], [1, 1, 1, 0, 0, 1, 0], [0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1, 1]], dtype=torch.bool
    )
    sub = torch.tensor(
        [
            [1, 1, 0, 1, 1, 0, 1],  # found by the suite (hypothesis), shrunk by a search
            [0, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 1, 0, 0],
            [0, 0, 1, 0, 0, 1, 0],
        ],
        dtype=torch.bool,
    )
    assert bool((full | ~sub).all()), "sub is a subset of full"
    x = torch.randn(full.shape)
    try:
        GroupedNM.from_dense(x, mask=full, n=2, m=4, g=2)
    except ValueError as e:
        pytest.fail(f"the superset mask must be accepted: {e}")
    lay = GroupedNM.from_dense(x, mask=sub, n=2, m=4, g=2)
    assert torch.equal(lay.to_dense(), x * sub)
