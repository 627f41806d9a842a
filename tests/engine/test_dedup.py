"""Twin decode rows (equal token ids) are computed once, and outputs do not change."""

from __future__ import annotations

from treeserve import SamplingParams
from treeserve.engine.dedup import Twins


def test_twins_computed_once_same_outputs(llama_dir, make_llm, monkeypatch):
    """Requests with one prompt and low temperature share their first tokens, then diverge: after
    diverging, each twin reads its own K/V (copied from the representative's while they were
    twins), so every output must equal the one its request gives alone."""
    prompt = "Once upon a time"
    params = [SamplingParams(temperature=0.4, seed=s, max_tokens=40, ignore_eos=True) for s in range(8)]
    alone = [make_llm(llama_dir).generate([prompt], p)[0].outputs[0].token_ids for p in params]
    rows = {"scheduled": 0, "computed": 0}
    find = Twins.find

    def counting(batch, groups, block_size):
        twins = find(batch, groups, block_size)
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


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
