"""A GGUF file's quantised blocks split across two ranks (gloo, CPU): each rank's blocks are the
file's, byte for byte (whole rows of column-parallel matrices, whole blocks of each row of
row-parallel ones), the ranks give one rank's outputs, and a split that would cut a block is
refused before any weight loads."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gguf_files import write_gguf
from tests.tiny_models import build_checkpoint
from treeserve import LLM, SamplingParams, ScoreParams
from treeserve.config import EngineConfig
from treeserve.layers.quant import QuantTensor, kernels_available
from treeserve.models.gguf_loader import GGUFCheckpoint
from treeserve.models.llama import LlamaForCausalLM
from treeserve.models.loader import read_model_config
from treeserve.models.sharding import ROW_PARALLEL, shard_config, shard_tensor

pytestmark = [
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores"),
    pytest.mark.skipif(not kernels_available(), reason="no C compiler: quantised kernels not built"),
]
# o_proj and down_proj 512 inputs wide (256 a rank: whole K-quant blocks); one KV head, which both
# ranks hold a copy of (Gemma 3 270M's shape); the formats rotate over the tensors, so the
# row-parallel matrices are Q5_0 and Q6_K, the column-parallel ones Q4_0, Q5_0, Q8_0, Q4_K, Q6_K
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=128)
QUANTS = ("Q4_K", "Q8_0", "Q6_K", "Q5_0", "Q4_0")
PROMPTS = ["def f(x):", "hello world", "the quick brown fox"]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("gguf-tp")
    hf = build_checkpoint(str(root / "hf"), "llama", **SHAPE)
    return write_gguf(hf, str(root / "tiny.gguf"), "llama", quants=QUANTS)


def test_each_ranks_blocks_are_the_files(gguf_path):
    """The two ranks' shards of every quantised matrix, dequantised and put back together, are the
    whole matrix dequantised, to the bit; their bytes are the file's."""
    config = read_model_config(gguf_path)
    ranks = [shard_config(config, rank, 2) for rank in range(2)]
    split, by_format = set(), {}
    for name, whole in GGUFCheckpoint(gguf_path).tensors(keep_quantized=True):
        if not isinstance(whole, QuantTensor):
            continue
        by_format[whole.formats[0]] = whole
        local, part = LlamaForCausalLM.hf_to_local(name)
        shards = [shard_tensor(local, whole, part, cfg) for cfg in ranks]
        assert all(isinstance(s, QuantTensor) and len(s.parts) == 1 for s in shards)
        if part in ("k_proj", "v_proj"):  # one KV head: each rank holds a copy of it
            assert all(torch.equal(s.parts[0].data, whole.parts[0].data) for s in shards)
            continue
        dim = 1 if local.split(".")[-2] in ROW_PARALLEL else 0
        assert torch.equal(torch.cat([s.dequantize() for s in shards], dim=dim), whole.dequantize()), name
        assert torch.equal(torch.cat([s.parts[0].data for s in shards], dim=dim), whole.parts[0].data), name
        split.add((dim, whole.formats[0]))
    assert {(1, "Q5_0"), (1, "Q6_K"), (0, "Q4_K"), (0, "Q8_0")} <= split  # both block sizes, both ways
    with pytest.raises(ValueError, match=r"columns \[0, 48\) of a 256-wide Q8_0 matrix cut its 32-weight blocks"):
        by_format["Q8_0"].slice_columns(0, 48)
    with pytest.raises(ValueError, match="cut its 256-weight blocks"):
        by_format["Q6_K"].slice_columns(0, 128)


def outputs(llm: LLM) -> tuple[list, torch.Tensor]:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ids = llm.get_tokenizer().encode("def f(x): return x * x", add_special_tokens=False)
    [scored] = llm.score([ids], ScoreParams(positions=list(range(len(ids))), token_ids=[3, 5, 7, 11]))
    return [o.outputs[0].token_ids for o in greedy], torch.as_tensor(scored.logprobs)


@pytest.mark.parametrize("kind", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_two_ranks_run_the_files_blocks(gguf_path, kind):
    one = LLM(gguf_path, dtype="float32", quantization="gguf", kv_cache_memory=8 << 20)
    two = LLM(gguf_path, dtype="float32", quantization="gguf", kv_cache_memory=8 << 20, **{kind: 2})
    assert one.engine.quantization.startswith("gguf:")
    assert two.engine.quantization.startswith("gguf:")
    assert two.engine.ranks.parts[0]["quantization"].startswith("gguf:")  # rank 1 runs blocks too
    (tokens1, logprobs1), (tokens2, logprobs2) = outputs(one), outputs(two)
    assert tokens2 == tokens1
    if kind == "pipeline_parallel_size":  # whole layers a stage: the same sums in the same order
        assert torch.equal(logprobs2, logprobs1)
    else:
        # o_proj and down_proj add the ranks' partial sums: fp32 sums in another order, a few ulps
        # of these large logits apart (measured 3.4e-5 at |logprob| <= 67). Where the kernels round
        # activations to 8 bits (AVX512-VNNI: `plan.q8`), a rank rounds the same 32-blocks with the
        # same scales (its inputs are whole blocks), but a last-bit difference can tip an activation
        # across a rounding boundary, and on this peaked random model one tipped code moves later
        # logprobs by up to ~0.5: in a Python emulation of that path (the CPU this was written on
        # has no VNNI), row-parallel sums 1e-6 of a row's largest apart tipped codes in 14 of 30
        # trials, by at most 0.49, with the greedy tokens the same in all 30
        q8 = one.engine.model.layers[0].mlp.down_proj.weight.plan.q8
        diff = (logprobs2 - logprobs1).abs().max().item()
        assert diff <= (1.0 if q8 else 2e-4), diff
    for llm in (one, two):
        llm.engine.check_pages_idle()
    two.engine.close()


@pytest.mark.parametrize(
    ("shape", "quants", "message"),
    [
        (dict(intermediate_size=96), ("Q8_0",), r"down_proj's 96 inputs / 2 = 48 a rank, not whole Q8_0 blocks of 32"),
        (
            dict(hidden_size=256, intermediate_size=256, head_dim=64),
            ("Q6_K",),
            r"down_proj's 256 inputs / 2 = 128 a rank, not whole Q6_K blocks of 256; o_proj's 256 inputs / 2 = 128",
        ),
    ],
)
def test_a_split_that_cuts_blocks_is_refused_before_loading(tmp_path, shape, quants, message):
    hf = build_checkpoint(str(tmp_path / "hf"), "llama", **shape)
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama", quants=quants)
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(model=path, dtype="float32", quantization="gguf", tensor_parallel_size=2)
    EngineConfig.from_kwargs(model=path, dtype="float32", dequantize=True, tensor_parallel_size=2)  # dense: any width


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("qwen3moe", dict(mlp_only_layers=[], moe_intermediate_size=64)), ("phi3", {})],
)
def test_two_ranks_run_experts_and_fused_files_in_their_blocks(tmp_path, arch, overrides):
    """Qwen3-MoE's experts in their blocks (each expert's gate/up rows and down columns split as a
    dense MLP's are) and Phi-3's fused q/k/v and gate/up (split into parts by rows, then each part
    a rank's): two ranks give one rank's outputs."""
    hf = build_checkpoint(str(tmp_path / "hf"), "qwen3_moe" if arch == "qwen3moe" else arch, **overrides)
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), arch, quants=("Q8_0", "Q5_0", "Q4_0", "Q5_1"))
    # activations as they are: 8-bit ones (a VNNI CPU) round the ranks' partial sums' last-bit
    # differences into other codes, and the routed experts turn those into other tokens
    settings = dict(dtype="float32", quantization="gguf", quant_activations="bf16", kv_cache_memory=8 << 20)
    one, two = LLM(path, **settings), LLM(path, tensor_parallel_size=2, **settings)
    mlp = one.engine.model.layers[0].mlp
    down = (mlp.experts[0] if arch == "qwen3moe" else mlp).down_proj.weight
    assert isinstance(down, QuantTensor)
    (tokens1, logprobs1), (tokens2, logprobs2) = outputs(one), outputs(two)
    assert tokens2 == tokens1
    assert (logprobs2 - logprobs1).abs().max().item() <= (1.0 if down.plan.q8 else 2e-4)  # as above
    for llm in (one, two):
        llm.engine.check_pages_idle()
    two.engine.close()


def test_experts_whose_blocks_a_split_would_cut_are_refused(tmp_path):
    hf = build_checkpoint(str(tmp_path / "hf"), "qwen3_moe")  # experts 32 wide: 16 a rank
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), "qwen3moe")
    with pytest.raises(ValueError, match=r"down_proj's 32 inputs / 2 = 16 a rank"):
        EngineConfig.from_kwargs(model=path, dtype="float32", quantization="gguf", tensor_parallel_size=2)
