import torch
import sparsa


def test_import_and_masked_roundtrip():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    s = sparsa.to_sparse(x, "masked")
    assert torch.equal(s.to_dense(), x)
    assert s.nnz == 2
