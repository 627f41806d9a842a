"""Prompt logprobs (vLLM's shape) and the logit edits (penalties, logit_bias, min_tokens)
against transformers and hand-written references; edited requests stay batch-invariant."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from treeserve import SamplingParams, ScoreParams

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there"


def hf_model(model_dir: str):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_prompt_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(out, ref: torch.Tensor, k: int) -> None:
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        expected = ref[p - 1]
        assert abs(entry[ids[p]].logprob - expected[ids[p]].item()) <= 1e-4
        assert entry[ids[p]].rank == int((expected > expected[ids[p]]).sum()) + 1
        top = expected.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1
        for rank, tid in enumerate(top, 1):
            assert entry[tid].rank == rank or tid == ids[p]


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_transformers_also_from_the_prefix_cache(llama_dir, make_llm, chunk):
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = make_llm(llama_dir, page_size=4, **kwargs)
    ids = llm.get_tokenizer().encode(PROMPT)
    ref = reference_prompt_logprobs(llama_dir, ids)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, n=2)
    first = llm.generate({"prompt_token_ids": ids}, params)[0]
    check_prompt_logprobs(first, ref, 3)
    again = llm.generate({"prompt_token_ids": ids}, params)[0]  # every block is cached now
    check_prompt_logprobs(again, ref, 3)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0


def test_prompt_logprobs_equal_score(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    ids = llm.get_tokenizer().encode(PROMPT)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    scored = llm.score([ids], ScoreParams(positions=list(range(len(ids) - 1)), token_ids=sorted(set(ids))))[0]
    column = {t: i for i, t in enumerate(sorted(set(ids)))}
    for p in range(1, len(ids)):
        assert out.prompt_logprobs[p][ids[p]].logprob == pytest.approx(
            scored.logprobs[p - 1, column[ids[p]]].item(), abs=1e-5
        )


def test_repetition_penalty_matches_transformers(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    hf = hf_model(llama_dir)
    ids = llm.get_tokenizer().encode(PROMPT)
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    changed = 0
    for penalty in (1.3, 0.7):
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=penalty)
        ours = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False, repetition_penalty=penalty
            )
        assert ours == ref[0, len(ids) :].tolist()
        changed += ours != plain[0].outputs[0].token_ids
    assert changed  # the penalty did something


def openai_greedy(
    model_dir: str, ids: list[int], steps: int, presence: float, frequency: float, bias: dict[int, float]
) -> list[int]:
    """OpenAI's definition, written out: mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]."""
    hf = hf_model(model_dir)
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1].double()
        for j, b in bias.items():
            logits[j] += b
        for j in set(out):
            c = out.count(j)
            logits[j] -= c * frequency + presence
        out.append(int(logits.argmax()))
    return out


def test_presence_frequency_and_bias_match_openais_definition(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    ids = llm.get_tokenizer().encode(PROMPT)
    bias = {5: 3.0, 17: -100.0, 42: 1.5}
    plain = openai_greedy(llama_dir, ids, 12, 0.0, 0.0, {})
    for presence, frequency in ((0.8, 0.0), (0.0, 1.2), (-0.5, 0.6)):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            presence_penalty=presence,
            frequency_penalty=frequency,
            logit_bias=bias,
        )
        ours = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        assert ours == openai_greedy(llama_dir, ids, 12, presence, frequency, bias) != plain


def test_logit_bias_forces_and_bans_tokens(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=6, logit_bias={"9": 100}))[0]
    assert out.outputs[0].token_ids == [9] * 6  # keys as strings, as JSON sends them
    banned = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    first = banned.outputs[0].token_ids[0]
    again = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logit_bias={first: -100}))[0]
    assert again.outputs[0].token_ids[0] != first


def test_min_tokens_blocks_eos_and_stop_ids(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    eos = llm.get_tokenizer().eos_token_ids
    # bias EOS up so that, without min_tokens, it is the first token
    params = dict(temperature=0.0, max_tokens=10, logit_bias={eos[0]: 100.0})
    assert llm.generate(PROMPT, SamplingParams(**params))[0].outputs[0].token_ids == [eos[0]]
    out = llm.generate(PROMPT, SamplingParams(**params, min_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos[0] and out.finish_reason == "stop"
    out = llm.generate(
        PROMPT,
        SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[11], logit_bias={11: 100.0}, min_tokens=3),
    )[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == 11 and 11 not in out.token_ids[:3]


def test_edited_requests_are_batch_invariant(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    edited = SamplingParams(
        temperature=0.9,
        seed=7,
        max_tokens=12,
        n=3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={3: 2.0},
        min_tokens=2,
    )
    alone = llm.generate(PROMPT, edited)[0]
    others = [SamplingParams(temperature=0.7, seed=s, max_tokens=12) for s in range(4)]
    mixed = llm.generate(
        [PROMPT, "Compute 1 + 2.", PROMPT, "x y z", PROMPT], [others[0], others[1], edited, others[2], others[3]]
    )
    assert [c.token_ids for c in mixed[2].outputs] == [c.token_ids for c in alone.outputs]
    plain_alone = llm.generate("Compute 1 + 2.", others[1])[0]
    assert mixed[1].outputs[0].token_ids == plain_alone.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_out_of_vocabulary_bias_is_refused_before_anything_runs(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(PROMPT, SamplingParams(prompt_logprobs=vocab + 1))
    assert not llm.engine.has_unfinished_requests()
    assert math.isfinite(llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0].token_ids[0])
