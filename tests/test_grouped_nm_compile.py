"""GroupedNM linear under ``torch.compile``: the forward's plan tensors (or its SlicedELL twin's) travel with
the weight as derived tensors, so an inference graph is one graph of kernel ops, equal to eager; training,
whose backward plans are data-dependent, breaks the graph and runs the layer eagerly."""

import pytest
import torch

import sparsa
from sparsa.kernels import grouped_nm as kern
from sparsa.layouts import GroupedNM
from sparsa.ops import native_grouped_nm as ngnm
from sparsa.sparsifiers import GroupedNM as GroupedNMSparsifier

NMS = [(1, 4), (2, 4), (1, 10), (3, 5)]
SHAPES = [(16, 40), (48, 2048), (10, 30)]


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["native", "fallback"])
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("SPARSA_NO_NATIVE", "1")
        assert kern.native_library() is None
    else:
        monkeypatch.delenv("SPARSA_NO_NATIVE", raising=False)
        assert kern.native_library() is not None, "native grouped_nm kernel failed to build"
    return request.param


@pytest.mark.parametrize("nm", NMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_fields_from_the_shape_match_the_built_plans(nm, shape, dtype):
    n, m = nm
    w = GroupedNM.from_dense(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), n=n, m=m, g=2)
    values = w.values.to(dtype)
    plans = [(kern.forward_plan(values, w.columns, n, m), kern._use_pairs(values, n, m))]
    if n == 1:  # the block-pair plan too, whether or not this CPU would build it
        plans.append((kern.pair_plan(values, w.columns, n, m), True))
    for plan, pairs in plans:
        got = (plan.units, plan.unit_entries, plan.unit_span, plan.gpb, plan.rpb, plan.interleaved)
        assert got == kern.forward_plan_fields(tuple(values.shape), n, m, pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flatten_carries_the_forward_tensors(dtype):
    w = sparsa.to_sparse(torch.randn(24, 64).to(dtype), "grouped_nm", n=1, m=4, g=2)
    names, ctx = w.__tensor_flatten__()
    derived = sorted(n[3:] for n in names if n.startswith("_d_"))
    twin = ngnm._compiled_path(w.sparse_layout) == "twin"
    assert derived == (
        sorted(ngnm._Derivation.TWIN) if twin else sorted(set(derived) & {"plan_offsets"} | set(ngnm._Derivation.PLAN))
    )
    back = type(w).__tensor_unflatten__({n: getattr(w, n) for n in names}, ctx, w.shape, w.stride())
    # the rebuilt layout holds the same tensors, and builds nothing of its own
    for name, t in w.sparse_layout.derived_components().items():
        assert back.sparse_layout.derived_components()[name] is t
    with pytest.raises(TypeError, match="GroupedNM derives"):
        back.sparse_layout.adopt_derived({"bits": torch.zeros(1)})


def _model(nm, dtype, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 40)).to(dtype)
    sparsa.sparsify(m, [sparsa.Rule(sparsifier=GroupedNMSparsifier(nm[0], nm[1], 2), layout="grouped_nm")])
    assert all(lin.weight.layout_name == "grouped_nm" for lin in (m[0], m[2]))
    return m


def _capturing_backend(graphs):
    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, inputs):
        def keep(g, _):
            graphs.append(g)
            return g.forward

        return aot_module_simplified(gm, inputs, fw_compiler=keep)

    return backend


@pytest.mark.parametrize("nm", [(1, 4), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_inference_is_one_graph_of_kernel_ops(path, nm, dtype):
    m = _model(nm, dtype)
    graphs = []
    compiled = torch.compile(m, backend=_capturing_backend(graphs), fullgraph=True)
    with torch.no_grad():
        for T in (7, 1):  # a bf16 weight runs its twin's rows for one token as well
            x = torch.randn(T, 64).to(dtype)
            got, want = compiled(x), m(x)
            if T > 1 or dtype == torch.float32:
                assert torch.equal(got, want)  # the same kernels as eager, on the same tensors
            else:
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    code = "\n".join(g.code for g in graphs)
    assert "grouped_nm_spmm_kernel" in code or "sliced_ell_linear_kernel" in code, code
    for rebuilt in ("argsort", "scatter", "arange"):  # no plan is rebuilt inside the graph
        assert rebuilt not in code, (rebuilt, code)


def test_training_under_compile_matches_eager():
    m = _model((1, 4), torch.float32, seed=1)
    x = torch.randn(9, 64)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    m(xe).square().sum().backward()
    torch.compile(m, backend="aot_eager")(xc).square().sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad)
