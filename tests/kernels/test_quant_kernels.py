"""The quantised-weight kernels against dequantise-then-matmul.

Dequantisation is exact (the kernels and the `gguf` package compute the same fp32 weights),
so the only error a quantised matmul may add is fp32 accumulation: for every format,
|kernel - fp64 reference| <= k * 2^-24 * sum|w x| per output (`_bound`). The format's own
rounding (weight vs quantised weight) is the converter's, not the kernel's. Rows never depend
on the batch: the few-row path (<= 4 rows, weights unpacked in registers) and the panel path
round every product and sum alike.

With 8-bit activations (`q8_kernels.c`, llama.cpp's way) each row is first rounded to int8 in
blocks of 32 (`_int8_rows` does it as the kernel does); the products are then exact integers,
so the result is within the same fp32 bound of x8 @ W^T, and within
sum over blocks of (block scale / 2) * sum|w| (the activations' own rounding) of x @ W^T.
"""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gguf_files import BLOCKS, random_blocks
from tests.kernels.tiles_off import products_without_tiles
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import quant
from treeserve.layers.quant import QuantPart, QuantTensor, quant_embedding, quant_linear, quantize_int8

pytestmark = pytest.mark.skipif(not quant.available(), reason="no C compiler: quantised kernels not built")
FORMATS = list(BLOCKS)


def _blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, rows, cols, np.random.default_rng(seed)))


def _matmul(qtype: int, data: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return quant.qmatmul(quant.Plan([(qtype, data, scales, data.shape[0])], x.shape[1]), x)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30


@pytest.mark.parametrize("qtype", FORMATS)
def test_dequantised_rows_equal_the_gguf_package(qtype):
    data = _blocks(qtype, 19, 512)
    ref = gguf.dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype]).reshape(19, 512)
    got = quant.dequant_rows(quant.QTYPES[qtype], data, None, torch.arange(19), 512)
    torch.testing.assert_close(got, torch.from_numpy(ref), rtol=1e-6, atol=0)
    picked = quant.dequant_rows(quant.QTYPES[qtype], data, None, torch.tensor([7, 0, 7]), 512)
    assert torch.equal(picked, got[[7, 0, 7]])


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
def test_matmul_within_fp32_accumulation_of_the_reference(qtype, rows):
    n, k = 23, 512  # 23: the last panel of 4 channels is partial
    data = _blocks(qtype, n, k, seed=rows)
    w = quant.dequant_rows(quant.QTYPES[qtype], data, None, torch.arange(n), k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = _matmul(quant.QTYPES[qtype], data, None, x)
    err = (got.double() - x.double() @ w.double().T).abs()
    assert (err <= _bound(x, w)).all(), f"max error {err.max().item()}"


needs_bf16_dot = pytest.mark.skipif(not quant.bf16_dot(), reason="this CPU has no AVX512-BF16 dot products")


@needs_bf16_dot
@pytest.mark.parametrize("qtype", [*FORMATS, "I8"])
@pytest.mark.parametrize("rows", [1, 4, 5, 17])
def test_bf16_rows_multiply_the_bf16_rounded_weights_with_fp32_sums(qtype, rows):
    """bf16 activations: the result is x @ bf16(W)^T with exact products and fp32 sums."""
    n, k = 23, 512
    if qtype == "I8":
        data, scales = quant.quantize_i8(torch.randn(n, k))
        number = quant.I8
    else:
        data, scales, number = _blocks(qtype, n, k, seed=rows), None, quant.QTYPES[qtype]
    w = quant.dequant_rows(number, data, scales, torch.arange(n), k).to(torch.bfloat16).float()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = _matmul(number, data, scales, x)
    err = (got.double() - x.double() @ w.double().T).abs()
    assert (err <= _bound(x.float(), w)).all(), f"max error {err.max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", [*FORMATS, "I8"])
def test_a_rows_result_does_not_depend_on_the_batch(qtype, dtype):
    if dtype == torch.bfloat16 and not quant.bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16 dot products")
    n, k = 13, 256
    if qtype == "I8":
        q, scales = quant.quantize_i8(torch.randn(n, k))
        data, number = q, quant.I8
    else:
        data, scales, number = _blocks(qtype, n, k), None, quant.QTYPES[qtype]
    x = torch.randn(11, k).to(dtype)
    full = _matmul(number, data, scales, x)
    for m in range(1, 11):
        assert torch.equal(_matmul(number, data, scales, x[:m]), full[:m]), m
        assert torch.equal(_matmul(number, data, scales, x[10 - m :]), full[10 - m :]), m


needs_q8 = pytest.mark.skipif(not quant.q8_available(), reason="this CPU has no AVX512-VNNI: no 8-bit activations")
Q8 = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "I8"]


def _weights(qtype: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    if qtype == "I8":
        data, scales = quant.quantize_i8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
        return data, scales, quant.I8
    return _blocks(qtype, n, k, seed=seed), None, quant.QTYPES[qtype]


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows as the kernel rounds them, fp64; each block's scale): scale = max|x| / 127,
    code = round-half-even(x * (1 / scale)), in fp32."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).view(x.shape).double(), scale.squeeze(-1).double()


@needs_q8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", Q8)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
def test_int8_activations_multiply_the_rounded_rows_exactly(qtype, rows, dtype):
    n, k = 23, 512
    data, scales, number = _weights(qtype, n, k, seed=rows)
    plan = quant.Plan([(number, data, scales, n)], k)
    assert plan.q8
    w = quant.dequant_rows(number, data, scales, torch.arange(n), k).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = quant.qmatmul(plan, x, fast=True).double()
    x8, block_scale = _int8_rows(x)
    err = (got - x8 @ w.T).abs()
    assert (err <= _bound(x8, w)).all(), f"max error {err.max().item()}"
    # against the unrounded rows: the activations' rounding, half a step a weight, plus the sums
    rounding = (block_scale / 2).repeat_interleave(32, dim=1) @ w.abs().T
    assert ((got - x.double() @ w.T).abs() <= rounding + _bound(x.float(), w)).all()


@needs_q8
@pytest.mark.parametrize("qtype", Q8)
def test_int8_activations_rows_do_not_depend_on_the_batch(qtype):
    n, k = 13, 256
    data, scales, number = _weights(qtype, n, k, seed=3)
    plan = quant.Plan([(number, data, scales, n)], k)
    x = torch.randn(37, k).bfloat16()
    full = quant.qmatmul(plan, x, fast=True)
    for m in (1, 2, 3, 5, 8, 9, 15, 16, 17, 31, 32, 33, 36):  # tiles of 8 rows; from 16 rows AMX where there is one
        assert torch.equal(quant.qmatmul(plan, x[:m], fast=True), full[:m]), m
        assert torch.equal(quant.qmatmul(plan, x[37 - m :], fast=True), full[37 - m :]), m


@needs_q8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_laid_out_as_panels_gives_the_files_results_to_the_bit(dtype):
    """Laid-out panels hold the file's codes and scales in the kernel's order: the same products
    and sums, for few rows (VNNI) and tiles of 16 (AMX where there is one), alone and beside a
    part of another format (laid out too, packed); its rows are looked up."""
    qtype, n, k = "Q8_0", 37, 512  # 37: the last panel holds 5 channels
    data = _blocks(qtype, n, k, seed=4)
    other = _blocks("Q5_0", 9, k, seed=5)
    filed = QuantTensor([QuantPart(quant.QTYPES["Q5_0"], other), QuantPart(quant.QTYPES[qtype], data)], k, dtype)
    laid = filed.in_panels()
    assert [p.qtype for p in laid.parts] == [quant.PANELS + p.qtype for p in filed.parts]
    assert laid.formats == ["Q5_0", "Q8_0"] and laid.shape == (46, k) and laid.in_panels() is laid
    assert laid.parts[1].data.shape == (3, 16 * quant.row_bytes(quant.QTYPES[qtype], k))  # the file's bytes
    assert torch.equal(laid.parts[1].dequantize(torch.arange(n), k), filed.parts[1].dequantize(torch.arange(n), k))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    bias = torch.randn(46)
    for m in (1, 2, 3, 5, 8, 9, 15, 16, 17, 31, 32, 33, 40):
        assert torch.equal(quant_linear(x[:m], laid, bias), quant_linear(x[:m], filed, bias)), m
    table, laid_table = QuantTensor([filed.parts[1]], k), QuantTensor([laid.parts[1]], k)
    ids = torch.tensor([[36, 0], [17, 36]])
    assert torch.equal(quant_embedding(ids, laid_table), quant_embedding(ids, table))
    with pytest.raises(IndexError, match="out of range"):
        quant_embedding(torch.tensor([37]), laid_table)
    with pytest.raises(IndexError, match="out of range"):
        quant_embedding(torch.tensor([3, -1]), table)


@needs_q8
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("k", [512, 768])  # 768: 3 super-blocks, so a Q6_K panel is not 64-byte aligned
def test_nibble_formats_laid_out_as_packed_panels_give_the_files_results_to_the_bit(qtype, k):
    """A nibble format's panels keep its codes packed (two a byte, plus Q5_0's fifth and Q6_K's
    top bits) and its scales as the file stores them: every row count gives the file layout's
    bits (VNNI below 16 rows, AMX tiles from 16 where there are any), for one part alone and
    beside others in a fused matrix, at 1, 2 and 4 threads (each thread a run of panels, ending
    inside a part at 4); the fp32 rows too. A table
    whose rows are looked up stays in the file's layout, and packed panels refuse a lookup."""
    n = 37  # the last panel holds 5 channels
    number = quant.QTYPES[qtype]
    data = _blocks(qtype, n, k, seed=11)
    filed = QuantTensor(
        [
            QuantPart(number, data),
            QuantPart(quant.QTYPES["Q8_0"], _blocks("Q8_0", 20, k, seed=12)),
            QuantPart(number, _blocks(qtype, 3, k, seed=13)),
        ],
        k,
        torch.bfloat16,
    )
    laid = filed.in_panels()
    assert [p.qtype for p in laid.parts] == [quant.PANELS + p.qtype for p in filed.parts]
    assert laid.parts[0].data.numel() == 3 * 16 * quant.row_bytes(number, k) and laid.shape == filed.shape
    generator = torch.Generator().manual_seed(k)
    threads = torch.get_num_threads()
    try:  # each thread takes a run of the 6 panels: at 4 threads runs start and end inside parts
        for dtype, count in itertools.product((torch.bfloat16, torch.float32), (1, 2, 4)):
            torch.set_num_threads(count)
            x = torch.randn(40, k, generator=generator).to(dtype)
            for m in (1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 40):
                laid_rows, filed_rows = quant_linear(x[:m], laid.to(dtype)), quant_linear(x[:m], filed.to(dtype))
                assert torch.equal(laid_rows, filed_rows), (m, count)
    finally:
        torch.set_num_threads(threads)
    table = QuantTensor([QuantPart(number, data)], k)
    assert table.in_panels(lookups=True) is table
    with pytest.raises(ValueError, match="packed panels"):
        laid.parts[0].dequantize(torch.tensor([0]), k)


def test_a_matrix_the_int8_kernel_does_not_multiply_is_not_laid_out():
    narrow = QuantTensor([QuantPart(quant.QTYPES["Q8_0"], _blocks("Q8_0", 4, 96))], 96)  # 96 % 64
    mixed = QuantTensor(
        [
            QuantPart(quant.QTYPES["Q8_0"], _blocks("Q8_0", 4, 256)),
            QuantPart(quant.QTYPES["Q4_1"], _blocks("Q4_1", 4, 256)),
        ],
        256,
    )
    assert narrow.in_panels() is narrow and mixed.in_panels() is mixed


def test_formats_or_widths_the_int8_kernels_do_not_take_keep_float_activations():
    assert not quant.Plan([(quant.QTYPES["Q4_1"], _blocks("Q4_1", 4, 256), None, 4)], 256).q8
    assert not quant.Plan([(quant.QTYPES["Q8_0"], _blocks("Q8_0", 4, 96), None, 4)], 96).q8  # 96 % 64
    mixed = quant.Plan(
        [
            (quant.QTYPES["Q8_0"], _blocks("Q8_0", 4, 256), None, 4),
            (quant.QTYPES["Q5_K"], _blocks("Q5_K", 4, 256), None, 4),
        ],
        256,
    )
    assert not mixed.q8


def test_int8_rounds_each_weight_to_half_a_step_and_multiplies_exactly():
    w = torch.randn(37, 96) * torch.rand(37, 1)  # rows of different magnitude
    w[5] = 0.0  # an all-zero channel: scale 0, no division by zero
    q, scales = quant.quantize_i8(w)
    step = w.abs().amax(dim=1) / 127
    assert torch.allclose(scales, step)
    deq = quant.dequant_rows(quant.I8, q, scales, torch.arange(37), 96)
    assert ((deq - w).abs() <= step[:, None] / 2 + 1e-7).all()
    assert torch.equal(deq[5], torch.zeros(96))
    x = torch.randn(6, 96)
    err = (_matmul(quant.I8, q, scales, x).double() - x.double() @ deq.double().T).abs()
    assert (err <= _bound(x, deq)).all()


def test_quant_linear_of_mixed_parts_bias_and_bf16_equals_f_linear_on_the_dequantised_matrix():
    parts = [
        QuantPart(quant.QTYPES["Q5_0"], _blocks("Q5_0", 8, 256, 1)),
        QuantPart(quant.QTYPES["Q6_K"], _blocks("Q6_K", 6, 256, 2)),
        QuantPart(quant.QTYPES["Q8_0"], _blocks("Q8_0", 5, 256, 3)),
    ]
    weight = QuantTensor(parts, 256)
    assert weight.shape == (19, 256) and weight.formats == ["Q5_0", "Q6_K", "Q8_0"]
    assert weight.nbytes == 8 * 176 + 6 * 210 + 5 * 272
    g = torch.Generator().manual_seed(0)
    dense, bias, x = weight.dequantize(), torch.randn(19, generator=g), torch.randn(2, 3, 256, generator=g)
    out_bf16 = quant_linear(x.bfloat16(), weight.to(torch.bfloat16), bias)
    assert out_bf16.dtype == torch.bfloat16
    if weight.plan.q8:  # 8-bit activations: F.linear on the rows as the kernel rounds them
        x8 = _int8_rows(x.reshape(-1, 256))[0].float().view(x.shape)
        torch.testing.assert_close(quant_linear(x, weight, bias), F.linear(x8, dense, bias), rtol=1e-4, atol=1e-4)
        x8 = _int8_rows(x.bfloat16().reshape(-1, 256))[0].float().view(x.shape)
        torch.testing.assert_close(out_bf16.float(), F.linear(x8, dense, bias), rtol=2**-7, atol=1e-3)
        return
    # fp32 sums in two orders (ours, oneDNN's): k * 2^-24 * sum|w x| is ~1e-4 here
    torch.testing.assert_close(quant_linear(x, weight, bias), F.linear(x, dense, bias), rtol=1e-4, atol=1e-4)
    if quant.bf16_dot():  # bf16 weights, fp32 sums: F.linear on the bf16 matrix, up to summation order
        want = F.linear(x.bfloat16().float(), dense.bfloat16().float(), bias)
        torch.testing.assert_close(out_bf16.float(), want, rtol=2**-7, atol=1e-3)
    else:  # fp32 weights and sums, one rounding of the result
        assert torch.equal(out_bf16, quant_linear(x.bfloat16().float(), weight, bias).bfloat16())


def test_quant_embedding_looks_rows_up_and_int8_of_a_dense_table():
    table = torch.randn(50, 64)
    weight = quantize_int8(table, torch.bfloat16)
    ids = torch.tensor([[3, 49], [0, 3]])
    rows = quant_embedding(ids, weight)
    assert rows.shape == (2, 2, 64) and rows.dtype == torch.bfloat16
    assert torch.equal(rows.float(), weight.dequantize()[ids].bfloat16().float())
    with pytest.raises(IndexError, match="out of range"):
        quant_embedding(torch.tensor([50]), weight)


def _int8_products(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x @ W^T with 8-bit activations for a 37 x 512 matrix of each format, and of Q8_0 laid out."""
    out = {}
    for qtype in Q8:
        data, scales, number = _weights(qtype, 37, 512, seed=7)
        out[qtype] = quant.qmatmul(quant.Plan([(number, data, scales, 37)], 512), x, fast=True)
    panels = quant.lay_out(quant.QTYPES["Q8_0"], _weights("Q8_0", 37, 512, seed=7)[0], 512)
    plan = quant.Plan([(quant.PANELS + quant.QTYPES["Q8_0"], panels, None, 37)], 512)
    out["panels"] = quant.qmatmul(plan, x, fast=True)
    return out


@needs_q8
@pytest.mark.skipif(cpu_kernels.load_amx() is None, reason="no usable AMX tiles: every row already takes VNNI")
def test_tiles_off_the_int8_kernels_give_the_tiles_bits(tmp_path):
    """TREESERVE_AMX=0 (a process that may not use AMX) multiplies 16+ rows with VNNI instead of
    tiles: the same bits, in every format and in the laid-out panels."""
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(8)).bfloat16()
    without = products_without_tiles("tests.kernels.test_quant_kernels:_int8_products", x, tmp_path)
    with_tiles = _int8_products(x)
    assert with_tiles.keys() == without.keys()
    for name, got in with_tiles.items():
        assert torch.equal(got, without[name]), name
