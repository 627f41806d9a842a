"""Models with quantised weights: GGUF blocks executed as they are, int8 Hugging Face checkpoints.

The reference for a GGUF file is the same file dequantised on load (`dequantize=True`, fp32):
both compute with the same fp32 weights, so logits agree to fp32 accumulation, except where the
kernels multiply 8-bit activations (a CPU with AVX512-VNNI): then the activations' rounding is
the difference (each matmul's exact bound is in `tests/kernels/test_quant_kernels.py`). int8 is compared
with the dense fp32 checkpoint (its error is the rounding of each weight to half an int8 step
of its channel, and of the activations). Every engine's pages are checked idle after each test.
"""

from __future__ import annotations

import pytest
import torch

from tests.gguf_files import write_gguf
from tests.tiny_models import build_checkpoint
from treeserve import LLM, SamplingParams, ScoreParams
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import quant as quant_kernels
from treeserve.layers.quant import QuantTensor, kernels_available
from treeserve.runtime.planner import weight_bytes

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C compiler: quantised kernels not built")
IDS = list(range(3, 40))
K_QUANTS = ("Q4_K", "Q6_K", "Q5_K", "Q8_0", "Q4_1", "Q5_1")  # rows of 256: hidden/intermediate 256
WIDE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _logits(llm: LLM) -> torch.Tensor:
    out = llm.score([IDS], ScoreParams(positions=list(range(len(IDS))), return_hidden_states=True))[0]
    return llm.engine.model.compute_logits(out.hidden_states)


def _gguf(tmp_path, arch: str, quants: tuple[str, ...] | None = None, **overrides) -> str:
    hf = build_checkpoint(str(tmp_path / "hf"), "gemma3_text" if arch == "gemma3" else arch, **overrides)
    kwargs = {} if quants is None else {"quants": quants}
    return write_gguf(hf, str(tmp_path / "tiny.gguf"), arch, **kwargs)


@pytest.mark.parametrize(
    "arch,quants,overrides",
    [
        ("llama", None, {}),
        ("gemma3", None, dict(head_dim=16, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16)),
        ("phi3", ("Q8_0", "Q5_0", "Q4_0", "Q5_1"), {}),  # fused qkv and gate_up: split by rows, blocks kept
        ("llama", K_QUANTS, WIDE),
        ("gemma3", K_QUANTS, dict(WIDE, num_hidden_layers=2, sliding_window=8, query_pre_attn_scalar=64)),
    ],
)
def test_gguf_runs_quantised_and_matches_its_dequantised_logits(tmp_path, make_llm, arch, quants, overrides):
    path = _gguf(tmp_path, arch, quants, **overrides)
    quantised, dense = make_llm(path), make_llm(path, dequantize=True)
    assert quantised.engine.quantization.startswith("gguf:") and dense.engine.quantization is None
    model = quantised.engine.model
    assert isinstance(model.layers[0].self_attn.qkv_proj.weight, QuantTensor)
    assert isinstance(model.embed_tokens.weight, QuantTensor)
    if arch == "phi3":  # the file's one fused matrix as its q, k, v parts
        assert len(model.layers[0].self_attn.qkv_proj.weight.parts) == 3
    ours, ref = _logits(quantised), _logits(dense)
    assert weight_bytes(model) < weight_bytes(dense.engine.model) / 2.5  # fp32 vs blocks of <= 8.5 bits
    if model.embed_tokens.weight.plan.q8:
        # 8-bit activations (the kernels' own tests bound each matmul exactly): the activations'
        # rounding moves the logits by a few percent of their norm on these tiny random models,
        # enough to change a near-tied greedy token, so the token-for-token check is the fp32 path's
        assert ((ours - ref).norm() / ref.norm()).item() < 0.05
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
        return
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    a, b = quantised.generate(prompts, params), dense.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_quantised_bf16_seeded_samples_are_batch_invariant(tmp_path, make_llm):
    llm = make_llm(_gguf(tmp_path, "llama", K_QUANTS, **WIDE), dtype="bfloat16")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    batch = llm.generate([[9, 8], [5, 6, 7], list(range(3, 30))], [SamplingParams(max_tokens=10), params, params])
    assert batch[1].outputs[0].token_ids == alone


def test_int8_hf_checkpoint_is_close_to_fp32(tmp_path, make_llm):
    hf = build_checkpoint(str(tmp_path / "hf"), "llama", hidden_size=64, intermediate_size=128)
    int8, dense = make_llm(hf, quantization="int8"), make_llm(hf)
    assert int8.engine.quantization == "int8"
    model = int8.engine.model
    assert model.layers[1].mlp.down_proj.weight.formats == ["I8"]
    ours, ref = _logits(int8), _logits(dense)
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel  # each weight within half a step of 1/127 of its channel's max
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert weight_bytes(model) < weight_bytes(dense.engine.model) / 3  # fp32 -> int8 + a scale a row


def test_quantisation_settings_are_checked_before_loading(tmp_path):
    hf = build_checkpoint(str(tmp_path / "hf"), "llama")
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(hf, quantization="awq")
    with pytest.raises(ValueError, match="for Hugging Face checkpoints"):
        LLM(path, quantization="int8")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        LLM(hf, quantization="gguf")
    with pytest.raises(ValueError, match="quant_activations must be one of"):
        LLM(path, quant_activations="fp8")
    odd = build_checkpoint(str(tmp_path / "odd"), "llama", intermediate_size=100)
    with pytest.raises(ValueError, match="multiples of 32.*intermediate_size"):
        LLM(odd, quantization="int8", dtype="float32")


def test_cli_generate_takes_quantization_flags(tmp_path, capsys):
    from treeserve.cli import main

    hf = build_checkpoint(str(tmp_path / "hf"), "llama")
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama")
    for args in (
        ["--model", hf, "--quantization", "int8"],
        ["--model", path, "--dequantize"],
        ["--model", path, "--quant-activations", "bf16"],
    ):
        assert main(["generate", "def f", *args, "--n", "1", "--max-tokens", "4", "--kv-cache-memory", "8M"]) == 0
    assert main(["generate", "x", "--model", path, "--quantization", "int8"]) != 0
    assert "for Hugging Face checkpoints" in capsys.readouterr().err


def test_eval_runs_both_models_in_int8_and_records_it():
    from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM, EvalSettings, run_eval
    from treeserve.runtime.model_settings import ModelSettings
    from treeserve.runtime.runtime_settings import RuntimeSettings
    from treeserve.search.config import SearchConfig

    settings = EvalSettings(
        dataset="arith:level=1,size=2,seed=0",
        generator=ModelSettings.from_flat(DEFAULT_GENERATOR, quantization="int8"),
        prm=ModelSettings.from_flat(DEFAULT_PRM, quantization="int8"),
        runtime=RuntimeSettings.from_flat(kv_cache_memory=32 << 20),
        progress=False,
    )
    config = SearchConfig(strategy="beam_search", n=4, beam_width=2, num_iterations=2, max_tokens=24)
    results = run_eval(settings, config)  # checks every page is back at the end
    assert results["quantization"] == {"generator": "int8", "prm": "int8"}
    assert [m["quantization"] for m in results["memory"]["models"]] == ["int8", "int8"]
    assert len(results["problems"]) == 2


def _steps_through(llm: LLM, fused: bool) -> list[int]:
    """Count the steps the fused layer stack takes while `fused`; with it off, the per-layer path."""
    model = llm.engine.model
    stack, taken = model.layer_stack, []
    if not fused:
        model.layer_stack = None
        return taken

    def counted(ids, positions, attn, embed):  # noqa: ANN001, ANN202 - the stack's own signature
        ran = stack(ids, positions, attn, embed)
        taken.append(ids.shape[0] if ran is not None else 0)
        return ran

    model.layer_stack = counted
    return taken


# hidden 320: Gemma's embedding scale sqrt(320) is no power of 2, so its bf16 product rounds
GEMMA_STACK = dict(WIDE, hidden_size=320, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=64)


def _stack_llm(tmp_path, make_llm, arch: str, **kwargs) -> LLM:
    """A bf16 LLM of `arch` whose layers the fused stack runs (skips where this CPU builds none):
    "-int8" a Hugging Face checkpoint quantised on load, "-dense" its own bf16 weights as panels,
    "-q8" a GGUF file of Q8_0 only, else a GGUF file of Q8_0, Q5_0 and Q4_0."""
    if arch.endswith("-int8"):  # Qwen2: q/k/v biases, passed to the matmul
        hf = build_checkpoint(str(tmp_path / "hf"), arch.removesuffix("-int8"), **WIDE)
        llm = make_llm(hf, dtype="bfloat16", quantization="int8", **kwargs)
    elif arch.endswith("-dense"):
        hf = build_checkpoint(str(tmp_path / "hf"), arch.removesuffix("-dense"), **WIDE)
        llm = make_llm(hf, dtype="bfloat16", **kwargs)
        if llm.engine.model.layer_stack is None:
            assert not quant_kernels.bf16_panels_available()
            pytest.skip("no dense bf16 panels on this CPU (no AVX512-BF16): the stack is not built")
    else:
        quants = ("Q8_0",) if arch.endswith("-q8") else ("Q8_0", "Q5_0", "Q4_0")
        path = _gguf(tmp_path, arch.removesuffix("-q8"), quants, **(GEMMA_STACK if arch == "gemma3" else WIDE))
        llm = make_llm(path, dtype="bfloat16", **kwargs)
    if llm.engine.model.layer_stack is None:
        assert not quant_kernels.q8_available()
        pytest.skip("no 8-bit kernels on this CPU: the stack is not built")
    return llm


@pytest.mark.parametrize(
    "arch,spec",
    [
        ("gemma3", None),
        ("gemma3", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
        ("llama", None),
        ("llama-q8", None),  # every matrix Q8_0: the stack looks the embedding's rows up too (no scale)
        ("llama-int8", None),
        ("qwen2-int8", None),
        ("llama-dense", None),
        ("qwen2-dense", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    ],
)
def test_fused_layer_stack_gives_the_per_layer_bits(tmp_path, make_llm, arch, spec):
    """Every matmul 8-bit quantised, or dense bf16 panels, bf16: a decode step through all layers
    in one C call (`layers/layer_stack.py`) gives the per-layer path's logprobs to the bit,
    alone, in a batch of sequences at other lengths, and in a speculating sequence's rows; for
    Gemma 3 and the Llama family (Qwen2's biases too), GGUF blocks, int8 of a Hugging Face
    checkpoint and the checkpoint's own bf16 weights (on AMX tiles, or AVX512-BF16 dot products;
    with AMX the table too: the stack then looks its rows up itself)."""
    llm = _stack_llm(tmp_path, make_llm, arch, speculative_config=spec)
    table = llm.engine.model.embed_tokens.weight
    q8_panels = quant_kernels.PANELS + quant_kernels.QTYPES["Q8_0"]
    embeds = isinstance(table, QuantTensor) and table.parts[0].qtype in (q8_panels, quant_kernels.BF16_PANELS)
    assert llm.engine.model.layer_stack.stack.embeds == embeds  # it looks the rows up itself where it can
    assert embeds or arch not in ("gemma3", "llama-q8")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(3, 30)), [9, 8]]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, logprobs=2, ignore_eos=True) for s in (1, 2, 3)]
    runs = {}
    for fused in (True, False):
        taken = _steps_through(llm, fused)
        outs = llm.generate(prompts, params)
        runs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        if fused:
            assert sum(t > 0 for t in taken) >= 5 and max(taken) >= (4 if spec else 3)  # batched (and drafted) rows
    assert runs[True] == runs[False]


@pytest.mark.parametrize("arch", ["gemma3", "llama", "llama-dense"])
def test_layer_stack_takes_prefill_chunks_and_mixed_steps_with_the_per_layer_bits(tmp_path, make_llm, arch):
    """Prefill chunks through the stack (a PRM's scoring step: new tokens over a cached prefix, in
    the prefill kernel's 16-row tiles and across them), and steps mixing decodes with chunks, give
    the per-layer path's hidden states, tokens and logprobs to the bit (Gemma 3: sliding windows
    shorter than the chunks)."""
    if not cpu_kernels.bf16_built():
        pytest.skip("no AVX512-BF16: prefill chunks take SDPA per layer, and the stack does not take them")
    prefix = list(range(3, 40))
    runs, groups = [], []
    for fused in (True, False):
        (tmp_path / str(fused)).mkdir()
        llm = _stack_llm(tmp_path / str(fused), make_llm, arch)
        engine, stack = llm.engine, llm.engine.model.layer_stack
        if fused:

            def recorded(ids, positions, attn, embed, stack=stack):  # noqa: ANN001, ANN202 - the stack's own signature
                pages, ran = attn.stack_pages(), stack(ids, positions, attn, embed)
                if ran is not None:
                    groups.append((pages.decodes is not None, pages.chunks is not None))
                    if pages.decodes is not None and pages.decodes.rows is not None:
                        groups.append("decodes after a chunk")
                return ran

            engine.model.layer_stack = recorded
        else:
            engine.model.layer_stack = None
        outs: dict[str, object] = {}

        def step(engine=engine, outs=outs) -> None:
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out

        engine.add_request("prefix", {"prompt_token_ids": prefix}, ScoreParams(positions=[36], token_ids=[5]))
        step()
        sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=12, logprobs=2, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": prefix + [5, 6]}, sampled)
        step(), step()  # a's chunk over the cached prefix, then its decodes
        chunk = prefix + [(7 * i) % 40 + 3 for i in range(21)]  # 21 new rows: a 16-row tile and a part of one
        scored = ScoreParams(positions=list(range(30, 58)), token_ids=[5, 6], return_hidden_states=True)
        engine.add_request("b", {"prompt_token_ids": chunk}, scored)
        engine.add_request("c", {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3]}, SamplingParams(max_tokens=6, logprobs=1))
        # two cached pages and one new token: a one-row item, in the decode group, after b's chunk
        engine.add_request("d", {"prompt_token_ids": prefix[:32] + [11]}, sampled)
        while engine.has_unfinished_requests():
            step()
        a, b, c, d = (outs[r] for r in "abcd")
        runs.append(
            (
                a.outputs[0].token_ids,
                a.outputs[0].logprobs,
                b.hidden_states.view(torch.int32).tolist(),
                b.logprobs.view(torch.int32).tolist(),
                c.outputs[0].token_ids,
                c.outputs[0].logprobs,
                d.outputs[0].token_ids,
                d.outputs[0].logprobs,
            )
        )
    assert runs[0] == runs[1]
    assert (False, True) in groups and (True, True) in groups and (True, False) in groups  # chunks, mixed, decodes
    assert "decodes after a chunk" in groups


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_bf16_activations_on_tiles_give_the_dequantised_bf16_models_bits(tmp_path, make_llm, arch):
    """`quant_activations="bf16"` on an AMX CPU: the quantised file's weights dequantised into bf16
    tiles per call, so tokens and logprobs are the dequantised bf16 model's, to the bit, through
    the layer stack, in a batch and alone; the file's bytes stay the resident weights."""
    path = _gguf(tmp_path, arch, ("Q8_0", "Q5_0", "Q4_0"), **(GEMMA_STACK if arch == "gemma3" else WIDE))
    tiled = make_llm(path, dtype="bfloat16", quant_activations="bf16")
    dense = make_llm(path, dtype="bfloat16", dequantize=True)
    if not tiled.engine.model.layers[0].mlp.down_proj.weight.plan.tiles:
        pytest.skip("no usable AMX tiles on this CPU: bf16 activations take the bf16 dot-product kernel")
    assert tiled.engine.model.layer_stack is not None and tiled.engine.quantization.endswith(", bf16 activations")
    assert weight_bytes(tiled.engine.model) < weight_bytes(dense.engine.model) / 1.5
    prompts = [[5, 6, 7, 5, 6, 7], list(range(3, 30)), [9, 8]]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, logprobs=2, ignore_eos=True) for s in (1, 2, 3)]
    runs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        for llm in (tiled, dense)
    ]
    assert runs[0] == runs[1]
    alone = tiled.generate([prompts[1]], [params[1]])[0].outputs[0]
    assert (alone.token_ids, alone.logprobs) == runs[0][1]


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "silu"])
def test_activation_table_is_pytorchs_activation(name):
    """The layer stack's table of act(x) for every bf16 x gives what PyTorch's kernel gives on the
    gate half of a fused gate|up output (strided rows of whole vectors), for every finite input."""
    from treeserve.models.llama import ACTIVATIONS

    act = ACTIVATIONS[name]
    table = cpu_kernels.act_table(act)
    gate_up = (torch.randn(37, 2 * 704) * 4).to(torch.bfloat16)
    gate = gate_up[:, :704]  # the view the per-layer path activates
    looked_up = table[gate.contiguous().view(torch.int16).long() & 0xFFFF]
    assert torch.equal(looked_up.view(torch.int16), act(gate).view(torch.int16))
    finite = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = finite[torch.isfinite(finite)]
    assert torch.equal(table[finite.view(torch.int16).long() & 0xFFFF].view(torch.int16), act(finite).view(torch.int16))
