"""GroupedNM linear under ``torch.compile``: the forward's plan tensors (or its SlicedELL twin's) travel with
the weight as derived tensors, so an inference graph is one graph of kernel ops, equal to eager; a training
step too, its backward's plans carried the same way."""

import copy

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
@pytest.mark.parametrize("grad", [False, True])
def test_flatten_carries_the_forward_tensors(dtype, grad):
    w = sparsa.to_sparse(torch.randn(24, 64).to(dtype), "grouped_nm", n=1, m=4, g=2)
    with torch.set_grad_enabled(grad):  # with grad on (a graph that may train), the backward's plans too
        names, ctx = w.__tensor_flatten__()
    derived = sorted(n[3:] for n in names if n.startswith("_d_"))
    twin = ngnm._compiled_path(w.sparse_layout) == "twin"
    forward = set(ngnm._Derivation.TWIN) if twin else set(derived) & {"plan_offsets"} | set(ngnm._Derivation.PLAN)
    # the pattern plan's tensors only where the weight gradient runs the sddmm kernel
    sddmm = ngnm._sparse_grad_weight(w.sparse_layout)
    backward = set(ngnm._Derivation.INPUT_GRAD) | (set(ngnm._Derivation.PATTERN) if sddmm else set())
    assert derived == sorted(forward | backward if grad else forward)
    with torch.no_grad():  # once built for these values, they stay (the compiled forward unwraps with grad off)
        assert sorted(n[3:] for n in w.__tensor_flatten__()[0] if n.startswith("_d_")) == derived
    back = type(w).__tensor_unflatten__({n: getattr(w, n) for n in names}, ctx, w.shape, w.stride())
    # the rebuilt layout holds the same tensors, and builds nothing of its own
    for name in (n for n in names if n.startswith("_d_")):
        assert back.sparse_layout.derived_components()[name[3:]] is getattr(w, name)
    with pytest.raises(TypeError, match="GroupedNM derives"):
        back.sparse_layout.adopt_derived({"bits": torch.zeros(1)})


def _model(nm, dtype, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 40)).to(dtype)
    sparsa.sparsify(m, [sparsa.Rule(sparsifier=GroupedNMSparsifier(nm[0], nm[1], 2), layout="grouped_nm")])
    assert all(lin.weight.layout_name == "grouped_nm" for lin in (m[0], m[2]))
    return m


def _capturing_backend(graphs, backward=False):
    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, inputs):
        def keep(g, _):
            graphs.append(g)
            return g.forward

        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep if backward else None)

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


@pytest.mark.parametrize("nm", [(1, 4), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_weight", ["dense", "sparse"])
def test_training_under_compile_is_one_graph_equal_to_eager(path, nm, dtype, grad_weight, monkeypatch):
    # the backward's plans travel as derived tensors too: optimizer steps that change the values rebuild
    # them outside the graph, and the weight gradient takes either route (sddmm or masked dense)
    monkeypatch.setattr(ngnm, "crossover", lambda name: 1.0 if grad_weight == "sparse" else 0.0)
    eager = _model(nm, dtype, seed=1)
    compiled_model = copy.deepcopy(eager)
    graphs = []
    step = torch.compile(
        lambda m, x: m(x).float().square().sum(), backend=_capturing_backend(graphs, backward=True), fullgraph=True
    )
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (eager, compiled_model)]
    for i in range(3):
        x = torch.randn(9, 64, generator=torch.Generator().manual_seed(i)).to(dtype)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        for opt in opts:
            opt.zero_grad()
        eager(xe).float().square().sum().backward()
        step(compiled_model, xc).backward()
        assert torch.equal(xc.grad, xe.grad), i
        for pe, pc in zip(eager.parameters(), compiled_model.parameters()):
            assert torch.equal(pc.grad, pe.grad), i
        for opt in opts:
            opt.step()
    code = "\n".join(g.code for g in graphs)
    assert code.count("grouped_nm_spmm_kernel") + code.count("sliced_ell_linear_kernel") >= 4, code  # fwd + grad_x
    assert ("grouped_nm_sddmm_kernel" in code) == (grad_weight == "sparse"), code
    assert "argsort" not in code, code  # no plan is rebuilt inside the graphs (the mask of the dense route is)


def test_inference_after_training_compiles_again():
    # a weight whose backward plans were built (an eager training step) carries them into a later no-grad
    # graph as unused inputs: still one graph, equal to eager
    m = _model((2, 4), torch.float32, seed=2)
    m(torch.randn(3, 64)).sum().backward()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        x = torch.randn(5, 64)
        assert torch.equal(compiled(x), m(x))
