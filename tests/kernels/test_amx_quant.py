"""Quantised weights on bf16 AMX tiles (`amx_linear.c`'s `amx_quant_matmul`, picked by
`quant_activations="bf16"`): a panel's weights dequantised per call into the tiles a bf16
matrix's dense panels are, so the result is, to the bit, those panels of the dequantised
matrix rounded to bf16 (the bf16 model of the dequantised file), in every format, for mixed
parts, laid-out Q8_0 panels and int8 rows, and whatever the number of rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_files import BLOCKS, random_blocks
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import quant
from treeserve.layers.quant import QuantPart, QuantTensor, dense_panels, quant_linear

pytestmark = pytest.mark.skipif(
    not quant.available() or cpu_kernels.load_amx() is None, reason="no usable AMX tiles on this CPU"
)


def _blocks(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, rows, cols, np.random.default_rng(seed)))


def _bf16_layer(weight: QuantTensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference: the dequantised matrix as a bf16 model holds it, its dense panels on the tiles."""
    panels = dense_panels(weight.dequantize().bfloat16())
    assert panels.plan.function is cpu_kernels.load_amx().amx_dense_matmul
    return quant_linear(x, panels, bias)


def _tiles(weight: QuantTensor) -> QuantTensor:
    tiled = weight.to(torch.bfloat16).with_activations("bf16").in_panels()
    assert tiled.plan.tiles and not tiled.plan.q8
    return tiled


@pytest.mark.parametrize("qtype", sorted(BLOCKS))
@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_tiles_are_the_bf16_layer_of_the_dequantised_matrix(qtype, rows):
    weight = _tiles(QuantTensor([QuantPart(quant.QTYPES[qtype], _blocks(qtype, 37, 512, 1))], 512))
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 512, generator=g).bfloat16(), torch.randn(37, generator=g).bfloat16()
    assert torch.equal(quant_linear(x, weight, bias), _bf16_layer(weight, x, bias))
    assert torch.equal(quant_linear(x, weight), _bf16_layer(weight, x, None))


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 20, 130])
def test_next_group_dequantised_while_one_multiplies(qtype, rows):
    """300 channels: 5 groups of 4 panels, so each of 2 threads multiplies one group while it
    dequantises the next (Q8_0 laid out as panels: the unswapped operands)."""
    weight = _tiles(QuantTensor([QuantPart(quant.QTYPES[qtype], _blocks(qtype, 300, 512, 8))], 512))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(quant_linear(x, weight), _bf16_layer(weight, x, None))
    finally:
        torch.set_num_threads(threads)


def test_swapped_operands_keep_the_bits_across_magnitudes():
    """Row-stored weights are the tiles' A operand and x the B one, the reverse of a bf16
    weight's: int8 rows scaled from 2^-30 to 2^30 and x rows from 2^-20 to 2^20 (cancellation,
    tiny and huge partial sums, zeros) still give the bits of the dense matrix's panels on the tiles."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(70, 640, generator=g) * torch.exp2(torch.randint(-30, 31, (70, 1), generator=g).float())
    w[:, ::7] = 0.0
    q8, scales = quant.quantize_i8(w)
    weight = _tiles(QuantTensor([QuantPart(quant.I8, q8, scales)], 640))
    x = torch.randn(33, 640, generator=g) * torch.exp2(torch.randint(-20, 21, (33, 640), generator=g).float())
    x = x.bfloat16()
    assert torch.equal(quant_linear(x, weight), _bf16_layer(weight, x, None))


def test_mixed_parts_panels_and_int8_rows_are_the_bf16_layer_and_rows_keep_their_bits():
    """A fused matrix of Q5_0, Q6_K, laid-out Q8_0 and int8 parts, none a whole number of
    16-channel panels; each row's result is the same alone, in any batch and thread count."""
    q8, scales = quant.quantize_i8(torch.randn(7, 256))
    parts = [
        QuantPart(quant.QTYPES["Q5_0"], _blocks("Q5_0", 9, 256, 2)),
        QuantPart(quant.QTYPES["Q6_K"], _blocks("Q6_K", 6, 256, 3)),
        QuantPart(quant.QTYPES["Q8_0"], _blocks("Q8_0", 21, 256, 4)),
        QuantPart(quant.I8, q8, scales),
    ]
    weight = _tiles(QuantTensor(parts, 256))
    if quant.q8_available():  # the Q8_0 part as the 8-bit kernel's panels, which the tiles read too
        assert weight.plan.laid_out
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    batch = quant_linear(x, weight)
    assert torch.equal(batch, _bf16_layer(weight, x, None))
    for lo, hi in ((0, 1), (3, 4), (0, 16), (7, 40), (16, 33)):
        assert torch.equal(quant_linear(x[lo:hi], weight), batch[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_linear(x, weight), batch)
    finally:
        torch.set_num_threads(threads)


def test_fp32_activations_and_unknown_settings_do_not_take_the_tiles():
    weight = QuantTensor([QuantPart(quant.QTYPES["Q8_0"], _blocks("Q8_0", 16, 256, 6))], 256)
    tiled = weight.with_activations("bf16")
    assert tiled.in_panels() is tiled  # an fp32 model's: the fp32 kernel reads the file's layout
    x = torch.randn(3, 256)
    # fp32 rows: the fp32 kernel (tiles take bf16 rows only), the dequantised fp32 matmul's values
    torch.testing.assert_close(quant_linear(x, tiled), x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must be one of"):
        _ = weight.with_activations("fp8").plan
