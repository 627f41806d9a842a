"""Twin decode rows (equal token ids) are computed once, and outputs do not change."""

from __future__ import annotations

import pytest

from treeserve import SamplingParams
from treeserve.engine.dedup import Twins
from treeserve.engine.request import HISTORY_ANCHOR, TWIN_KEY_TOKENS


def test_twins_computed_once_same_outputs(llama_dir, make_llm, monkeypatch):
    """Requests with one prompt and low temperature share their first tokens, then diverge: after
    diverging, each twin reads its own K/V (copied from the representative's while they were
    twins), so every output must equal the one its request gives alone."""
    prompt = "Once upon a time"
    params = [SamplingParams(temperature=0.4, seed=s, max_tokens=40, ignore_eos=True) for s in range(8)]
    alone = [make_llm(llama_dir).generate([prompt], p)[0].outputs[0].token_ids for p in params]
    rows = {"scheduled": 0, "computed": 0}
    find = Twins.find

    def counting(batch, groups, page_size):
        twins = find(batch, groups, page_size)
        rows["scheduled"] += batch.token_ids.shape[0]
        rows["computed"] += (twins.computed if twins else batch).token_ids.shape[0]
        return twins

    monkeypatch.setattr(Twins, "find", counting)
    llm = make_llm(llama_dir)
    together = [o.outputs[0].token_ids for o in llm.generate([prompt] * 8, params)]
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1  # they diverged
    shared = sum(len(_common_prefix(a, b)) for a in alone for b in alone if a is not b)
    assert shared > 0  # ... after sharing tokens
    assert rows["computed"] < rows["scheduled"]  # twins' rows were not computed


def test_twins_with_speculation(llama_dir, make_llm):
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    params = [SamplingParams(temperature=0.2, seed=s, max_tokens=40, ignore_eos=True) for s in range(6)]
    alone = [make_llm(llama_dir).generate(["the the the"], p)[0].outputs[0].token_ids for p in params]
    llm = make_llm(llama_dir, speculative_config=config)
    assert [o.outputs[0].token_ids for o in llm.generate(["the the the"] * 6, params)] == alone


@pytest.mark.parametrize("prompt_len", [TWIN_KEY_TOKENS - 2, TWIN_KEY_TOKENS + 8, HISTORY_ANCHOR - 2])
def test_twins_across_prompts_of_different_lengths(llama_dir, make_llm, monkeypatch, prompt_len):
    """A request whose prompt is another's prompt plus its first three tokens is that one's twin
    from its first decode on, whenever each began hashing its history (`Sequence.history_key`):
    a short prompt hashes from its first decode, a longer one (`Request.prompt_key`) from when a
    second sequence with its first 16 tokens runs; the last case crosses a hash anchor."""
    prompt = [(7 * i + 3) % 200 + 5 for i in range(prompt_len)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = make_llm(llama_dir).generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
    engine = make_llm(llama_dir, enable_prefix_caching=False).engine
    twins = []
    find = Twins.find

    def counting(batch, groups, page_size):
        found = find(batch, groups, page_size)
        twins.append(0 if found is None else batch.token_ids.shape[0] - found.computed.token_ids.shape[0])
        return found

    monkeypatch.setattr(Twins, "find", counting)
    engine.add_request("x", {"prompt_token_ids": prompt}, greedy)
    finished = {}
    for step in range(12):
        if step == 3:  # x decodes its 3rd token while y (x's prompt and first 3 tokens) prefills
            engine.add_request("y", {"prompt_token_ids": prompt + out[:3]}, greedy)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["x"].outputs[0].token_ids == out
    assert finished["y"].outputs[0].token_ids[:5] == out[3:]
    assert sum(twins) == 4  # y's rows were x's twins until x ended


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_history_key_does_not_depend_on_where_hashing_began():
    """Twins are found by equal history keys: a sequence that began hashing at another length, or
    jumped ahead, or went back (a preempted one), gets the same key for the same tokens."""
    from treeserve.engine.request import Request, Sequence

    tokens = [(31 * i) % 97 for i in range(3 * HISTORY_ANCHOR + 5)]
    request = Request("r", None, tokens[:10], None, None, 0, 0)
    for began in (1, 9, HISTORY_ANCHOR - 1, HISTORY_ANCHOR, 2 * HISTORY_ANCHOR + 3):
        seq = Sequence(request, list(tokens), None)
        fresh = [Sequence(request, list(tokens), None).history_key(n) for n in range(began, len(tokens))]
        assert [seq.history_key(n) for n in range(began, len(tokens))] == fresh
    assert seq.history_key(5) == Sequence(request, list(tokens), None).history_key(5)  # back
    assert seq.history_key(len(tokens)) == Sequence(request, list(tokens), None).history_key(len(tokens))
    other = Sequence(request, tokens[:-1] + [tokens[-1] + 1], None)
    assert other.history_key(len(tokens))[1] != seq.history_key(len(tokens))[1]


def test_shared_keys_count_the_prompt_keys_of_two_running_sequences(llama_dir, make_llm):
    """`InputBatch.shared_keys` (decodes look their key up only while it is > 0) equals the number
    of prompt keys two or more running sequences hold, after every step, as requests with shared
    and lone prompts start, fork (n > 1) and end at different steps."""
    engine = make_llm(llama_dir).engine
    long_a = [(5 * i + 1) % 200 + 5 for i in range(TWIN_KEY_TOKENS + 4)]
    long_b = [(11 * i + 2) % 200 + 5 for i in range(TWIN_KEY_TOKENS + 2)]
    requests = [(long_a, 3, 1), (long_a, 9, 1), (long_b, 5, 2), (long_b[:4], 6, 1), (long_a + [7], 12, 3)]
    for i, (ids, max_tokens, n) in enumerate(requests):
        params = SamplingParams(temperature=0.5, seed=i, max_tokens=max_tokens, n=n, ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        users = engine.inputs.prompt_users
        assert engine.inputs.shared_keys == sum(count > 1 for count in users.values())
        seen.add(engine.inputs.shared_keys)
    assert engine.inputs.shared_keys == 0 and len(seen) > 2  # it rose and fell
