"""Preemption by recompute under a tiny page budget gives the same outputs as a large budget."""

from __future__ import annotations

from treeserve import SamplingParams

PROMPTS = [
    "Once upon a time, in a land far away, there lived",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 0 1 2 3 4 5 6 7 8 9",
    "def f(x):\n    return",
    "Unicode: café, naïve",
    "Compute (12 + 7) * 3 - 15.",
]


def run(llm):
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True, seed=3, n=3),
    ]
    return [
        [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
        for p in params
        for out in llm.generate(PROMPTS, p)
    ]


def test_tiny_budget_preempts_and_matches(llama_dir, make_llm):
    big = make_llm(llama_dir)
    # 24 pages of 4 tokens: far less than 6 prompts x 3 completions x ~75 tokens need at once
    page = 2 * 2 * 4 * 2 * 16 * 4  # layers * k/v * block * kv_heads * head_dim * fp32 bytes
    small = make_llm(llama_dir, page_size=4, kv_cache_memory=24 * page, max_model_len=80)
    assert run(small) == run(big)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.pages.stats.evictions > 0


def test_n_completions_share_prompt_pages(llama_dir, make_llm):
    llm = make_llm(llama_dir, page_size=4)
    engine = llm.engine
    prompt = llm.get_tokenizer().encode(PROMPTS[0])  # 12+ tokens: several full pages
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(n=4, max_tokens=3, ignore_eos=True))
    engine.step_plain()  # prefill once, fork 3 siblings (read back in this call)
    seqs = engine.requests["r"].seqs
    assert len(seqs) == 4
    full_pages = len(prompt) // 4
    for seq in seqs[1:]:
        assert seq.page_table[:full_pages] == seqs[0].page_table[:full_pages]
    assert engine.pages.num_used_pages == -(-len(prompt) // 4)  # no page was copied yet
    while engine.has_unfinished_requests():
        engine.step()
