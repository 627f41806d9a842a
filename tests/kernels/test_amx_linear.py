"""The bf16 linear layer on AMX tiles (`kernels/cpu/amx_linear.c`'s `amx_dense_matmul`, on a dense
matrix's panels as they lie): one bf16 rounding of the exact product, and a row's bits independent
of the batch, its place in a tile and the threads. Skipped where the CPU (or the VM under it) gives
no AMX tiles, unless TREESERVE_AMX_EMULATED=1 emulates them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treeserve import SamplingParams
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import quant
from treeserve.layers.embedding import Embedding
from treeserve.layers.linear import Linear
from treeserve.layers.quant import QuantTensor, dense_panels, quant_linear

pytestmark = pytest.mark.skipif(cpu_kernels.load_amx() is None, reason="no usable AMX tiles on this CPU")


def on_tiles(weight: torch.Tensor) -> QuantTensor:
    """`weight` as dense panels, multiplied on the tiles."""
    panels = dense_panels(weight)
    assert panels.plan.function is cpu_kernels.load_amx().amx_dense_matmul
    return panels


def amx(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return quant_linear(x, on_tiles(weight), bias)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(37, 96), (512, 256), (256, 704), (1204, 256)])
def test_amx_linear_rounds_the_fp32_product_once(rows, n, k):
    """|ours - x.W^T - b| <= one bf16 rounding (2^-8 relative) + fp32 summation, for n not a multiple of
    16 (zero channels pad the last panel), strided x rows and a last partial tile of rows."""
    torch.manual_seed(rows * n + k)
    x = torch.randn(rows, 2 * k, dtype=torch.bfloat16)[:, :k]
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    exact = F.linear(x.double(), weight.double(), bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
    error = (amx(x, weight, bias).double() - exact).abs()
    assert (error <= 2**-8 * exact.abs() + k * 2**-23 * scale).all()


def test_amx_linear_row_does_not_depend_on_the_batch_or_threads():
    torch.manual_seed(0)
    weight = torch.randn(300, 640, dtype=torch.bfloat16)
    x = torch.randn(40, 640, dtype=torch.bfloat16)
    tiles = on_tiles(weight)
    batch = quant_linear(x, tiles)
    for rows in (1, 3, 15, 16, 17, 33):
        assert torch.equal(quant_linear(x[:rows], tiles), batch[:rows])
    for i in (0, 15, 16, 39):  # first and last lane of a tile, alone
        assert torch.equal(quant_linear(x[i : i + 1], tiles), batch[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_linear(x, tiles), batch)
    finally:
        torch.set_num_threads(threads)


def test_bf16_linear_multiplies_its_panels_on_the_tiles():
    """`pick_kernel` lays the weight out once as dense panels (no second copy), which the tiles read
    as they lie, 3-D input keeping its shape; fp32 rows are rounded to bf16 first; a width that is
    no whole number of 32-weight chunks stays on the AVX512-BF16 panels kernel."""
    torch.manual_seed(0)
    linear = Linear(256, 100).bfloat16()
    x = torch.randn(2, 9, 256, dtype=torch.bfloat16)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    linear.pick_kernel()
    assert isinstance(linear.weight, QuantTensor) and linear.kernel is quant_linear
    assert linear.weight.plan.function is cpu_kernels.load_amx().amx_dense_matmul
    assert linear.weight.nbytes == 7 * 16 * 256 * 2
    linear.pick_kernel()  # a second pick keeps the panels
    assert linear.weight.plan.function is cpu_kernels.load_amx().amx_dense_matmul
    out = linear(x)
    assert torch.equal(out, amx(x.view(18, 256), weight, bias).view(2, 9, 100))
    assert torch.equal(quant_linear(x.float(), linear.weight.to(torch.float32), bias.float()).bfloat16(), out)
    narrow = Linear(48, 20).bfloat16()
    narrow.pick_kernel()
    assert narrow.weight.plan.function is quant.load_bf16().bf16_matmul


def test_embedding_table_laid_out_as_panels_on_tiles_gives_its_rows():
    torch.manual_seed(0)
    table = Embedding(100, 64).bfloat16()
    ids = torch.tensor([[0, 15, 16, 99], [42, 42, 7, 1]])
    expected = table(ids)
    table.pick_kernel()
    assert table.weight.plan.function is cpu_kernels.load_amx().amx_dense_matmul  # a tied head's matmul
    assert table.weight.formats == ["BF16"] and table.weight.nbytes == 7 * 16 * 64 * 2
    assert torch.equal(table(ids), expected)


@pytest.mark.parametrize("checkpoint", ["llama_dir", "qwen2_dir"])  # an LM head of its own; one tied to the table
def test_engine_same_greedy_tokens_with_and_without_tiles(checkpoint, make_llm, monkeypatch, request):
    path = request.getfixturevalue(checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["The quick brown fox", "Numbers 0 1 2 3"]
    llm = make_llm(path, dtype="bfloat16")
    tiled = llm.generate(prompts, params)
    model = llm.engine.model
    assert model.layers[0].mlp.down_proj.weight.plan.function is cpu_kernels.load_amx().amx_dense_matmul
    assert model.embed_tokens.weight.plan.function is cpu_kernels.load_amx().amx_dense_matmul
    assert model.layer_stack is not None  # every layer of a step in one C call, on the tiles
    monkeypatch.setattr(cpu_kernels, "amx_supports", lambda weight: False)
    monkeypatch.setattr(quant, "load_amx", lambda: None)  # the panels on AVX512-BF16 dot products
    plain = make_llm(path, dtype="bfloat16").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in tiled] == [o.outputs[0].token_ids for o in plain]
