"""The quantised matmuls (`kernels/triton/quant_matmul.py`) against their PyTorch references
(`kernels/quant_reference.py`): on a GPU, or on CPU tensors in Triton's interpreter.

Tolerances, and why:
* W4A16 / W8A16: the kernel multiplies exact values (x, and code - zero as small integers) and
  scales each tile's fp32 dot by its group's scale, so it differs from the reference (dequantise
  in fp32, fp32 matmul) only in the order of fp32 sums: fp32 within 1e-5 relative (plus 1e-5 of
  the output's largest magnitude, where sums cancel); fp16 / bf16 within one ulp of the result's
  single rounding (a different fp32 sum can move it across a rounding edge).
* A row's result is the same bits at m = 1, 3, 17 and 33 (split-K and one pass) in the
  interpreter: the K chunks depend on the weight only. There x is quarter-integers, so each
  tile's dot is exact whatever numpy's BLAS sums first; on a GPU x is random and the test also
  needs tl.dot's order not to change with the tile height (unmeasured).
* int8 W8A8: integer sums are exact and every path runs one epilogue: equal bit for bit.
* FP8 W8A16 (Triton): e4m3 decoded exactly (every byte checked), fp32 sums as above. FP8 W8A8
  through `torch._scaled_mm` runs here on CPU tensors (torch implements it), against the
  reference that quantises x per row the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

from treeserve.kernels import quant_reference as ref  # noqa: E402
from treeserve.kernels.triton import quant_matmul as qm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]
ULP = {torch.float16: 2**-10, torch.bfloat16: 2**-7}


def act_order(k: int, group_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_idx, input_order) as GPTQ's act-order writes them: columns quantised in a random order
    (perm), g_idx[perm[i]] = i // group_size; stored columns sorted by g_idx (stable)."""
    perm = torch.argsort(torch.rand(k, generator=gen))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group_size
    return g_idx, torch.argsort(g_idx, stable=True)


def int_weight(
    n: int, k: int, bits: int, group_size: int, zeros: bool, gen: torch.Generator, scale_dtype=torch.float32
):
    """Random codes (packed for 4 bits), scales and zero points in the kernels' layout."""
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    codes = q[:, 0::2] | (q[:, 1::2] << 4) if bits == 4 else q
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.05 + 0.01).to(scale_dtype)
    zero = torch.randint(0, 2**bits, (n, k // group_size), generator=gen, dtype=torch.uint8) if zeros else None
    return q, codes, scales, zero


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().item()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=ULP[want.dtype], atol=1e-5 * scale)


SHAPES = [(96, 160, 32), (96, 256, 128), (64, 192, 192)]  # (n, k, group): groups of 32, 128, per channel
VARIANTS = ["symmetric", "zeros+order", "symmetric+order+bias"]


def run_case(m, shape, bits, variant, dtype, seed):  # noqa: ANN001, ANN201 - parametrised values
    n, k, group = shape
    gen = torch.Generator().manual_seed(seed)
    _, codes, scales, zeros = int_weight(n, k, bits, group, "zeros" in variant, gen)
    order = act_order(k, group, gen)[1] if "order" in variant else None
    bias = torch.randn(n, generator=gen).to(dtype) if "bias" in variant else None
    x = torch.randn(m, k, generator=gen).to(dtype)
    args = [t if t is None or isinstance(t, int) else t.to(DEVICE) for t in (codes, bits, scales, zeros, group, order)]
    got = qm.int_weight_matmul_triton(x.to(DEVICE), *args, bias=None if bias is None else bias.to(DEVICE))
    want = ref.int_weight_matmul_reference(x, codes, bits, scales, zeros, group, order, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    close(got.cpu(), want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 17, 33])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int_weight_fp32_matches_the_reference(shape, m, bits, variant):
    run_case(m, shape, bits, variant, torch.float32, seed=m * 7 + bits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_int_weight_half_matches_the_reference(shape, m, bits, dtype):
    run_case(m, shape, bits, "zeros+order", dtype, seed=m + bits)


def test_half_scales_and_strided_x():
    """bf16 scales, and x a column slice of a wider tensor (row stride != k)."""
    gen = torch.Generator().manual_seed(3)
    _, codes, scales, zeros = int_weight(96, 160, 4, 32, True, gen, scale_dtype=torch.bfloat16)
    wide = torch.randn(5, 200, generator=gen).to(torch.bfloat16)
    x = wide[:, 20:180]
    got = qm.int_weight_matmul_triton(x.to(DEVICE), codes.to(DEVICE), 4, scales.to(DEVICE), zeros.to(DEVICE), 32)
    close(got.cpu(), ref.int_weight_matmul_reference(x, codes, 4, scales, zeros, 32))


def test_act_order_is_gptq_g_idx():
    """The reference with input_order equals GPTQ's own definition: the unpermuted weight's column c
    in group g_idx[c], x multiplied as it comes."""
    gen = torch.Generator().manual_seed(5)
    n, k, group = 48, 128, 32
    g_idx, order = act_order(k, group, gen)
    assert (g_idx[order] == torch.arange(k) // group).all()  # stored column j is in group j // 32
    q, codes, scales, zeros = int_weight(n, k, 4, group, True, gen)
    original = torch.empty(n, k)
    original[:, order] = ref.dequantize_int(codes, 4, scales, zeros, group)
    expect = scales[:, g_idx] * (q[:, torch.argsort(order)].float() - zeros[:, g_idx].float())
    torch.testing.assert_close(original, expect, rtol=0, atol=0)
    x = torch.randn(3, k, generator=gen)
    got = ref.int_weight_matmul_reference(x, codes, 4, scales, zeros, group, order)
    torch.testing.assert_close(got, x @ original.T, rtol=1e-5, atol=1e-5)


def test_nibble_order_and_symmetric_zero():
    """Column 2j in the low nibble, 2j + 1 in the high one; no zeros means 8 (4 bits) or 128."""
    codes = torch.tensor([[0x21, 0xF0] + [0x88] * 14], dtype=torch.uint8)  # columns 1, 2, 0, 15, then 8s
    assert ref.unpack_int4(codes)[0, :4].tolist() == [1, 2, 0, 15]
    w = ref.dequantize_int(codes, 4, torch.tensor([[2.0]]), None, 32)
    assert w[0, :5].tolist() == [-14.0, -12.0, -16.0, 14.0, 0.0]
    w8 = ref.dequantize_int(
        torch.tensor([[0, 128, 255] + [128] * 29], dtype=torch.uint8), 8, torch.tensor([[0.5]]), None, 32
    )
    assert w8[0, :3].tolist() == [-64.0, 0.0, 63.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_is_the_same_bits_at_every_batch_size(dtype):
    gen = torch.Generator().manual_seed(11)
    n, k, group = 96, 256, 32
    _, codes, scales, zeros = int_weight(n, k, 4, group, True, gen)
    x = torch.randn(33, k, generator=gen)
    if DEVICE == "cpu":
        # The interpreter's tl.dot is numpy's BLAS, whose order of sums changes with the tile
        # height on some CPUs (OpenBLAS's Haswell kernels): quarter-integer x makes each tile's
        # dot exact, so what is compared is the kernel's own order (scales, chunks, split-K).
        x = (x * 4).round().clamp(-32, 32) / 4
    x = x.to(dtype).to(DEVICE)
    args = (codes.to(DEVICE), 4, scales.to(DEVICE), zeros.to(DEVICE), group)
    chunks, _ = qm.k_chunks(n, k // qm.block_k(group))
    assert chunks > 1  # m <= 16 splits K here; m = 33 walks the same chunks in one program
    full = qm.int_weight_matmul_triton(x, *args)
    for rows in (slice(0, 1), slice(5, 8), slice(16, 33)):
        assert torch.equal(qm.int_weight_matmul_triton(x[rows], *args), full[rows])


def test_heuristics_depend_on_the_weight_not_the_batch():
    assert [qm.tile_for(m) for m in (1, 16, 17, 64, 65, 4096)] == [
        (16, 64, 4),
        (16, 64, 4),
        (32, 64, 4),
        (64, 64, 4),
        (64, 128, 4),
        (128, 128, 8),
    ]
    assert [qm.block_k(g) for g in (32, 64, 96, 128, 4096)] == [32, 64, 32, 128, 128]
    for n, tiles in ((4096, 32), (14336, 32), (96, 5), (4096, 112), (64, 1)):
        chunks, per = qm.k_chunks(n, tiles)
        assert (chunks - 1) * per < tiles <= chunks * per  # every tile in one chunk, no empty chunk
    assert qm.k_chunks(4096, 32) == (4, 8)  # 64 column tiles x 4 chunks: 256 programs at decode


def test_bad_layouts_are_refused():
    gen = torch.Generator().manual_seed(1)
    _, codes, scales, zeros = int_weight(32, 64, 4, 32, True, gen)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size"):
        ref.int_weight_matmul_reference(x, codes, 4, scales, zeros, 48)
    with pytest.raises(ValueError, match="codes"):
        ref.int_weight_matmul_reference(x, codes, 8, scales, zeros, 32)
    with pytest.raises(ValueError, match="zeros"):
        ref.int_weight_matmul_reference(x, codes, 4, scales, zeros.int(), 32)
    with pytest.raises(ValueError, match="input_order"):
        ref.int_weight_matmul_reference(x, codes, 4, scales, zeros, 32, torch.arange(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="bits"):
        qm.int_weight_matmul_triton(x, codes, 3, scales, zeros, 32)


def test_cpu_tensors_take_the_reference():
    gen = torch.Generator().manual_seed(2)
    _, codes, scales, zeros = int_weight(32, 64, 8, 64, False, gen)
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(
        qm.int_weight_matmul(x, codes, 8, scales, zeros, 64),
        ref.int_weight_matmul_reference(x, codes, 8, scales, zeros, 64),
    )
    assert qm.int_weight_matmul_triton(x[:0], codes, 8, scales, zeros, 64).shape == (0, 32)


def fp8_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)


def test_every_e4m3_byte_decodes_exactly():
    """x = I: the kernel's output is the decoded weight; all 254 finite bytes (subnormals, -0)."""
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    weight = torch.zeros(16, 256, dtype=torch.uint8)
    weight[:, : len(finite)] = torch.tensor(finite, dtype=torch.uint8)
    weight = weight.view(torch.float8_e4m3fn)
    got = qm.fp8_weight_matmul_triton(torch.eye(256).to(DEVICE), weight.to(DEVICE), torch.ones(1, device=DEVICE))
    assert torch.equal(got.T.cpu(), weight.float())


@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k", [(1, 160), (17, 72), (33, 256)])
def test_fp8_w8a16_triton_matches_the_reference(m, k, dtype, per_channel):
    gen = torch.Generator().manual_seed(m + k)
    n = 96
    weight = fp8_weight(n, k, gen)
    scale = torch.rand(n if per_channel else 1, generator=gen) * 0.01 + 0.001
    x, bias = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    got = qm.fp8_weight_matmul_triton(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE))
    close(got.cpu(), ref.fp8_matmul_reference(x, weight, scale, bias))


def test_fp8_token_scales_are_vllms():
    x = torch.tensor([[1.0, -896.0, 3.0], [0.0, 0.0, 0.0], [0.5, 0.25, -0.125]])
    x_q, scale = ref.fp8_token_scales(x)
    assert scale.shape == (3, 1) and scale.dtype == torch.float32
    assert scale[:, 0].tolist() == pytest.approx([2.0, ref.FP8_MIN_SCALE, 0.5 / 448])
    assert x_q.dtype == torch.float8_e4m3fn and x_q.float().abs().amax(1).tolist() == [448.0, 0.0, 448.0]
    assert x_q.float()[0].tolist() == [0.5, -448.0, 1.5]


@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_scaled_mm_arguments(dtype, per_channel):
    """What `fp8_matmul` hands `torch._scaled_mm` on an FP8 card: row-major fp8 input, column-major
    weight, k and n multiples of 16; bf16: row-wise [m, 1] and [1, n] fp32 scales and a bf16 bias;
    fp16 / fp32: unit scalar scales, fp32 out, the row scales returned for the epilogue."""
    gen = torch.Generator().manual_seed(4)
    m, n, k = 5, 48, 64
    weight = fp8_weight(n, k, gen)
    scale = torch.rand(n if per_channel else 1, generator=gen)
    x, bias = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    args, x_scale = qm.fp8_scaled_mm_args(x, weight, scale, bias)
    assert args["input"].dtype == torch.float8_e4m3fn and args["input"].stride() == (k, 1)
    assert args["mat2"].shape == (k, n) and args["mat2"].stride() == (1, k)
    if dtype == torch.bfloat16:
        assert x_scale is None and args["out_dtype"] == torch.bfloat16 and args["bias"].dtype == torch.bfloat16
        assert args["scale_a"].shape == (m, 1) and args["scale_b"].shape == (1, n)
        assert args["scale_a"].is_contiguous() and args["scale_b"].is_contiguous()
        assert torch.equal(args["scale_b"][0], scale.expand(n))
    else:
        assert x_scale.shape == (m, 1) and args["out_dtype"] == torch.float32 and "bias" not in args
        assert args["scale_a"].shape == () and args["scale_b"].shape == () and args["scale_a"].item() == 1.0
    out = torch._scaled_mm(args.pop("input"), args.pop("mat2"), **args)  # torch's CPU kernel takes them
    assert out.shape == (m, n)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_w8a8_through_scaled_mm_matches_the_reference(dtype, per_channel, bias):
    """torch's CPU `_scaled_mm` here; bf16 output is rounded inside it (one ulp), the others exact
    sums in fp32 then the epilogue."""
    gen = torch.Generator().manual_seed(6)
    m, n, k = 17, 48, 96
    weight = fp8_weight(n, k, gen)
    scale = torch.rand(n if per_channel else 1, generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    close(qm.fp8_matmul_scaled(x, weight, scale, b), ref.fp8_matmul_reference(x, weight, scale, b, True))


def test_fp8_backend_follows_the_card(monkeypatch):
    cuda = torch.device("cuda")
    for capability, want in (((9, 0), "scaled_mm"), ((8, 9), "scaled_mm"), ((8, 0), "triton")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert qm.fp8_backend(cuda, 4096, 4096) == want
    assert qm.fp8_backend(cuda, 4096, 4104) == "triton"  # k not a multiple of 16: _scaled_mm refuses it
    assert qm.fp8_backend(torch.device("cpu"), 4096, 4096) == "reference"
    gen = torch.Generator().manual_seed(8)
    weight, x = fp8_weight(32, 64, gen), torch.randn(3, 64, generator=gen)
    assert torch.equal(qm.fp8_matmul(x, weight, torch.ones(1)), ref.fp8_matmul_reference(x, weight, torch.ones(1)))


def int8_case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):  # noqa: ANN201 - tensors
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.01
    return torch.randn(m, k, generator=gen).to(dtype), weight, scale, torch.randn(n, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 96, 160), (3, 96, 100), (17, 40, 72), (33, 96, 256)])
def test_int8_triton_equals_the_reference(m, n, k, dtype):
    x, weight, scale, bias = int8_case(m, n, k, dtype, seed=m)
    got = qm.int8_matmul_triton(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE))
    assert torch.equal(got.cpu(), ref.int8_matmul_reference(x, weight, scale, bias))


def test_int8_int_mm_arguments_and_rules():
    """`torch._int_mm(x_q, weight.t())` (torch's CPU kernel here) with the shared epilogue gives the
    reference's bits; the shapes `_int_mm` refuses on CUDA go to the Triton kernel."""
    x, weight, scale, bias = int8_case(33, 96, 160, torch.bfloat16, seed=9)
    x_q, x_scale = ref.int8_token_scales(x)
    got = ref.int8_epilogue(torch._int_mm(x_q, weight.t()), x_scale, scale, bias, x.dtype)
    assert torch.equal(got, ref.int8_matmul_reference(x, weight, scale, bias))
    assert torch.equal(qm.int8_matmul(x, weight, scale, bias), got)  # a CPU tensor: the reference
    assert qm.int8_uses_int_mm(17, 96, 160) and not qm.int8_uses_int_mm(16, 96, 160)
    assert not qm.int8_uses_int_mm(64, 100, 160) and not qm.int8_uses_int_mm(64, 96, 100)


def test_int8_token_scales():
    x_q, scale = ref.int8_token_scales(torch.tensor([[127.0, -63.5, 2.5, 3.5], [0.0, 0.0, 0.0, 0.0]]))
    assert x_q.tolist() == [[127, -64, 2, 4], [0, 0, 0, 0]]  # halves round to even
    assert scale[:, 0].tolist() == pytest.approx([1.0, ref.INT8_MIN_SCALE])


@CUDA
@pytest.mark.parametrize("m", [1, 17, 600])
def test_cuda_paths(m):
    """On a GPU: W4A16, FP8 (whichever backend the card takes) and int8 (_int_mm and Triton)."""
    gen = torch.Generator().manual_seed(m)
    n, k = 256, 512
    _, codes, scales, zeros = int_weight(n, k, 4, 128, True, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    got = qm.int_weight_matmul(x.cuda(), codes.cuda(), 4, scales.cuda(), zeros.cuda(), 128)
    close(got.cpu(), ref.int_weight_matmul_reference(x, codes, 4, scales, zeros, 128))
    weight, w_scale = fp8_weight(n, k, gen), torch.rand(n, generator=gen) * 0.01
    quantized = qm.fp8_backend(torch.device("cuda"), n, k) == "scaled_mm"
    got = qm.fp8_matmul(x.cuda(), weight.cuda(), w_scale.cuda())
    close(got.cpu(), ref.fp8_matmul_reference(x, weight, w_scale, quantize_activations=quantized))
    x, weight, scale, bias = int8_case(m, n, k, torch.bfloat16, seed=m)
    got = qm.int8_matmul(x.cuda(), weight.cuda(), scale.cuda(), bias.cuda())
    assert torch.equal(got, ref.int8_matmul_reference(x.cuda(), weight.cuda(), scale.cuda(), bias.cuda()))


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU compiles and runs the kernels in the tests above")
def test_kernels_compile_for_ampere_and_hopper():
    """Every branch of the three kernels compiles to cubin for sm_80 and sm_90 (no GPU needed:
    the interpreter accepts programs a GPU compile refuses). Slow: ~10 s a configuration here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compile_quant_for_gpu.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if "ptxas" in done.stdout and "not found" in done.stdout:
        pytest.skip("this triton build has no ptxas to compile with")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert done.stdout.count("ok ") == 12
