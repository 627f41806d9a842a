"""The vLLM-shaped offline API: generate / chat / score shapes and fields."""

from __future__ import annotations

import torch

from treeserve import LLM, RequestOutput, SamplingParams, ScoreParams


def test_generate_fields_and_order(llama_dir, make_llm):
    llm: LLM = make_llm(llama_dir)
    prompts = ["prompt a", "prompt b is longer than a", {"prompt_token_ids": [0, 10, 20]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, n=4, seed=7))
    assert [o.prompt for o in outs] == ["prompt a", "prompt b is longer than a", None]
    assert outs[2].prompt_token_ids == [0, 10, 20]
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            assert 1 <= len(c.token_ids) <= 12
            assert c.cumulative_logprob is None and c.logprobs is None


def test_single_prompt_and_default_params(llama_dir, make_llm):
    out = make_llm(llama_dir).generate("hello")
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) <= 16


def test_chat_equals_generate_on_rendered_prompt(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    messages = [{"role": "user", "content": "Compute 2 + 3."}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    chat = llm.chat(messages, params)[0]
    text = llm.get_tokenizer().apply_chat_template(messages)
    assert text.endswith("<|assistant|>\n")
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    two = llm.chat([messages, messages], params)
    assert len(two) == 2 and two[0].outputs[0].token_ids == two[1].outputs[0].token_ids


def test_score_reads_candidates_at_positions(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog")
    out = llm.score([ids, ids[:5]], ScoreParams(positions=[2, 4], token_ids=[7, 9]))
    assert out[0].logprobs.shape == (2, 2) and out[0].hidden_states is None
    torch.testing.assert_close(out[0].logprobs, out[1].logprobs)
    assert bool((out[0].logprobs < 0).all())
