"""The request fields evaluation harnesses send: echo with logprobs (lm-evaluation-harness's
log-likelihood requests), max_tokens=0, prompt_logprobs, penalties and logit_bias, each
compared with the offline engine on the same checkpoint (fp32)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY, LiveServer
from treeserve import LLM, SamplingParams, ScoreParams
from treeserve.eval.runner import DEFAULT_GENERATOR

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = "Compute (3 + 4) * 5.\n\nStep 1: 3 + 4 ="
CHOICES = [" 7", " 8", " 12"]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(DEFAULT_GENERATOR, dtype="float32", kv_cache_memory=16 << 20)


def post(server: LiveServer, body: dict, path: str = "/v1/completions") -> dict:
    response = httpx.post(server.base_url + path, json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def loglikelihood(offline: LLM, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    positions = list(range(len(context) - 1, len(ids) - 1))
    out = offline.score([ids], ScoreParams(positions=positions, token_ids=sorted(set(continuation))))[0]
    column = {t: i for i, t in enumerate(sorted(set(continuation)))}
    return sum(out.logprobs[i, column[t]].item() for i, t in enumerate(continuation))


def test_harness_loglikelihood_requests_equal_offline_score(server: LiveServer, offline: LLM) -> None:
    """What lm-eval's local-completions sends for multiple choice: token-id prompts (context +
    continuation), echo, logprobs=1, max_tokens=1, temperature 0; it sums token_logprobs[ctxlen:-1]."""
    encode = offline.get_tokenizer().encode
    context = encode(CONTEXT)
    prompts = [context + encode(c, add_special_tokens=False) for c in CHOICES]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    out = post(server, body)
    for choice, prompt in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(lp["text_offset"]) == len(prompt) + 1
        ours = sum(lp["token_logprobs"][len(context) : -1])
        assert ours == pytest.approx(loglikelihood(offline, context, prompt[len(context) :]), abs=1e-4)
        for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert len(top) == 1 and max(top.values()) >= token_lp - 1e-6  # the harness's is_greedy check
        assert choice["text"].startswith(offline.get_tokenizer().decode(prompt, False))


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(server: LiveServer, offline: LLM) -> None:
    out = post(server, {"prompt": CONTEXT, "echo": True, "logprobs": 2, "max_tokens": 0})
    choice = out["choices"][0]
    n = len(offline.get_tokenizer().encode(CONTEXT))
    assert choice["text"] == CONTEXT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == n and out["usage"]["completion_tokens"] == 0
    assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"][1:])
    streamed = httpx.post(
        server.base_url + "/v1/completions",
        headers=AUTH,
        timeout=60,
        json={"prompt": CONTEXT, "echo": True, "max_tokens": 0, "stream": True},
    )
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == CONTEXT


def test_echo_streamed_equals_echo_whole(server: LiveServer) -> None:
    body = {"prompt": CONTEXT, "echo": True, "logprobs": 1, "max_tokens": 8, "temperature": 0}
    whole = post(server, body)["choices"][0]
    streamed = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=60, json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert sum((c["logprobs"]["token_logprobs"] for c in choices), []) == whole["logprobs"]["token_logprobs"]
    assert whole["text"].startswith(CONTEXT) and len(whole["text"]) > len(CONTEXT)


def test_streamed_n_with_prompt_logprobs_and_a_stop_string_equals_whole(server: LiveServer) -> None:
    """The core streams deltas: each choice's first chunk still has the prompt's logprobs, and
    the chunks put together give the whole response's text, logprobs and text offsets."""
    body = {
        "prompt": CONTEXT,
        "n": 2,
        "seed": 3,
        "temperature": 1.0,
        "max_tokens": 16,
        "logprobs": 1,
        "prompt_logprobs": 1,
        "stop": [" 3"],
    }
    whole = {c["index"]: c for c in post(server, body)["choices"]}
    streamed = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=60, json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    got: dict[int, dict] = {}
    for choice in (c for chunk in chunks for c in chunk["choices"]):
        i = choice["index"]
        if i not in got:
            assert choice["prompt_logprobs"] == whole[i]["prompt_logprobs"] is not None
            got[i] = {"text": "", "offsets": [], "logprobs": []}
        got[i]["text"] += choice["text"]
        got[i]["offsets"] += choice["logprobs"]["text_offset"]
        got[i]["logprobs"] += choice["logprobs"]["token_logprobs"]
        got[i]["finish"] = choice["finish_reason"]
    assert sorted(got) == [0, 1]
    for i, c in whole.items():
        assert got[i]["text"] == c["text"] and got[i]["finish"] == c["finish_reason"]
        assert got[i]["logprobs"] == c["logprobs"]["token_logprobs"]
        assert got[i]["offsets"] == c["logprobs"]["text_offset"]


def test_prompt_logprobs_extra_on_both_endpoints(server: LiveServer, offline: LLM) -> None:
    out = post(server, {"prompt": CONTEXT, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0})
    want = offline.generate(CONTEXT, SamplingParams(prompt_logprobs=2, max_tokens=2, temperature=0))[0]
    got = out["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for entry, ref, token in zip(got[1:], want.prompt_logprobs[1:], want.prompt_token_ids[1:], strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(ref[token].logprob, abs=1e-5)
        assert {int(t) for t in entry} == set(ref)
    chat = post(
        server,
        {"messages": [{"role": "user", "content": "Compute 1 + 2."}], "prompt_logprobs": 0, "max_tokens": 2},
        "/v1/chat/completions",
    )
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.0, "presence_penalty": -0.5},
        {"repetition_penalty": 1.4},
        {"logit_bias": {"7": 5.0, "9": -100}},
        {"min_tokens": 6},  # with EOS biased up: without min_tokens it would be the first token
    ],
)
def test_penalties_and_bias_over_http_equal_offline(server: LiveServer, offline: LLM, fields: dict) -> None:
    if "min_tokens" in fields:
        fields = {**fields, "logit_bias": {str(offline.get_tokenizer().eos_token_ids[0]): 100}}
    body = {"prompt": CONTEXT, "max_tokens": 40, "temperature": 0.8, "seed": 5, **fields}
    got = post(server, body)["choices"][0]["text"]
    want = offline.generate(CONTEXT, SamplingParams(temperature=0.8, seed=5, max_tokens=40, **fields))[0]
    plain = offline.generate(CONTEXT, SamplingParams(temperature=0.8, seed=5, max_tokens=40))[0]
    assert got == want.outputs[0].text != plain.outputs[0].text
