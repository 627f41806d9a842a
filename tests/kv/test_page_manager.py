"""Page accounting (invariant 1): random allocate / fork / grow / free / evict sequences leak nothing,
and every page a sequence reads holds its tokens (prefix hits, cached tails, copy-on-write)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from treeserve.kv.page_manager import PageManager

BLOCK = 4


class PagesMachine(RuleBasedStateMachine):
    """Model sequences as (token ids, page table, page hashes, computed count), and each page's
    KV as the tokens written into its slots."""

    def __init__(self):
        super().__init__()
        self.bm = PageManager(num_pages=12, page_size=BLOCK, model_id="m")
        self.seqs: list[dict] = []
        self.kv: list[list[int | None]] = [[None] * BLOCK for _ in range(12)]

    def _write(self, seq: dict, copies: list[tuple[int, int]], start: int) -> None:
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])
        for p in range(start, len(seq["tokens"])):
            self.kv[seq["table"][p // BLOCK]][p % BLOCK] = seq["tokens"][p]

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, prompt):
        hit = self.bm.find_prefix(prompt, len(prompt) - 1)
        table = list(hit.pages)
        start = hit.num_tokens(BLOCK)
        need = self.bm.pages_to_acquire(hit) + self.bm.pages_to_grow(table, start, len(prompt))
        if need > self.bm.num_free_pages:
            return
        self.bm.acquire_prefix(hit)
        copies = self.bm.grow(table, start, len(prompt))
        seq = {"tokens": list(prompt), "table": table, "hashes": list(hit.hashes), "computed": len(prompt)}
        self._write(seq, copies, start)
        self.bm.commit_full_pages(table, seq["hashes"], seq["tokens"], seq["computed"])
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append_token(self, data, token):
        seq = data.draw(st.sampled_from(self.seqs))
        n = len(seq["tokens"])
        if self.bm.pages_to_grow(seq["table"], n, n + 1) > self.bm.num_free_pages:
            return
        copies = self.bm.grow(seq["table"], n, n + 1)
        seq["tokens"].append(token)
        seq["computed"] = n + 1
        self._write(seq, copies, n)
        self.bm.commit_full_pages(seq["table"], seq["hashes"], seq["tokens"], seq["computed"])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        twin = {k: list(v) if isinstance(v, list) else v for k, v in seq.items()}
        twin["table"] = self.bm.fork(seq["table"])
        self.seqs.append(twin)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), ended_by_its_tokens=st.booleans())
    def free(self, data, ended_by_its_tokens):
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        if ended_by_its_tokens:
            self.bm.cache_tail(seq["table"], seq["hashes"], seq["tokens"], seq["computed"])
        self.bm.release(seq["table"])

    @invariant()
    def pages_consistent(self):
        self.bm.check_invariants()
        held = {}
        for seq in self.seqs:
            for page in seq["table"]:
                held[page] = held.get(page, 0) + 1
        for page, count in enumerate(self.bm.ref_counts):
            assert count == held.get(page, 0), f"page {page}: count {count}, held {held.get(page, 0)}"

    @invariant()
    def pages_hold_their_sequences_tokens(self):
        for seq in self.seqs:
            for p in range(seq["computed"]):
                assert self.kv[seq["table"][p // BLOCK]][p % BLOCK] == seq["tokens"][p], f"position {p}"

    @invariant()
    def cached_pages_hold_their_tokens(self):
        # a keyed page in use by a sequence holds exactly the tokens its key stands for
        for seq in self.seqs:
            for i, key in enumerate(seq["hashes"]):
                page = seq["table"][i]
                if self.bm.page_hash[page] is not None:
                    assert self.bm.page_hash[page] == key

    def teardown(self):
        for seq in self.seqs:
            self.bm.release(seq["table"])
        self.bm.check_idle()


TestPages = PagesMachine.TestCase
TestPages.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_miss_evict_thrash_counters():
    bm = PageManager(num_pages=2, page_size=2)
    a = [1, 2, 3, 4]
    table: list[int] = []
    bm.grow(table, 0, 4)
    bm.commit_full_pages(table, [], a, 4)
    bm.release(table)
    hit = bm.find_prefix(a, 4)
    assert len(hit.pages) == 2
    bm.acquire_prefix(hit)
    assert bm.stats.hits == 2 and bm.stats.misses == 0
    bm.release(hit.pages)
    other: list[int] = []
    bm.grow(other, 0, 4)  # evicts both cached pages
    assert bm.stats.evictions == 2
    bm.release(other)
    bm.acquire_prefix(bm.find_prefix(a, 4))  # both keys were cached before: thrash
    assert bm.stats.misses == 2 and bm.stats.thrash == 2
    bm.check_idle()


def test_copy_on_write_of_shared_partial_page():
    bm = PageManager(num_pages=4, page_size=4)
    parent: list[int] = []
    bm.grow(parent, 0, 3)
    child = bm.fork(parent)
    copies = bm.grow(child, 3, 4)
    assert copies == [(parent[0], child[0])] and parent[0] != child[0]
    assert bm.grow(parent, 3, 4) == []  # parent is the only owner now
    bm.release(parent)
    bm.release(child)
    bm.check_idle()
