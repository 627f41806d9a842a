"""Dense bf16 matrices as panels (`kernels/cpu/bf16_panels.c`): the dense product within bf16
rounding, one row's bits whatever the batch, fp32 rows, biases and row-stacked parts."""

from __future__ import annotations

import pytest
import torch

from treeserve.kernels.cpu import quant as kernels
from treeserve.layers.quant import QuantTensor, dense_panels, quant_linear

pytestmark = pytest.mark.skipif(not kernels.bf16_panels_available(), reason="no AVX512-BF16 on this CPU")


@pytest.mark.parametrize(("n", "k"), [(512, 256), (33, 96), (100, 64), (256, 704), (17, 2)])
def test_panels_multiply_like_the_dense_matrix_and_rows_do_not_depend_on_the_batch(n, k):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    weight = dense_panels(w)
    assert weight.nbytes == -(-n // 16) * 16 * k * 2 and torch.equal(weight.dequantize(), w.float())
    x = torch.randn(41, k, generator=g).bfloat16()
    batch = quant_linear(x, weight, bias)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias)
    assert batch.dtype == torch.bfloat16 and batch.shape == (41, n)
    assert ((batch.float() - ref).abs() <= 0.01 * ref.abs() + 0.02 * k**0.5 / 16).all()
    for rows in (slice(0, 1), slice(3, 7), slice(8, 17), slice(40, 41), slice(1, 33)):
        assert torch.equal(quant_linear(x[rows], weight, bias), batch[rows])  # the same bits in any batch
    fp32 = quant_linear(x.float(), weight.to(torch.float32), bias)  # fp32 rows: rounded to bf16 first
    assert fp32.dtype == torch.float32 and torch.equal(fp32.bfloat16(), batch)


def test_row_stacked_dense_parts_are_one_matrix():
    w1, w2 = torch.randn(40, 64).bfloat16(), torch.randn(24, 64).bfloat16()
    stacked = QuantTensor.cat([dense_panels(w1), dense_panels(w2)])
    x = torch.randn(9, 64).bfloat16()
    whole = quant_linear(x, dense_panels(torch.cat([w1, w2])))
    assert stacked.formats == ["BF16"] and torch.equal(quant_linear(x, stacked), whole)
