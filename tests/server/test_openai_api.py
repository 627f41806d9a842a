"""The OpenAI routes through the real `openai` client: completions, chat, streaming, n>1,
stop, seeds, logprobs, and `/v1/search` via `client.post`. Greedy outputs must equal the
offline `LLM` on the same checkpoint."""

from __future__ import annotations

import itertools
import json
import re

import httpx
import pytest
from openai import BadRequestError, OpenAI

from tests.server.conftest import API_KEY, MODEL, LiveServer
from treeserve import LLM, SamplingParams
from treeserve.eval.runner import DEFAULT_GENERATOR
from treeserve.server import search_api

QUESTION = "Compute ((12 + 7) * 3) - 15."


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(DEFAULT_GENERATOR, dtype="float32", kv_cache_memory=16 << 20)


@pytest.fixture
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_name_and_the_prm(client: OpenAI) -> None:
    assert [(m.id, m.role) for m in client.models.list().data] == [(MODEL, "generator"), ("arith-prm", "prm")]


def test_greedy_completion_equals_the_offline_engine(client: OpenAI, offline: LLM) -> None:
    prompt = "Compute 3 + 4."
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))


def test_greedy_chat_equals_the_offline_engine(client: OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=200)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert "\\boxed{" in want.text and got.choices[0].finish_reason == "stop"


def test_streamed_text_equals_the_whole_response(client: OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=200)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == "stop" and usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_is_cut_the_same_way_streamed_and_whole(client: OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    kwargs = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 200, "stop": ["\n\n"]}
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True) if c.choices
    )
    assert whole.finish_reason == "stop" and "\n\n" not in whole.message.content and whole.message.content
    assert streamed == whole.message.content


def test_n_completions_with_a_seed_are_reproducible(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": QUESTION, "max_tokens": 30, "temperature": 1.0, "n": 3, "seed": 7}
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    other = client.completions.create(**{**kwargs, "seed": 8})
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]


def test_streamed_n_and_batched_prompts_index_their_choices(client: OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=["Compute 1 + 2.", "Compute 5 * 6."],
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=1,
        stream=True,
    )
    texts: dict[int, str] = {}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    whole = client.completions.create(
        model=MODEL, prompt=["Compute 1 + 2.", "Compute 5 * 6."], max_tokens=8, n=2, temperature=1.0, seed=1
    )
    assert finished == {0, 1, 2, 3}
    assert texts == {c.index: c.text for c in whole.choices}


def test_logprobs(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob for t in content)


def test_search_over_http(client: OpenAI) -> None:
    body = {
        "problem": QUESTION,
        "strategy": "beam_search",
        "n": 4,
        "beam_width": 2,
        "num_iterations": 10,
        "temperature": 0.8,
        "seed": 3,
    }
    out = client.post("/search", body=body, cast_to=object)
    assert out["object"] == "search" and out["strategy"] == "beam_search"
    assert len(out["completions"]) == 4
    for c in out["completions"]:
        assert len(c["step_scores"]) == len(c["steps"]) > 0 and all(0 <= s <= 1 for s in c["step_scores"])
    chosen = out["completions"][out["chosen_index"]]
    assert out["answer"] == chosen["answer"]
    assert out["usage"]["generator_tokens"] >= sum(len(c["text"]) > 0 for c in out["completions"])
    assert out["usage"]["prm_tokens"] >= out["usage"]["prm_unique_tokens"] > 0
    again = client.post("/search", body=body, cast_to=object)  # same seed, same search
    assert [c["text"] for c in again["completions"]] == [c["text"] for c in out["completions"]]
    assert out["usage"]["lookahead_generator_tokens"] == out["usage"]["lookahead_prm_tokens"] == 0
    ahead = client.post("/search", body={**body, "lookahead": 1}, cast_to=object)
    assert ahead["usage"]["lookahead_generator_tokens"] > 0 and ahead["usage"]["lookahead_prm_tokens"] > 0
    assert all(len(c["step_scores"]) == len(c["steps"]) for c in ahead["completions"])  # rollouts are not kept


@pytest.mark.parametrize(
    "strategy, extra",
    [
        ("rebase", {"reward_temperature": 0.3}),
        ("particle_filtering", {"resample_threshold": 0.5}),
        ("mcts", {"exploration": 0.5}),
    ],
)
def test_strategies_beyond_beam_search_over_http(client: OpenAI, strategy: str, extra: dict) -> None:
    body = {"problem": QUESTION, "strategy": strategy, "n": 4, "num_iterations": 8, "seed": 3, **extra}
    out = client.post("/search", body=body, cast_to=object)
    assert out["strategy"] == strategy and out["selection"] == "weighted" and 0 < len(out["completions"]) <= 4
    assert all(len(c["step_scores"]) == len(c["steps"]) > 0 for c in out["completions"])
    again = client.post("/search", body=body, cast_to=object)  # seeded: the same search
    assert [c["text"] for c in again["completions"]] == [c["text"] for c in out["completions"]]
    field = next(iter(extra))
    with pytest.raises(BadRequestError, match=field):
        client.post("/search", body={**body, field: 5.0 if field == "resample_threshold" else -1.0}, cast_to=object)


def test_search_with_step_and_answer_regexes(client: OpenAI) -> None:
    step, answer = r"[^\n]{1,100}", r"The answer is \\boxed\{-?[0-9]+\}\."
    body = {
        "problem": QUESTION,
        "strategy": "beam_search",
        "n": 4,
        "beam_width": 2,
        "num_iterations": 10,
        "seed": 3,
        "step_regex": step,
        "answer_regex": answer,
    }
    out = client.post("/search", body=body, cast_to=object)
    for c in out["completions"]:
        *middle, last = c["steps"]
        assert all(re.fullmatch(step, s) for s in middle) and (re.fullmatch(answer, last) or re.fullmatch(step, last))
    assert any(re.fullmatch(answer, c["steps"][-1]) for c in out["completions"]) and out["answer"]


def test_search_streams_progress_then_the_result(server: LiveServer) -> None:
    body = {
        "problem": QUESTION,
        "strategy": "beam_search",
        "n": 4,
        "beam_width": 2,
        "num_iterations": 10,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.base_url + "/v1/search", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    progress = [json.loads(e) for e in events[:-2]]
    result = json.loads(events[-2])
    assert progress and all(p["object"] == "search.progress" for p in progress)
    assert [p["iteration"] for p in progress] == list(range(len(progress)))
    assert result["object"] == "search" and len(result["completions"]) == 4
    assert result["selection"] == "weighted"  # the rule that picked `answer`, and every rule's pick
    assert set(result["answers_by_rule"]) == {"naive", "weighted", "majority"}
    assert result["answer"] == result["answers_by_rule"]["weighted"]


def test_majority_search_needs_no_prm_and_chat_messages_work(client: OpenAI) -> None:
    body = {"messages": [{"role": "user", "content": QUESTION}], "strategy": "majority", "n": 4, "seed": 0}
    out = client.post("/search", body=body, cast_to=object)
    assert out["selection"] == "majority" and all(c["step_scores"] == [] for c in out["completions"])


def test_a_search_takes_a_plain_prompt_and_stop_strings(client: OpenAI) -> None:
    """`prompt_format` and `stop` (a base generator's): every completion ends at the stop string."""
    body = {"problem": QUESTION, "strategy": "majority", "n": 4, "seed": 0, "max_tokens": 64}
    plain = client.post("/search", body={**body, "prompt_format": "Q: {question}\nA:", "stop": "="}, cast_to=object)
    assert all(c["text"].endswith("=") and c["text"].count("=") == 1 for c in plain["completions"])
    templated = client.post("/search", body=body, cast_to=object)
    assert all(c["text"].count("=") > 1 for c in templated["completions"])


def test_an_adaptive_search_returns_its_stop_and_spent_tokens(client: OpenAI) -> None:
    body = {
        "problem": QUESTION,
        "strategy": "beam_search",
        "n": 8,
        "beam_width": 2,
        "num_iterations": 10,
        "seed": 3,
        "adaptive": True,
        "certainty": 0.5,
        "first_width": 2,
    }
    out = client.post("/search", body=body, cast_to=object)
    stop = out["stop"]
    assert stop["reason"] in ("settled", "exhausted") and stop["iteration"] == len(stop["widths"]) - 1
    assert len(stop["certainty"]) == len(stop["widths"]) and stop["widths"][0] == 2 and max(stop["widths"]) <= 8
    assert (stop["certainty"][-1] >= 0.5) == (stop["reason"] == "settled")
    assert out["spent"] == {
        "generated_tokens": out["usage"]["generator_tokens"],
        "prm_input_tokens": out["usage"]["prm_tokens"],
    }
    fixed = client.post("/search", body={**body, "adaptive": False}, cast_to=object)
    assert fixed["stop"] is None and fixed["spent"]["generated_tokens"] > 0


def test_a_search_budget_narrows_the_search_once_spent(client: OpenAI) -> None:
    """`budget_tokens` a third of what the search spends free: it grows, narrows once past the
    budget, and runs to its end on fewer tokens."""
    body = {
        "problem": QUESTION,
        "strategy": "beam_search",
        "n": 8,
        "beam_width": 2,
        "num_iterations": 10,
        "seed": 3,
        "adaptive": True,
        "certainty": 0.99,
        "first_width": 2,
    }
    free = client.post("/search", body=body, cast_to=object)
    spent = sum(free["spent"].values())
    capped = client.post("/search", body={**body, "budget_tokens": spent // 3}, cast_to=object)
    widths = capped["stop"]["widths"]
    assert max(widths) > 2 and widths != sorted(widths), widths  # grew, then narrowed
    assert capped["stop"]["reason"] in ("settled", "exhausted")
    assert sum(capped["spent"].values()) < spent


def deadline_after_the_first_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that jumps 1000 s at every reading: a search with `deadline_s` 500 (which the
    event loop's timer never reaches in a test) is past it at its first scored iteration."""
    ticks = itertools.count(0.0, 1000.0)
    monkeypatch.setattr(search_api, "clock", lambda: next(ticks))


def test_a_deadline_answers_from_the_first_iteration_and_frees_every_page(
    server: LiveServer, client: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {
        "problem": QUESTION,
        "strategy": "beam_search",
        "n": 4,
        "beam_width": 2,
        "num_iterations": 10,
        "seed": 3,
        "trace": True,
    }
    whole = client.post("/search", body=body, cast_to=object)
    assert max(len(c["steps"]) for c in whole["completions"]) > 1  # the search runs past its first iteration
    deadline_after_the_first_iteration(monkeypatch)
    out = client.post("/search", body={**body, "deadline_s": 500}, cast_to=object)
    assert out["stop"] == {"iteration": 0, "reason": "deadline", "deadline_s": 500}
    trace = out["trace"]
    iteration, text = trace["fields"].index("iteration"), trace["fields"].index("text")
    assert trace["stop"] == out["stop"] and {node[iteration] for node in trace["nodes"]} == {0}
    assert len(out["completions"]) == 4 and all(len(c["steps"]) == 1 for c in out["completions"])
    whole_first = [node[text] for node in whole["trace"]["nodes"] if node[iteration] == 0]
    assert sorted(c["steps"][0] for c in out["completions"]) == sorted(whole_first)  # same seed, same first steps
    assert out["answer"] == out["answers_by_rule"]["weighted"]  # chosen as the whole search's answer is
    scores = [c["score"] for c in out["completions"]]
    assert scores == sorted(scores, reverse=True)  # held beams ranked as beam search returns them
    assert out["spent"]["generated_tokens"] < whole["spent"]["generated_tokens"]
    assert server.idle()
    server.served.runtime.check_pages_idle()


def test_a_streamed_deadline_keeps_the_progress_events(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    deadline_after_the_first_iteration(monkeypatch)
    body = {
        "problem": QUESTION,
        "strategy": "beam_search",
        "n": 4,
        "beam_width": 2,
        "num_iterations": 10,
        "deadline_s": 500,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.base_url + "/v1/search", json=body, headers=headers, timeout=60) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    progress, result = [json.loads(e) for e in events[:-2]], json.loads(events[-2])
    assert [p["iteration"] for p in progress] == [0] and progress[0]["object"] == "search.progress"
    assert result["object"] == "search" and result["stop"]["reason"] == "deadline"
    assert server.idle()
    server.served.runtime.check_pages_idle()


def test_a_deadline_before_any_scored_iteration_is_a_400(server: LiveServer) -> None:
    """Nothing to answer with: refused like any value that leaves no answer (no input gets a 5xx,
    tests/server/test_fuzz.py); the search stopped, its pages freed."""
    body = {"problem": QUESTION, "strategy": "beam_search", "n": 4, "beam_width": 2, "deadline_s": 1e-6}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(server.base_url + "/v1/search", json=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    assert "before the search scored its first iteration" in response.json()["error"]["message"]
    assert server.idle()
    server.served.runtime.check_pages_idle()
