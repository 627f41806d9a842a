"""The C fast paths agree with the PyTorch reference paths they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treeserve import SamplingParams
from treeserve.engine import cpu_kernels
from treeserve.kv.arena import KVArena

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: kernels not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_decode_matches_sdpa(dtype, window):
    torch.manual_seed(0)
    batch, q_heads, kv_heads, head_dim, block = 9, 6, 2, 32, 4
    arena = KVArena(64, 2, block, kv_heads, head_dim, dtype, "cpu")
    arena.buffer.normal_()
    tables = torch.randperm(64)[: batch * 5].view(batch, 5)
    lens = torch.randint(1, 5 * block + 1, (batch,))
    q = torch.randn(batch, q_heads, head_dim, dtype=dtype)
    k_cache, v_cache = arena.layer(1)
    got = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window)
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2).float()
    values = v_cache[tables].flatten(1, 2).transpose(1, 2).float()
    pos = torch.arange(5 * block)
    mask = pos[None] < lens[:, None]
    if window:
        mask &= pos[None] >= lens[:, None] - window
    ref = F.scaled_dot_product_attention(
        q.float()[:, :, None], keys, values, attn_mask=mask[:, None, None], enable_gqa=True
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref[:, :, 0], atol=tol, rtol=tol)


def test_sample_rows_matches_inverse_cdf():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 3
    uniforms = [(i + 0.37) / 64 for i in range(64)]
    got = cpu_kernels.sample_rows(logits, uniforms)
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    ref = torch.searchsorted(cdf, torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:], right=True)
    assert (got == ref.squeeze(1)).float().mean() > 0.98  # only float rounding at bucket edges may differ


def test_engine_same_greedy_tokens_without_kernels(llama_dir, make_llm, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2)
    prompts = ["The quick brown fox", "Numbers 0 1 2 3 4 5"]
    fast = [c.token_ids for o in make_llm(llama_dir).generate(prompts, params) for c in o.outputs]
    monkeypatch.setattr(cpu_kernels, "supports", lambda t: False)
    plain = [c.token_ids for o in make_llm(llama_dir).generate(prompts, params) for c in o.outputs]
    assert fast == plain


def test_loading_the_kernels_leaves_subnormal_floats_alone():
    """A library linked with -ffast-math would switch the whole process to flush-to-zero."""
    import sys

    from treeserve.engine import cpu_kernels

    assert cpu_kernels.load() is not None
    tiny = sys.float_info.min
    assert tiny / 2 > 0.0
    assert torch.tensor(torch.finfo(torch.float32).tiny) / 2 > 0
