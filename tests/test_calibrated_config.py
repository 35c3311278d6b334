"""sparsa.methods.calibrated_config: Wanda and SparseGPT share one calibrated-config base, with their
constructors and behaviour as before."""

import inspect

import pytest
import torch
from torch import nn

import sparsa
from sparsa.methods import SparseGPT, Wanda
from sparsa.methods.calibrated_config import CalibratedConfig
from sparsa.sparsifiers import NM

COMMON = {
    "sparsity": 0.5,
    "pattern": None,
    "calibration": None,
    "layout": None,
    "sparsifier": None,
    "forward": None,
    "blockwise": None,
    "blocks": None,
    "sparsities": None,
    "progress": False,
}


@pytest.mark.parametrize("cls,extra", [(Wanda, {}), (SparseGPT, {"sequential": True, "block": 128, "damp": 0.01})])
def test_constructors_keep_their_parameters(cls, extra):
    params = dict(inspect.signature(cls.__init__).parameters)
    params.pop("self")
    assert {n: p.default for n, p in params.items()} == {**COMMON, **extra}
    assert [n for n, p in params.items() if p.kind is not p.KEYWORD_ONLY] == ["sparsity"]
    assert issubclass(cls, CalibratedConfig)
    with pytest.raises(ValueError, match=f"{cls.__name__}: calibration is empty"):
        cls(calibration=[])
    with pytest.raises(ValueError, match="sparsity"):
        cls(1.5, calibration=[torch.randn(2, 4)])
    assert "calibration" not in repr(cls(calibration=[torch.randn(2, 4)]))


def test_apply_resolves_the_pattern_and_the_filter_for_prune():
    seen = []

    class Recording(CalibratedConfig):
        method = "Recording"

        def prune(self, model, sparsifier, layout, names):
            seen.append((sparsifier, layout, names))

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    sparsa.sparsify(model, Recording(pattern="2:4", calibration=[torch.randn(2, 8)]), lambda m, n: n == "2")
    assert seen == [(NM(2, 4), "nm", ["2"])]
    with pytest.raises(NotImplementedError, match="prune"):
        sparsa.sparsify(model, CalibratedConfig(calibration=[torch.randn(2, 8)]))


def test_the_old_sparsifier_spelling_of_wanda_still_works():
    with pytest.warns(DeprecationWarning):
        s = Wanda(NM(2, 4), torch.ones(8))
    assert type(s).__name__ == "WandaSparsifier"
