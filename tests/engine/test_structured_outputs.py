"""Structured outputs offline: JSON schemas, regexes, choices and grammars on random-weight models.

Random weights at T=1.0 are the hardest case for a constraint (the model knows nothing of
JSON): whatever finishes with "stop" must be valid, everything else must be a "length" cut
of a valid prefix. Guided requests must stay batch-invariant, survive preemption, and bad
constraints must fail before anything is queued.
"""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.test_preemption import PROMPTS
from tests.tiny_models import build_checkpoint, save_tokenizer, train_tokenizer
from treeserve import SamplingParams, StructuredOutputsParams
from treeserve.models.tokenizer import Tokenizer

SCHEMAS_PER_EXAMPLE = 20
EXAMPLES = 10  # 200 schemas in all
COUNTS = {"schemas": 0, "stop": 0, "length": 0}

PATTERNS = ["^[a-z]{1,6}$", "^[A-Z][a-z]{0,4}$", "^[0-9]{2,4}$", "^(yes|no)$", "^x{1,5}$"]


def _leaf() -> st.SearchStrategy[dict]:
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    number = st.tuples(st.integers(-20, 20), st.integers(1, 40)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    string = st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n})
    pattern = st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p})
    enum = st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    )
    return st.one_of(integer, number, string, pattern, enum, st.just({"type": "boolean"}), st.just({"type": "null"}))


def _object(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    names = st.lists(st.text("abcdefgh", min_size=1, max_size=5), min_size=1, max_size=4, unique=True)

    def build(args: tuple[list[str], list[dict], list[bool]]) -> dict:
        keys, values, required = args
        props = dict(zip(keys, values, strict=False))
        return {
            "type": "object",
            "properties": props,
            "required": [k for k, r in zip(props, required, strict=False) if r],
            "additionalProperties": False,
        }

    return st.tuples(
        names, st.lists(children, min_size=4, max_size=4), st.lists(st.booleans(), min_size=4, max_size=4)
    ).map(build)


def _array(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(children, st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": min(t[1], 1), "maxItems": t[1]}
    )


SCHEMAS = st.recursive(_leaf(), lambda children: st.one_of(_object(children), _array(children)), max_leaves=6).map(
    lambda s: (
        s
        if s.get("type") == "object"
        else {"type": "object", "properties": {"v": s}, "required": ["v"], "additionalProperties": False}
    )
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from treeserve import LLM

    llm = LLM(
        build_checkpoint(str(tmp_path_factory.mktemp("guided")), "llama"), dtype="float32", kv_cache_memory=32 << 20
    )
    yield llm
    llm.engine.check_pages_idle()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(SCHEMAS, min_size=SCHEMAS_PER_EXAMPLE, max_size=SCHEMAS_PER_EXAMPLE), st.integers(0, 2**31))
def test_json_schemas_are_honoured(llm, schemas, seed):
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=160, seed=seed + i, structured_outputs=StructuredOutputsParams(json=s)
        )
        for i, s in enumerate(schemas)
    ]
    outs = llm.generate(["Answer in JSON:"] * len(schemas), params)
    for schema, out in zip(schemas, outs, strict=True):
        c = out.outputs[0]
        COUNTS["schemas"] += 1
        COUNTS[c.finish_reason] += 1
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 160


def test_most_schema_outputs_finish():
    """The property test is not vacuous: most outputs end with "stop" and were validated."""
    if COUNTS["schemas"] < SCHEMAS_PER_EXAMPLE * EXAMPLES:
        pytest.skip("runs after test_json_schemas_are_honoured")
    print(f"\nJSON schemas: {COUNTS}")
    assert COUNTS["stop"] >= 0.8 * COUNTS["schemas"], COUNTS


REGEXES = [
    r"[0-9]{3}-[a-z]{2,4}",
    r"(ab|cd)+!",
    r"\\boxed\{-?[0-9]{1,4}\}",
    r"[A-Z][a-z]{0,6} (is|was) [a-z]{1,8}\.",
    r"0x[0-9a-f]{2,8}",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_fullmatch(llm, regex):
    so = StructuredOutputsParams(regex=regex)
    outs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=48, seed=5, structured_outputs=so))
    finished = [c for out in outs for c in out.outputs if c.finish_reason == "stop"]
    assert len(finished) >= len(PROMPTS)  # most of the 18 finish
    for c in finished:
        assert re.fullmatch(regex, c.text), (regex, c.text)


def test_choices_are_members(llm):
    choices = ["red", "green", "blue violet", "0.5", "{}"]
    so = StructuredOutputsParams(choice=choices)
    outs = llm.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=2, structured_outputs=so))
    texts = [c.text for out in outs for c in out.outputs]
    assert all(t in choices for t in texts) and len(set(texts)) > 1


ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""
ARITHMETIC_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]? | "(" expr ")"
"""


@pytest.mark.parametrize("grammar", [ARITHMETIC, ARITHMETIC_GBNF], ids=["lark", "gbnf"])
def test_grammar_outputs_parse(llm, grammar):
    so = StructuredOutputsParams(grammar=grammar)
    outs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=64, seed=9, structured_outputs=so))
    finished = [c.text for out in outs for c in out.outputs if c.finish_reason == "stop"]
    assert len(finished) >= len(PROMPTS)
    for text in finished:
        tree = ast.parse(text, mode="eval")  # an arithmetic expression of numbers, + - * / and parentheses
        assert all(isinstance(n, ast.Expression | ast.BinOp | ast.Constant | ast.operator) for n in ast.walk(tree)), (
            text
        )


def test_length_cut_is_a_valid_prefix(llm):
    so = StructuredOutputsParams(regex=r"(abc)+\.")
    out = llm.generate(["x"], SamplingParams(temperature=1.0, max_tokens=3, seed=0, structured_outputs=so))[0].outputs[
        0
    ]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert re.fullmatch(r"(abc)*(a|ab)?", out.text), out.text  # a prefix of a match, not a match


def test_seeded_guided_requests_are_batch_invariant(llm):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
        "required": ["n", "s"],
    }
    guided = [
        SamplingParams(temperature=1.0, max_tokens=40, seed=100 + i, structured_outputs=so)
        for i, so in enumerate(
            [
                StructuredOutputsParams(json=schema),
                StructuredOutputsParams(regex=r"[a-z]{2,9}!"),
                StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
                StructuredOutputsParams(grammar=ARITHMETIC),
            ]
        )
    ]
    alone = [llm.generate(["Hello there"], p)[0].outputs[0].token_ids for p in guided]
    plain = SamplingParams(temperature=1.0, max_tokens=40, seed=7)
    batch = [guided[i % 4] if i % 2 == 0 else plain for i in range(32)]
    prompts = ["Hello there" if i % 2 == 0 else PROMPTS[i % len(PROMPTS)] for i in range(32)]
    mixed = llm.generate(prompts, batch)
    for i in range(0, 32, 2):
        assert mixed[i].outputs[0].token_ids == alone[guided.index(batch[i])]


def test_guided_requests_survive_preemption(llama_dir, make_llm):
    so = StructuredOutputsParams(regex=r"([a-z]{3,8} ){4,12}[a-z]+\.")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=60, seed=4, structured_outputs=so)
    big = make_llm(llama_dir)
    page = 2 * 2 * 4 * 2 * 16 * 4  # as in test_preemption
    small = make_llm(llama_dir, page_size=4, kv_cache_memory=24 * page, max_model_len=80)

    def run(llm):  # noqa: ANN001
        return [[(c.token_ids, c.finish_reason) for c in out.outputs] for out in llm.generate(PROMPTS, params)]

    assert run(small) == run(big)
    assert small.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "constraint, max_tokens, message",
    [
        (dict(json={"type": "nonsense"}), 16, "invalid structured_outputs json schema"),
        (dict(json="{not json"), 16, "not valid JSON"),
        (dict(regex="(unclosed"), 16, "invalid structured_outputs regex"),
        (dict(grammar="start: undefined_rule"), 16, "invalid structured_outputs grammar"),
        (dict(regex="a{500}"), 5, "shortest output the constraint accepts is 500 bytes"),
        (dict(choice=["x" * 300]), 4, "shortest output"),
        (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), 16, "minimum .5. is greater than maximum"),
        (dict(regex=r"[^\s\S]"), 16, "no output satisfies this constraint"),
    ],
)
def test_bad_constraints_fail_before_queueing(llm, constraint, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(
            ["x"], SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**constraint))
        )
    assert not llm.engine.requests
    llm.engine.check_pages_idle()


def test_text_the_vocabulary_cannot_spell_is_refused_not_crashed():
    """The word-level arithmetic vocabulary has no token for U+001F: its encoder would give the
    special <|unk|>, which a constraint never allows, so the constraint has no output."""
    from treeserve import LLM

    llm = LLM("treeserve/assets/arith-generator", dtype="float32", kv_cache_memory=8 << 20)
    for regex in ["\x1f", "«"]:
        with pytest.raises(ValueError, match="no output satisfies"):
            llm.generate(["hi"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=regex)))
    out = llm.generate(
        ["hi"], SamplingParams(max_tokens=8, seed=0, structured_outputs=StructuredOutputsParams(regex="a\x1f"))
    )
    assert (out[0].outputs[0].text, out[0].outputs[0].finish_reason) == ("a", "abort")  # a dead end ends it alone
    llm.engine.check_pages_idle()


def test_empty_schema_means_any_json(llm):
    so = StructuredOutputsParams(json={})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=48, seed=3, structured_outputs=so))
    for c in (o.outputs[0] for o in outs):
        if c.finish_reason == "stop":
            json.loads(c.text)


def test_two_constraints_and_ignore_eos_are_refused():
    with pytest.raises(ValueError, match=r"exactly one of .* got 2 \(regex, choice\)"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))


def test_token_bytes_spell_the_text(tmp_path):
    """Every tokenizer kind gives llguidance the bytes its tokens decode to."""
    save_tokenizer(train_tokenizer(), str(tmp_path))
    text = 'Hello world, {"a": [1, 2.5e3]}\n\n\\boxed{42} café'
    for tok in (Tokenizer(str(tmp_path)), Tokenizer("treeserve/assets/arith-generator")):
        tokens, specials = tok.token_bytes()
        ids = tok.encode(text, add_special_tokens=False)
        spelled = b"".join(tokens[i] for i in ids)
        if tok.encode("é", add_special_tokens=False)[0] in specials:  # the word-level vocabulary has no é
            text_bytes = text.replace("é", "").encode()
        else:
            text_bytes = text.encode()
        assert spelled == text_bytes
        assert all(tokens[i] == b"" for i in specials)
