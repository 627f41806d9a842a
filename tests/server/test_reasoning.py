"""Reasoning parsers (`--reasoning-parser deepseek_r1|qwen3`): `reasoning_content` beside `content`.

The parsers on whole texts (vLLM's conventions, as `server/reasoning.py` states them) and on
streams split at every point (the deltas joined are the whole parse); a parser on a model without
think tokens, or whose think tokens decoding drops, refused at start-up; and over HTTP, through
the `openai` client, on a live server over the tiny reasoning model of
`tests/engine/thinking_model.py`: chat completions' `message.reasoning_content`, streams'
`delta.reasoning_content` chunks before `delta.content`, the thinking budget
(`max_thinking_tokens`) in the request body, and its bad values a 400.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from openai import BadRequestError, OpenAI

from tests.engine.thinking_model import build_thinking_dir
from tests.server.conftest import LiveServer, start_server
from treeserve import LLM, SamplingParams
from treeserve.cli import REASONING_PARSERS
from treeserve.eval.runner import DEFAULT_GENERATOR
from treeserve.models.tokenizer import Tokenizer
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.server.launch import build_core_served
from treeserve.server.reasoning import PARSERS, Parsed, ReasoningParser
from treeserve.server.settings import ServerSettings, build_served

R1, QWEN3 = ReasoningParser("deepseek_r1"), ReasoningParser("qwen3")
MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "Compute 1 + 2."}]

WHOLE = [  # (text, deepseek_r1's parse, qwen3's parse)
    ("plan</think>answer", Parsed("plan", "answer"), Parsed(None, "plan</think>answer")),
    ("<think>plan</think>answer", Parsed("plan", "answer"), Parsed("plan", "answer")),
    ("<think>plan</think>", Parsed("plan", None), Parsed("plan", None)),
    ("still thinking", Parsed("still thinking", None), Parsed(None, "still thinking")),
    ("<think>cut short", Parsed("cut short", None), Parsed("cut short", None)),
    ("pre<think>plan</think>post", Parsed("preplan", "post"), Parsed("plan", "prepost")),
    ("a</think>b</think>c<think>d", Parsed("a", "b</think>c<think>d"), Parsed("d", "a</think>b</think>c")),
    ("<think>a<think>b</think>c", Parsed("a<think>b", "c"), Parsed("a<think>b", "c")),
    ("</think>", Parsed("", None), Parsed(None, "</think>")),
    ("", Parsed("", None), Parsed(None, "")),
    ("x</thin", Parsed("x</thin", None), Parsed(None, "x</thin")),  # a tag's start that never ends
    ("<<think>>a<</think>>", Parsed("<>a<", ">"), Parsed(">a<", "<>")),
]


@pytest.mark.parametrize("text, r1, qwen3", WHOLE)
def test_whole_texts(text: str, r1: Parsed, qwen3: Parsed) -> None:
    assert R1.parse(text) == r1
    assert QWEN3.parse(text) == qwen3


def feed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    stream = parser.stream()
    deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=PARSERS)
@pytest.mark.parametrize("text", [w[0] for w in WHOLE] + ["🙂<think>é</think>\n\nok 日本"])
def test_a_stream_split_anywhere_joins_to_the_whole_parse(parser: ReasoningParser, text: str) -> None:
    whole = parser.parse(text)
    want = (whole.reasoning or "", whole.content or "")
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]  # every one-cut split
    splits += [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(len(text) + 1), 2)]
    splits.append(list(text) + [""])  # a character a delta, then an empty last delta
    for pieces in splits:
        reasoning, content, deltas = feed(parser, pieces)
        assert (reasoning, content) == want, pieces
        if parser is R1:  # once content comes, no reasoning follows
            first = next((i for i, (_, c) in enumerate(deltas) if c), len(deltas))
            assert not any(r for r, _ in deltas[first + 1 :]), pieces
        stream = parser.stream()
        for i, p in enumerate(pieces):
            stream.feed(p, final=i == len(pieces) - 1)
        assert stream.parsed() == whole


def test_deepseek_r1_streams_reasoning_before_content() -> None:
    _, _, deltas = feed(R1, ["thinking ", "more </th", "ink>the ", "answer"])
    assert deltas == [("thinking ", ""), ("more ", ""), ("", "the "), ("", "answer")]  # "</th" held back


def test_unknown_names_and_models_without_think_tokens_are_refused(tmp_path) -> None:
    assert list(PARSERS) == REASONING_PARSERS  # the CLI's choices
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; choose one of deepseek_r1, qwen3"):
        ServerSettings(ModelSettings(DEFAULT_GENERATOR), reasoning_parser="r2").check()
    plain = ServerSettings(ModelSettings(DEFAULT_GENERATOR), reasoning_parser="deepseek_r1")
    message = "--reasoning-parser deepseek_r1: the model's tokenizer has no <think> and </think> tokens"
    for build in (build_served, build_core_served):  # in-process and engine-core servers, before anything loads
        with pytest.raises(ValueError, match=message):
            build(plain)
    special = build_thinking_dir(str(tmp_path / "special"), special=True)
    with pytest.raises(ValueError, match="are special tokens, which decoded text leaves out"):
        ReasoningParser.for_tokenizer("qwen3", Tokenizer(special))


# ---- over HTTP -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory) -> str:
    return build_thinking_dir(str(tmp_path_factory.mktemp("thinking")))


def reasoning_server(model_dir: str, parser: str) -> LiveServer:
    settings = ServerSettings(
        ModelSettings(model_dir),
        served_model_name=MODEL,
        reasoning_parser=parser,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=16 << 20),
    )
    return start_server(settings)


@pytest.fixture(scope="module")
def r1_server(thinking_dir: str) -> Iterator[LiveServer]:
    server = reasoning_server(thinking_dir, "deepseek_r1")
    yield server
    server.stop()


@pytest.fixture
def client(r1_server: LiveServer) -> Iterator[OpenAI]:
    yield OpenAI(base_url=r1_server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    r1_server.check_baseline()


@pytest.fixture(scope="module")
def offline(thinking_dir: str) -> LLM:
    return LLM(thinking_dir, dtype="float32", kv_cache_memory=8 << 20)


def offline_outputs(offline: LLM, n: int, budget: int | None) -> list:
    """The offline engine's completions of the request `chat` sends."""
    params = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=24, max_thinking_tokens=budget)
    return offline.chat(MESSAGES, params)[0].outputs


def chat(client: OpenAI, n: int, budget: int | None, **kw) -> object:
    extra = {"max_thinking_tokens": budget} if budget is not None else {}
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=n, temperature=1.0, seed=7, max_tokens=24, extra_body=extra, **kw
    )


@pytest.mark.parametrize("budget", [None, 0, 4])
def test_chat_returns_reasoning_content_and_content(client: OpenAI, offline: LLM, budget: int | None) -> None:
    response = chat(client, 3, budget)
    outputs = offline_outputs(offline, 3, budget)
    end = offline.engine.think.end
    closed = 0
    for choice, out in zip(sorted(response.choices, key=lambda c: c.index), outputs, strict=True):
        message, text = choice.message, out.text
        assert (message.reasoning_content, message.content) == (R1.parse(text).reasoning, R1.parse(text).content)
        if "</think>" in text and "<think>" not in text.split("</think>")[0]:
            closed += 1
            assert message.reasoning_content == text.split("</think>")[0]  # the think block in the prompt: all before
            assert (message.content or "") == text.split("</think>", 1)[1]
    if budget is not None:
        assert closed == 3  # the budget closed every block (the random model rarely writes <think>)
        assert all(out.token_ids.index(end) <= budget for out in outputs)
    if budget == 0:
        assert all(c.message.reasoning_content == "" for c in response.choices)


@pytest.mark.parametrize("budget", [None, 2])
def test_streams_send_reasoning_then_content(client: OpenAI, budget: int | None) -> None:
    whole = {c.index: c.message for c in chat(client, 2, budget).choices}
    reasoning: dict[int, list[str]] = {0: [], 1: []}
    content: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chat(client, 2, budget, stream=True):
        for c in chunk.choices:
            r = getattr(c.delta, "reasoning_content", None)
            if r:
                assert not content[c.index], "reasoning after content"
                reasoning[c.index].append(r)
            if c.delta.content:
                content[c.index].append(c.delta.content)
    for i, message in whole.items():
        assert "".join(reasoning[i]) == (message.reasoning_content or "")
        assert "".join(content[i]) == (message.content or "")
    if budget is not None:
        assert all(content.values()) and all(reasoning.values())


def test_completions_are_not_parsed(client: OpenAI, offline: LLM) -> None:
    prompt = "Compute 1 + 2."
    response = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=3, max_tokens=12)
    (out,) = offline.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=12))
    assert response.choices[0].text == out.outputs[0].text
    assert not hasattr(response.choices[0], "reasoning_content")


def test_bad_budgets_are_a_400(client: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="max_thinking_tokens"):
        chat(client, 1, -1)
    with pytest.raises(BadRequestError, match="cannot be combined with structured_outputs"):
        chat(client, 1, 3, response_format={"type": "json_object"})


def test_a_budget_on_a_model_without_think_tokens_is_a_400(server: LiveServer) -> None:
    arith = OpenAI(base_url=server.base_url + "/v1", api_key="test-key", max_retries=0, timeout=60)
    with pytest.raises(BadRequestError, match="max_thinking_tokens needs a model whose tokenizer has <think>"):
        arith.chat.completions.create(
            model="arith", messages=MESSAGES, max_tokens=4, extra_body={"max_thinking_tokens": 2}
        )


def test_qwen3_needs_think_in_the_output(thinking_dir: str, offline: LLM) -> None:
    server = reasoning_server(thinking_dir, "qwen3")  # the template opens the block in the prompt: no <think> out
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        (choice,) = chat(client, 1, 3).choices
        text = offline_outputs(offline, 1, 3)[0].text
        assert "</think>" in text and "<think>" not in text
        assert (choice.message.reasoning_content, choice.message.content) == (None, text)
        server.check_baseline()
    finally:
        server.stop()
