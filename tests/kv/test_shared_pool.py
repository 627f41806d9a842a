"""Invariant 1 across two models on one page pool: pages flow between them and none leaks or is shared."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from treeserve.kv.page_manager import PageManager
from treeserve.kv.page_pool import PagePool

BLOCKS = (4, 2)  # the two models' tokens per page


class TwoModels(RuleBasedStateMachine):
    """Each sequence: (model, token ids, page table, block hashes); random admit/grow/fork/free."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(10)
        self.models = [PageManager(0, bs, f"m{i}", pool=self.pool) for i, bs in enumerate(BLOCKS)]
        self.seqs: list[dict] = []

    @rule(model=st.integers(0, 1), prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def admit(self, model, prompt):
        bm = self.models[model]
        hit = bm.find_prefix(prompt, len(prompt) - 1)
        table = list(hit.pages)
        start = len(table) * bm.page_size
        need = bm.pages_to_acquire(hit) + bm.pages_to_grow(table, start, len(prompt))
        if need > bm.num_free_pages:
            return
        bm.acquire_prefix(hit)
        bm.grow(table, start, len(prompt))
        seq = {"model": model, "tokens": list(prompt), "table": table, "hashes": list(hit.hashes)}
        bm.commit_full_pages(table, seq["hashes"], seq["tokens"], len(prompt))
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append_token(self, data, token):
        seq = data.draw(st.sampled_from(self.seqs))
        bm, n = self.models[seq["model"]], len(seq["tokens"])
        if bm.pages_to_grow(seq["table"], n, n + 1) > bm.num_free_pages:
            return
        bm.grow(seq["table"], n, n + 1)
        seq["tokens"].append(token)
        bm.commit_full_pages(seq["table"], seq["hashes"], seq["tokens"], n + 1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        twin = {k: list(v) if isinstance(v, list) else v for k, v in seq.items()}
        twin["table"] = self.models[seq["model"]].fork(seq["table"])
        self.seqs.append(twin)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.models[seq["model"]].release(seq["table"])

    @invariant()
    def pages_consistent(self):
        self.pool.check_invariants()
        held: dict[int, int] = {}
        holder: dict[int, int] = {}
        for seq in self.seqs:
            for block in seq["table"]:
                held[block] = held.get(block, 0) + 1
                assert holder.setdefault(block, seq["model"]) == seq["model"], f"page {block} held by both models"
        for block, count in enumerate(self.pool.ref_counts):
            assert count == held.get(block, 0), f"page {block}: count {count}, held {held.get(block, 0)}"
            if count:
                assert self.pool.owner[block] == holder[block]
        for i, bm in enumerate(self.models):
            assert bm.num_used_pages == len({b for s in self.seqs if s["model"] == i for b in s["table"]})

    @invariant()
    def hits_never_cross_models(self):
        for seq in self.seqs:
            for i, key in enumerate(seq["hashes"]):
                block = seq["table"][i]
                if self.pool.page_hash[block] == key:
                    assert self.pool.owner[block] == seq["model"]

    def teardown(self):
        for seq in self.seqs:
            self.models[seq["model"]].release(seq["table"])
        for bm in self.models:
            bm.check_idle()
        assert self.pool.num_available == self.pool.num_pages


TestTwoModels = TwoModels.TestCase
TestTwoModels.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_pages_flow_from_one_model_to_the_other():
    pool = PagePool(4)
    a, b = PageManager(0, 2, "a", pool=pool), PageManager(0, 2, "b", pool=pool)
    table: list[int] = []
    a.grow(table, 0, 8)  # a takes every page and caches them all
    a.commit_full_pages(table, [], [1, 2, 3, 4, 5, 6, 7, 8], 8)
    a.release(table)
    assert a.num_cached_pages == 4 and a.num_used_pages == 0 and b.num_free_pages == 4
    other: list[int] = []
    b.grow(other, 0, 6)  # b evicts three of a's cached pages, least recently released first
    assert b.num_used_pages == 3 and a.num_cached_pages == 1
    assert a.stats.evictions == 3 and b.stats.evictions == 0
    assert not b.find_prefix([1, 2, 3, 4, 5, 6, 7, 8], 8).pages  # keys are per model: b never hits a's pages
    assert len(a.find_prefix([1, 2, 3, 4, 5, 6, 7, 8], 8).pages) == 1  # the prefix page went last
    b.release(other)
    a.check_idle()
    b.check_idle()


def test_the_first_starving_model_gets_released_pages_first():
    pool = PagePool(4)
    a, b = PageManager(0, 2, "a", pool=pool), PageManager(0, 2, "b", pool=pool)
    assert pool.may_admit(a.owner) and pool.may_admit(b.owner)
    pool.set_starving(b.owner, True)
    assert not pool.may_admit(a.owner) and pool.may_admit(b.owner)
    pool.set_starving(a.owner, True)  # a also waits now, but b came first
    assert pool.may_admit(b.owner) and not pool.may_admit(a.owner)
    pool.set_starving(b.owner, False)
    assert pool.may_admit(a.owner)


def test_the_pool_records_which_model_handed_pages_to_which():
    """A page taken by another model than the one that last held it (free, or a cached page
    evicted) is a hand-over, reported once to the model that took it; a model reusing its own
    pages, or a never-used page, is none."""
    pool = PagePool(4)
    a, b = pool.register(), pool.register()
    first = [pool.take(a) for _ in range(2)]
    assert pool.take_handovers(a) == set()  # never-used pages
    for block in first:
        pool.release(block)
    again = pool.take(a)  # its own page back
    assert pool.take_handovers(a) == set()
    pool.release(again)
    taken = [pool.take(b) for _ in range(3)]  # the free pages a released, and one never used
    assert pool.take_handovers(b) == {a}
    assert pool.take_handovers(b) == set()  # reported once
    cached = pool.take(a)
    pool.key(cached, 12345)
    pool.release(cached)  # count 0, keyed: cached, still a's
    for block in taken:
        pool.release(block)
    pool.take_handovers(a)
    stolen = [pool.take(b) for _ in range(4)]  # the last one evicts a's cached page
    assert cached in stolen and pool.take_handovers(b) == {a}
