"""bf16 linear layers on AVX2 without AVX512-BF16 (`kernels/cpu/avx2_linear.c`): the fp32 sum of
exact products rounded once, a row's bits independent of the rows beside it, and a whole bf16
model on it close to its fp32 twin and batch-invariant."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_widened_bf16 import assert_batch_invariant
from treeserve import LLM, SamplingParams
from treeserve.kernels.cpu import avx2

pytestmark = pytest.mark.skipif(
    avx2.load() is None, reason="needs AVX2 and FMA without AVX512-BF16 (the kernel's CPUs)"
)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact sum (fp64 holds every bf16 product and these sums exactly enough) rounded to bf16."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), [(1, 8), (3, 7), (96, 64), (97, 131), (33, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_close_to_the_exact_sum_and_row_invariant(n, k, with_bias):
    g = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    x = torch.randn(19, k, generator=g).bfloat16()
    out = avx2.linear(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (19, n)
    want = reference(x, weight, bias)
    ulp = want.float().abs().clamp(min=1e-30) * 2**-7  # one bf16 ulp: fp32 sums in another order
    assert ((out.float() - want.float()).abs() <= ulp).all()
    for rows in (1, 2, 3, 4, 5, 8, 9, 17):  # a row's bits do not depend on how many rows share the call
        assert torch.equal(avx2.linear(x[:rows], weight, bias), out[:rows])
    assert torch.equal(avx2.linear(x[5:6], weight, bias), out[5:6])


def test_strided_rows_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 48, generator=g).bfloat16()
    wide = torch.randn(6, 96, generator=g).bfloat16()
    x = wide[:, :48]  # rows 96 apart
    assert torch.equal(avx2.linear(x, weight), avx2.linear(x.contiguous(), weight))
    assert torch.equal(avx2.linear(x.reshape(2, 3, 48), weight).reshape(6, 40), avx2.linear(x, weight))
    assert avx2.linear(x[:0], weight).shape == (0, 40)


def test_a_bf16_model_runs_on_it_close_to_its_fp32_twin(llama_dir):
    llm = LLM(llama_dir, dtype="bfloat16", kv_cache_memory=8 << 20)
    model = llm.engine.model
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.kernel is avx2.linear
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16  # not widened: half the bytes
    assert not model.embed_tokens.widened
    ids = llm.get_tokenizer().encode("Once upon a time, in a land far away")
    fp32 = LLM(llama_dir, dtype="float32", kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    got = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    want = fp32.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    assert got.token_ids[:4] == want.token_ids[:4]
    first, reference_first = (next(iter(o.logprobs[0].values())).logprob for o in (got, want))
    assert abs(first - reference_first) < 0.05
    llm.engine.check_pages_idle()
    fp32.engine.check_pages_idle()


def test_requests_on_it_are_batch_invariant(llama_dir):
    assert_batch_invariant(LLM(llama_dir, dtype="bfloat16", kv_cache_memory=8 << 20))
