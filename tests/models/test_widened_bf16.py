"""bf16 models on a CPU that does not multiply bf16 itself and has no AVX2 kernel: weights widened
to fp32 at load.

Without AVX512-BF16 or AMX, PyTorch emulates bf16 products (3-7x slower than fp32 on an AVX2 AMD
EPYC), so `Linear` and `Embedding` hold a bf16 model's matrices in fp32 and multiply the bf16
activations in fp32, rounding each product to bf16 once (`layers/linear.py`). These tests force
that path on any CPU (`native_bf16` reported False) and check the layer, a whole model against its
fp32 twin, and batch invariance.
"""

from __future__ import annotations

import pytest
import torch

from treeserve import LLM, SamplingParams
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import avx2
from treeserve.layers import linear
from treeserve.layers.linear import row_invariant_linear, widened_linear


@pytest.fixture
def no_native_bf16(monkeypatch):
    """Neither native bf16 nor the AVX2 kernel (tests/kernels/test_avx2_linear.py covers that one)."""
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: False)
    monkeypatch.setattr(cpu_kernels, "amx_supports", lambda weight: False)
    monkeypatch.setattr(avx2, "supports", lambda weight: False)


def test_widened_linear_is_the_fp32_product_rounded_once_and_row_invariant():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(40, 64, generator=g).bfloat16()
    out = widened_linear(x, weight.float(), bias.float())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, row_invariant_linear(x.float(), weight.float(), bias.float()).bfloat16())
    for rows in (1, 3, 17, 40):  # a row's bits do not depend on how many rows share the matmul
        assert torch.equal(widened_linear(x[:rows], weight.float(), bias.float()), out[:rows])


def test_a_bf16_model_widens_and_follows_its_fp32_twin(llama_dir, no_native_bf16):
    wide = LLM(llama_dir, dtype="bfloat16", kv_cache_memory=8 << 20)
    model = wide.engine.model
    assert model.embed_tokens.widened and model.embed_tokens.weight.dtype == torch.float32
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float32
    assert layer.self_attn.qkv_proj.kernel is linear.widened_linear
    assert layer.input_layernorm.weight.dtype == torch.bfloat16  # everything else stays bf16
    ids = wide.get_tokenizer().encode("Once upon a time, in a land far away")
    fp32 = LLM(llama_dir, dtype="float32", kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    got = wide.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    want = fp32.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    first = [next(iter(e.values())).logprob for e in got.logprobs[:1]]
    reference = [next(iter(e.values())).logprob for e in want.logprobs[:1]]
    assert got.token_ids[:4] == want.token_ids[:4]  # bf16 rounding may part them later, not at once
    assert abs(first[0] - reference[0]) < 0.05
    wide.engine.check_pages_idle()


def test_widened_requests_are_batch_invariant(llama_dir, no_native_bf16):
    assert_batch_invariant(LLM(llama_dir, dtype="bfloat16", kv_cache_memory=8 << 20))


def assert_batch_invariant(llm: LLM) -> None:
    """A seeded request's tokens alone equal its tokens among 20 others (then every page is idle)."""
    target = SamplingParams(temperature=0.9, max_tokens=24, seed=5, ignore_eos=True)
    alone = llm.generate(["Numbers 0 1 2 3"], target)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=8 + i, seed=i, ignore_eos=True) for i in range(20)]
    prompts = ["The quick brown fox"] * 10 + ["Numbers 0 1 2 3"] + ["def f(x):"] * 10
    batch = llm.generate(prompts, others[:10] + [target] + others[10:])
    assert batch[10].outputs[0].token_ids == alone
    llm.engine.check_pages_idle()
