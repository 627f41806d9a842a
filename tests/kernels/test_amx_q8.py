"""Packed nibble panels on the 8-bit kernel's AMX-INT8 tiles (`q8_kernels.c`'s `channel_rows`).

A Q4_0, Q5_0, Q4_K or Q6_K matrix laid out as packed panels multiplies 16+ rows on the tiles
(its codes unpacked once a call into the channel rows the file's layout gives the tiles), fewer
on VNNI, and every row count on VNNI under TREESERVE_AMX=0. The integer sums are exact and the
float steps one order, so a row's result has the same bits whichever did, whatever m, and the
file layout's bits. Real tiles, or emulated ones (TREESERVE_AMX_EMULATED=1, as CI runs this).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gguf_files import random_blocks
from tests.kernels.tiles_off import products_without_tiles
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import quant
from treeserve.layers.quant import QuantPart, QuantTensor, quant_linear

pytestmark = pytest.mark.skipif(not quant.q8_available(), reason="this CPU has no AVX512-VNNI: no 8-bit activations")
NIBBLES = ["Q4_0", "Q5_0", "Q4_K", "Q6_K"]
ROWS = (1, 15, 16, 17, 40)  # VNNI below a tile of 16, the tiles from 16 (a partial tile at 17)


def _filed(qtype: str, k: int, dtype: torch.dtype) -> QuantTensor:
    """37 channels (the last panel holds 5) in the file's layout."""
    data = torch.from_numpy(random_blocks(qtype, 37, k, np.random.default_rng(k)))
    return QuantTensor([QuantPart(quant.QTYPES[qtype], data)], k, dtype)


def _laid_out(filed: QuantTensor) -> QuantTensor:
    """The same matrix as packed panels (`quant.lay_out`)."""
    (part,) = filed.parts
    panels = quant.lay_out(part.qtype, part.data, filed.cols)
    return QuantTensor([QuantPart(quant.PANELS + part.qtype, panels, panel_rows=part.rows)], filed.cols, filed.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qtype", NIBBLES)
@pytest.mark.parametrize("k", [512, 768])  # 768: 3 super-blocks, so a Q6_K panel is not 64-byte aligned
def test_packed_panels_rows_have_one_result_whatever_m_and_the_files(qtype, k, dtype):
    filed = _filed(qtype, k, dtype)
    laid = _laid_out(filed)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    full = quant_linear(x, laid)
    for m in ROWS:
        assert torch.equal(quant_linear(x[:m], laid), full[:m]), m
        assert torch.equal(quant_linear(x[40 - m :], laid), full[40 - m :]), m
        assert torch.equal(quant_linear(x[:m], filed), full[:m]), m


def _products(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each format's packed panels times x's first m rows, for every m in ROWS."""
    out = {}
    for qtype in NIBBLES:
        laid = _laid_out(_filed(qtype, x.shape[1], x.dtype))
        for m in ROWS:
            out[f"{qtype} {m}"] = quant_linear(x[:m], laid)
    return out


@pytest.mark.skipif(cpu_kernels.load_amx() is None, reason="no usable AMX tiles: every row already takes VNNI")
def test_tiles_off_packed_panels_give_the_tiles_bits(tmp_path):
    """TREESERVE_AMX=0 multiplies the same panels on VNNI at every row count: the same bits."""
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(9)).bfloat16()
    without = products_without_tiles("tests.kernels.test_amx_q8:_products", x, tmp_path)
    with_tiles = _products(x)
    assert with_tiles.keys() == without.keys()
    for name, got in with_tiles.items():
        assert torch.equal(got, without[name]), name
