"""Structured outputs over HTTP (issue 36) through the real `openai` client: OpenAI's
`response_format` (json_schema, json_object), vLLM's `structured_outputs` (regex, choice,
grammar) and its older `guided_*` names, streamed and not; seeded guided requests give the
same text alone and among concurrent requests; bad constraints are a 400 naming the problem.

The models sample at temperature 1.0, so outputs are checked whenever they finish with
"stop" (a "length" finish is a valid prefix), and each test asks for at least one "stop".
"""

from __future__ import annotations

import ast
import json
import re
import threading

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.server.conftest import API_KEY, MODEL, LiveServer

PROMPT = "Compute ((12 + 7) * 3) - 15."
MESSAGES = [{"role": "user", "content": PROMPT}]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"enum": ["apples", "pears"]},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["answer", "unit"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
REGEX = r"[0-9]{1,3}(\.[0-9])? (apples|pears)"
CHOICES = ["yes", "no", "it depends"]
ARITHMETIC = 'start: expr\nexpr: term (("+"|"-") term)*\nterm: NUMBER\nNUMBER: /[0-9]{1,3}/'
SAMPLED = {"model": MODEL, "temperature": 1.0, "max_tokens": 64, "n": 4, "seed": 11}


@pytest.fixture
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def stopped(choices: list) -> list[str]:
    """The texts of the choices that finished with "stop"; at least one must have."""
    texts = [c.message.content if hasattr(c, "message") else c.text for c in choices if c.finish_reason == "stop"]
    assert texts, [c.finish_reason for c in choices]
    return texts


def streamed(stream: object) -> tuple[dict[int, str], dict[int, str]]:
    """Texts and finish reasons by choice index, joined from a chat or completions stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish


def test_json_schema_output_validates(client: OpenAI) -> None:
    got = client.chat.completions.create(messages=MESSAGES, response_format=RESPONSE_FORMAT, **SAMPLED)
    for text in stopped(got.choices):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_streamed_equals_the_whole_response(client: OpenAI) -> None:
    whole = client.chat.completions.create(messages=MESSAGES, response_format=RESPONSE_FORMAT, **SAMPLED)
    stream = client.chat.completions.create(messages=MESSAGES, response_format=RESPONSE_FORMAT, stream=True, **SAMPLED)
    texts, finish = streamed(stream)
    assert [texts[c.index] for c in whole.choices] == [c.message.content for c in whole.choices]
    assert [finish[c.index] for c in whole.choices] == [c.finish_reason for c in whole.choices]
    for i, text in texts.items():
        if finish[i] == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_is_an_object(client: OpenAI) -> None:
    got = client.completions.create(prompt=PROMPT, extra_body={"response_format": {"type": "json_object"}}, **SAMPLED)
    for text in stopped(got.choices):
        assert isinstance(json.loads(text), dict)


def test_text_response_format_is_no_constraint(client: OpenAI) -> None:
    kwargs = {**SAMPLED, "n": 1, "temperature": 0, "max_tokens": 40}
    plain = client.chat.completions.create(messages=MESSAGES, **kwargs)
    text = client.chat.completions.create(messages=MESSAGES, response_format={"type": "text"}, **kwargs)
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_regex_output_fullmatches(client: OpenAI, stream: bool) -> None:
    body = {"structured_outputs": {"regex": REGEX}}
    if stream:
        texts, finish = streamed(client.completions.create(prompt=PROMPT, extra_body=body, stream=True, **SAMPLED))
        outputs = [texts[i] for i in texts if finish[i] == "stop"]
        assert outputs
    else:
        outputs = stopped(client.completions.create(prompt=PROMPT, extra_body=body, **SAMPLED).choices)
    for text in outputs:
        assert re.fullmatch(REGEX, text), text


def test_choice_output_is_a_member(client: OpenAI) -> None:
    body = {"structured_outputs": {"choice": CHOICES}}
    got = client.chat.completions.create(messages=MESSAGES, extra_body=body, **{**SAMPLED, "n": 8})
    assert all(c.finish_reason == "stop" for c in got.choices)
    assert {c.message.content for c in got.choices} <= set(CHOICES)


def test_grammar_output_parses(client: OpenAI) -> None:
    body = {"structured_outputs": {"grammar": ARITHMETIC}}
    got = client.completions.create(prompt=PROMPT, extra_body=body, **SAMPLED)
    for text in stopped(got.choices):
        assert re.fullmatch(r"[0-9]{1,3}([+-][0-9]{1,3})*", text), text
        ast.parse(text, mode="eval")  # and it is an expression Python reads the same way


def test_guided_aliases_are_vllms_older_names(client: OpenAI) -> None:
    got = client.completions.create(prompt=PROMPT, extra_body={"guided_regex": REGEX}, **SAMPLED)
    for text in stopped(got.choices):
        assert re.fullmatch(REGEX, text), text
    got = client.completions.create(prompt=PROMPT, extra_body={"guided_choice": CHOICES}, **SAMPLED)
    assert {c.text for c in got.choices} <= set(CHOICES)
    body = {"guided_json": SCHEMA}
    for text in stopped(client.completions.create(prompt=PROMPT, extra_body=body, **SAMPLED).choices):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_seeded_guided_request_is_the_same_alone_and_among_others(client: OpenAI) -> None:
    def guided() -> list[str]:
        got = client.chat.completions.create(messages=MESSAGES, response_format=RESPONSE_FORMAT, **SAMPLED)
        return [c.message.content for c in got.choices]

    others = [
        {"extra_body": {"structured_outputs": {"regex": REGEX}}},
        {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
        {},
        {"extra_body": {"response_format": {"type": "json_object"}}},
        {"extra_body": {"structured_outputs": {"grammar": ARITHMETIC}}},
        {},
    ]
    alone = guided()
    results: dict[int, list[str]] = {}

    def run(i: int) -> None:
        if i == len(others):
            results[i] = guided()
        else:
            kwargs = {**SAMPLED, "seed": i, "max_tokens": 48, **others[i]}
            results[i] = [c.text for c in client.completions.create(prompt=f"Compute {i} + 2.", **kwargs).choices]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(others) + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(others) + 1
    assert results[len(others)] == alone


BAD_CONSTRAINTS = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
        "json schema",
    ),
    ({"structured_outputs": {"regex": "("}}, "unclosed group"),  # the parser's own words
    ({"structured_outputs": {"grammar": "start: foo("}}, "grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a{500}"}, "max_tokens": 5}, "max_tokens=5"),
    ({"structured_outputs": {"choice": ["x" * 200, "y" * 300]}, "max_tokens": 5}, "max_tokens=5"),
    ({"structured_outputs": {"regex": "[^\\x00-\\U0010ffff]"}}, "no output satisfies"),  # an empty language
    ({"structured_outputs": {"grammar": "start: a\na: b\nb: a"}}, "no output satisfies"),  # no finite derivation
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "two constraints at once"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "two constraints at once"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "two constraints at once"),
    ({"structured_outputs": {"json_object": True}, "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize(("extra", "named"), BAD_CONSTRAINTS)
def test_bad_constraint_is_a_400_naming_the_problem(server: LiveServer, extra: dict, named: str) -> None:
    before = server.served.runtime.engine("generator").num_generated_tokens
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        response = httpx.post(server.base_url + path, json={**body, **extra}, headers=headers, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == 400 and error["type"] == "invalid_request_error"
        assert named in error["message"], error["message"]
    assert server.served.runtime.engine("generator").num_generated_tokens == before  # nothing was queued


def test_server_is_healthy_after_bad_constraints(client: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="two constraints at once"):
        client.chat.completions.create(
            messages=MESSAGES,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"regex": "a"}},
            **SAMPLED,
        )
    got = client.chat.completions.create(
        messages=MESSAGES, extra_body={"structured_outputs": {"choice": CHOICES}}, **SAMPLED
    )
    assert {c.message.content for c in got.choices} <= set(CHOICES)


def post(server: LiveServer, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(server.base_url + "/v1/completions", json={"prompt": PROMPT, **body}, headers=headers, timeout=60)


def test_empty_schema_means_any_json(server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "any", "schema": {}}}
    assert post(server, {"response_format": fmt}).status_code == 200
