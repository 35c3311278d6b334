"""sparsa.save / sparsa.load: round trips, compression, atomicity, clear errors, no pickle."""

import os
import pickle

import pytest
import safetensors.torch
import torch
import torch.nn as nn

import sparsa
import sparsa.io as sio
from sparsa import Rule
from sparsa.sparsifiers import NM, BlockMagnitude, GroupedNM, Magnitude

pytestmark = pytest.mark.filterwarnings("ignore::sparsa.SparseFallbackWarning")


def _mlp(seed=0, hidden=32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 4))
    m.eval()
    return m


CASES = [
    ("masked", Magnitude(0.75)),
    ("csr", Magnitude(0.75)),
    ("coo", Magnitude(0.75)),
    ("nm", NM(2, 4)),
    ("bsr", BlockMagnitude(0.5, (4, 4))),
    ("grouped_nm", GroupedNM(2, 4, 4)),
]


@pytest.mark.parametrize("layout, sp", CASES)
def test_roundtrip_identical(tmp_path, layout, sp):
    model = sparsa.sparsify(_mlp(), Rule(sparsifier=sp, layout=layout, module_types=nn.Linear))
    x = torch.randn(5, 16)
    path = tmp_path / "m.safetensors"
    size = sparsa.save(model, path)
    assert size == os.path.getsize(path)
    fresh = _mlp(seed=123)  # different init: everything must come from the file
    out = sparsa.load(fresh, path)
    assert out is fresh
    for name in ("0", "3"):
        a, b = model.get_submodule(name).weight, fresh.get_submodule(name).weight
        assert isinstance(b, sparsa.SparseTensor) and isinstance(b, nn.Parameter) and b.requires_grad
        assert b.layout_name == layout and b.sparse_layout.params() == a.sparse_layout.params()
        assert torch.equal(a.pattern(), b.pattern())
        for k, v in a.sparse_layout.components().items():
            w = b.sparse_layout.components()[k]
            assert w.dtype == v.dtype and torch.equal(v, w), k  # narrowed indices come back as saved
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)
    assert torch.equal(fresh(x), model(x))


def test_loaded_model_trains_and_keeps_pattern(tmp_path):
    model = sparsa.sparsify(_mlp(), Rule(sparsifier=Magnitude(0.75), layout="csr", module_types=nn.Linear))
    sparsa.save(model, tmp_path / "m.safetensors")
    fresh = sparsa.load(_mlp(1), tmp_path / "m.safetensors").train()
    pat = fresh[0].weight.pattern().clone()
    opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        fresh(torch.randn(8, 16)).sum().backward()
        opt.step()
    assert torch.equal(fresh[0].weight.pattern(), pat)


def test_csr_file_smaller_than_dense(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    dense_size = sparsa.save(model, tmp_path / "dense.safetensors")
    sparsa.sparsify(model, Rule(sparsifier=Magnitude(0.9), layout="csr"))
    sparse_size = sparsa.save(model, tmp_path / "sparse.safetensors")
    assert sparse_size < 0.2 * dense_size, (sparse_size, dense_size)  # uint8 column indices


def test_state_dict_input_and_load_state(tmp_path):
    model = sparsa.sparsify(_mlp(), Rule(sparsifier=NM(2, 4), layout="nm", module_types=nn.Linear))
    sparsa.save(model.state_dict(), tmp_path / "s.safetensors")
    state = sio.load_state(tmp_path / "s.safetensors")
    assert isinstance(state["0.weight"], sparsa.SparseTensor) and state["0.weight"].layout_name == "nm"
    assert torch.equal(state["0.weight"].to_dense(), model[0].weight.to_dense())
    with pytest.raises(TypeError, match="extra"):
        sparsa.save({"extra": 3}, tmp_path / "bad.safetensors")


def test_dense_checkpoint_into_sparse_model_densifies(tmp_path):
    dense = _mlp()
    sparsa.save(dense, tmp_path / "d.safetensors")
    model = sparsa.sparsify(_mlp(5), Magnitude(0.5))
    sparsa.load(model, tmp_path / "d.safetensors")
    assert not isinstance(model[0].weight, sparsa.SparseTensor)
    x = torch.randn(3, 16)
    assert torch.equal(model(x), dense(x))


def test_tied_weights_stay_tied(tmp_path):
    def make(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        m[1].weight = m[0].weight
        return m

    model = sparsa.sparsify(make(0), Magnitude(0.5))
    sparsa.save(model, tmp_path / "t.safetensors")
    fresh = sparsa.load(make(1), tmp_path / "t.safetensors")
    assert fresh[0].weight is fresh[1].weight and isinstance(fresh[0].weight, sparsa.SparseTensor)


def _saved(tmp_path):
    model = sparsa.sparsify(_mlp(), Rule(sparsifier=Magnitude(0.75), layout="csr", module_types=nn.Linear))
    path = tmp_path / "m.safetensors"
    sparsa.save(model, path)
    return model, path


def test_truncated_file(tmp_path):
    _, path = _saved(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 7, len(data) // 2, 20, 3):
        path.write_bytes(data[:cut])
        with pytest.raises(sio.CheckpointError, match="m.safetensors"):
            sparsa.load(_mlp(), path)


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(sio.CheckpointError, match="garbage.safetensors"):
        sparsa.load(_mlp(), path)
    with pytest.raises(sio.CheckpointError, match="no such"):
        sparsa.load(_mlp(), tmp_path / "missing.safetensors")


def test_corrupted_tensor_data_detected(tmp_path):
    _, path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip bits in the last tensor's payload
    path.write_bytes(bytes(data))
    with pytest.raises(sio.CheckpointError, match="corrupted"):
        sparsa.load(_mlp(), path)


def test_wrong_shape_model(tmp_path):
    _, path = _saved(tmp_path)
    with pytest.raises(sio.CheckpointError, match=r"'0.weight'.*shape \(32, 16\).*\(64, 16\)"):
        sparsa.load(_mlp(hidden=64), path)


def test_missing_and_unexpected_keys(tmp_path):
    _, path = _saved(tmp_path)
    bigger = nn.Sequential(*_mlp(), nn.Linear(4, 2)).eval()
    with pytest.raises(sio.CheckpointError, match=r"missing keys \['4.weight', '4.bias'\]"):
        sparsa.load(bigger, path)
    res = sparsa.load(bigger, path, strict=False, return_keys=True)
    assert res.missing_keys == ["4.weight", "4.bias"] and res.unexpected_keys == []
    assert isinstance(bigger[0].weight, sparsa.SparseTensor)
    smaller = nn.Sequential(nn.Linear(16, 32))
    with pytest.raises(sio.CheckpointError, match="unexpected keys"):
        sparsa.load(smaller, path)


def test_unknown_layout(tmp_path):
    model = sparsa.sparsify(_mlp(), Rule(sparsifier=Magnitude(0.5), layout="masked", module_types=nn.Linear))
    path = tmp_path / "u.safetensors"
    sparsa.save(model, path)
    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["sparsa"] = meta["sparsa"].replace('"layout": "masked"', '"layout": "hologram"')
    safetensors.torch.save_file(tensors, str(path), metadata=meta)
    with pytest.raises(sio.CheckpointError, match="'0.weight'.*unknown layout.*hologram"):
        sparsa.load(_mlp(), path)


def test_crash_mid_save_keeps_previous_file(tmp_path, monkeypatch):
    model, path = _saved(tmp_path)
    before = path.read_bytes()

    def boom(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        sparsa.save(sparsa.sparsify(_mlp(7), Magnitude(0.5)), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]  # temp file cleaned up
    monkeypatch.undo()
    fresh = sparsa.load(_mlp(3), path)
    x = torch.randn(2, 16)
    assert torch.equal(fresh(x), model(x))


def test_load_never_unpickles(tmp_path, monkeypatch):
    model, path = _saved(tmp_path)

    def forbidden(*a, **k):
        raise AssertionError("pickle used while loading")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    fresh = sparsa.load(_mlp(3), path)
    x = torch.randn(2, 16)
    assert torch.equal(fresh(x), model(x))
    assert path.read_bytes()[8:9] == b"{"  # a JSON header (safetensors), not a pickle stream


def test_saved_checkpoint_gets_the_usual_file_mode(tmp_path):
    import os
    import stat
    import torch
    import sparsa

    lin = torch.nn.Linear(8, 4)
    sparsa.sparsify(lin, [sparsa.Rule(sparsifier=sparsa.sparsifiers.Magnitude(0.5), layout="csr")])
    path = tmp_path / "m.safetensors"
    sparsa.save(lin, str(path))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
