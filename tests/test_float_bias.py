"""``float_bias``: the float32 bias the native kernels add, converted once per bias and kept on a tensor the
kernels own, never on the user's bias."""

import torch

from sparsa.kernels.operands import float_bias


def test_a_float32_contiguous_bias_is_passed_as_it_is():
    b = torch.randn(8)
    assert float_bias(b) is b
    assert float_bias(b, holder=torch.zeros(1)) is b


def test_a_bf16_bias_is_widened_padded_and_kept_on_the_holder():
    b = torch.randn(6).to(torch.bfloat16)
    holder = torch.zeros(3)
    got = float_bias(b, 8, holder=holder)
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, torch.cat([b.float(), torch.zeros(2)]))
    assert float_bias(b, 8, holder=holder) is got  # the second call converts nothing
    assert not hasattr(b, "_sparsa_float_bias")  # a checkpoint of the user's bias carries nothing extra
    assert float_bias(b, 6, holder=holder) is not got  # another length: another copy


def test_an_in_place_update_or_another_bias_makes_a_new_copy():
    b = torch.randn(4).to(torch.bfloat16)
    holder = torch.zeros(1)
    first = float_bias(b, holder=holder)
    b.add_(1)
    second = float_bias(b, holder=holder)
    assert second is not first and torch.equal(second, b.float())
    other = b.clone()
    assert float_bias(other, holder=holder) is not second


def test_without_a_holder_or_for_an_inference_tensor_nothing_is_kept():
    b = torch.randn(4).to(torch.bfloat16)
    assert float_bias(b) is not float_bias(b)
    with torch.inference_mode():
        bi = torch.randn(4).to(torch.bfloat16)
        holder = torch.zeros(1)
        assert torch.equal(float_bias(bi, holder=holder), bi.float())
        assert not hasattr(holder, "_sparsa_float_bias")


def test_a_non_contiguous_float32_bias_is_made_contiguous():
    b = torch.randn(8)[::2]
    got = float_bias(b)
    assert got.is_contiguous() and torch.equal(got, b)
