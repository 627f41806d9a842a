"""Stop rules: strings spanning tokens, k-th occurrence, include_stop_str_in_output, EOS, length."""

from __future__ import annotations

import pytest

from tests.tiny_models import train_tokenizer
from treeserve import SamplingParams
from treeserve.engine.detokenizer import StopChecker

TEXT = "Step one: 12 + 7 = 19.\n\nStep two: 19 * 3 = 57.\n\nThe answer is 57.\n\nExtra text"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def feed(tok, text: str, params: SamplingParams, eos: list[int] | None = None):
    ids = tok.encode(text, add_special_tokens=False).ids
    checker = StopChecker(tok, [0], params, eos or [])
    for n, token in enumerate(ids, 1):
        result = checker.append(token)
        if result:
            return checker.text, result, n
    return checker.text, None, len(ids)


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("19 * 3", add_special_tokens=False).ids
    assert len(ids) > 1  # the stop string is several tokens long
    text, result, _ = feed(tok, TEXT, SamplingParams(stop=["19 * 3"], max_tokens=None))
    assert result == ("stop", "19 * 3")
    assert text == "Step one: 12 + 7 = 19.\n\nStep two: "


def test_include_stop_str(tok):
    params = SamplingParams(stop=["\n\n"], include_stop_str_in_output=True, max_tokens=None)
    text, result, _ = feed(tok, TEXT, params)
    assert text == "Step one: 12 + 7 = 19.\n\n" and result == ("stop", "\n\n")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_kth_occurrence(tok, k):
    text, result, _ = feed(tok, TEXT, SamplingParams(stop=["\n\n"], n_stop_occurrences=k, max_tokens=None))
    assert result == ("stop", "\n\n")
    assert text == "\n\n".join(TEXT.split("\n\n")[:k])


def test_stop_offsets_split_steps(tok):
    params = SamplingParams(stop=["\n\n"], n_stop_occurrences=2, include_stop_str_in_output=True, max_tokens=None)
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    checker = StopChecker(tok, [0], params, [])
    for token in ids:
        if checker.append(token):
            break
    (t1, c1), (t2, c2) = checker.stop_offsets
    assert checker.text[:c1] == "Step one: 12 + 7 = 19.\n\n" and c2 == len(checker.text)
    assert tok.decode(ids[:t1]) == checker.text[:c1] and t2 == checker.num_tokens


def test_earliest_of_several_stop_strings(tok):
    text, result, _ = feed(tok, TEXT, SamplingParams(stop=["answer", "="], max_tokens=None))
    assert result == ("stop", "=") and text == "Step one: 12 + 7 "


def test_eos_and_stop_token_ids(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    checker = StopChecker(tok, [0], SamplingParams(max_tokens=None), eos_ids=[ids[3]])
    results = [checker.append(t) for t in ids[:4]]
    assert results[-1] == ("stop", None) and results[:3] == [None] * 3
    checker = StopChecker(tok, [0], SamplingParams(stop_token_ids=[ids[2]], max_tokens=None), [])
    assert [checker.append(t) for t in ids[:3]][-1] == ("stop", ids[2])
    ignoring = StopChecker(tok, [0], SamplingParams(ignore_eos=True, max_tokens=None), eos_ids=[ids[3]])
    assert all(ignoring.append(t) is None for t in ids[:5])


def test_max_tokens_length(tok):
    _, result, n = feed(tok, TEXT, SamplingParams(max_tokens=5))
    assert result == ("length", None) and n == 5


def test_engine_applies_stop_strings(llama_dir, make_llm):
    """End to end: a stretch of a greedy output as the stop string cuts the output there."""
    llm = make_llm(llama_dir)
    prompt = "The quick brown fox"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    start = len(free.text) // 3
    stop = free.text[start : start + 3]
    assert len(stop) == 3 and "\ufffd" not in stop
    cut = free.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    got = llm.generate([prompt], params)[0].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == free.text[:cut]
    params.include_stop_str_in_output = True
    assert llm.generate([prompt], params)[0].outputs[0].text == free.text[: cut + len(stop)]
    limited = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert limited.finish_reason == "length" and limited.token_ids == free.token_ids[:4]


@pytest.mark.parametrize("include", [False, True])
def test_engine_text_from_the_sequences_own_tokens(llama_dir, make_llm, include):
    """The engine's lazy checkers make the text from each sequence's own token list (forks of an
    n > 1 request from theirs): every completion's text is the text a checker that keeps its own
    list gives for the same tokens, with an ending token's text only when asked for."""
    llm = make_llm(llama_dir)
    tokenizer = llm.engine.tokenizer
    prompt = "Once upon a time"
    first = llm.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True))
    end = first[0].outputs[0].token_ids[5]  # a token some completions sample: it ends them there
    params = SamplingParams(
        temperature=0.8, seed=3, n=4, max_tokens=12, stop_token_ids=[end], include_stop_str_in_output=include
    )
    out = llm.generate([prompt], params)[0]
    prompt_ids = out.prompt_token_ids
    assert len(out.outputs) == 4 and any(c.finish_reason == "stop" for c in out.outputs)
    for completion in out.outputs:
        alone = StopChecker(tokenizer.hf, prompt_ids, params, tokenizer.eos_token_ids)
        for token in completion.token_ids:
            alone.append(token)
        assert completion.text == alone.text


def fed(checker: StopChecker, tokens: list[int], ids: list[int], max_len: int, quietly: bool):
    """Feed `ids` as the engine does: each token into the sequence's list `tokens`, and to
    `checker` (`quietly`: only when `quiet_stops` says it may end the sequence, as the short path
    does); (text, result, tokens fed, the checker's count) at the end."""
    ending, check_len = checker.quiet_stops(max_len) if quietly else (frozenset(), 0)
    for n, token in enumerate(ids, 1):
        tokens.append(token)
        if len(tokens) < check_len and token not in ending:
            continue
        result = checker.append(token)
        if result is None and len(tokens) >= max_len:
            result = ("length", None)
        if result:
            return checker.text, result, n, checker.num_tokens
    return checker.text, None, len(ids), checker.num_tokens


@pytest.mark.parametrize(
    ("kwargs", "ending", "max_len"),
    [
        ({"max_tokens": 7}, None, 100),  # max_tokens
        ({"max_tokens": None}, None, 9),  # the context
        ({"max_tokens": 50}, "eos", 100),
        ({"max_tokens": 20, "ignore_eos": True}, "eos", 100),  # EOS ignored: max_tokens
        ({"max_tokens": None}, "stop_token_ids", 100),
        ({"max_tokens": 50, "stop": ["19 * 3"]}, None, 100),  # stop strings: every token told
    ],
)
def test_tokens_a_checker_is_not_told_of_end_the_sequence_alike(tok, kwargs, ending, max_len):
    """A lazy checker counts the tokens in the sequence's list: the short path tells it only of
    tokens that may end the sequence (`quiet_stops`), with the same result, count and text."""
    prompt = tok.encode("The answer", add_special_tokens=False).ids
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    eos = [ids[5]] if ending == "eos" else []
    if ending == "stop_token_ids":
        kwargs = {**kwargs, "stop_token_ids": [ids[4]]}
    params = SamplingParams(**kwargs)
    runs = []
    for quietly in (True, False):
        tokens = list(prompt)
        checker = StopChecker(tok, prompt, params, eos, tokens=tokens)
        runs.append(fed(checker, tokens, ids, len(prompt) + max_len, quietly))
    assert runs[0] == runs[1] and runs[0][1] is not None
    _, check_len = StopChecker(tok, prompt, params, eos, tokens=list(prompt)).quiet_stops(len(prompt) + max_len)
    assert check_len == (0 if params.stop else len(prompt) + min(max_len, params.max_tokens or max_len))


def test_a_clone_counts_from_where_its_outputs_start(tok):
    """A fork's checker replays the outputs so far, then reads the fork's own list: it counts the
    same tokens, ends at the same length and makes the same text as its parent's."""
    prompt = tok.encode("The answer", add_special_tokens=False).ids
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    tokens = list(prompt)
    parent = StopChecker(tok, prompt, SamplingParams(max_tokens=12), [], tokens=tokens)
    for token in ids[:4]:
        tokens.append(token)
        parent.append(token)
    fork_tokens = list(tokens)
    twin = parent.clone(ids[:4], fork_tokens)
    assert twin.num_tokens == parent.num_tokens == 4 and twin.quiet_stops(1000) == parent.quiet_stops(1000)
    results = [fed(c, t, ids[4:], 1000, quietly=True) for c, t in ((parent, tokens), (twin, fork_tokens))]
    assert results[0] == results[1] and results[0][1:] == (("length", None), 8, 12)
    assert results[0][0] == tok.decode(ids[:12])
