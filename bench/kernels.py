"""The CPU attention and rope kernels against the PyTorch paths they replace, on search's shapes.

    OMP_NUM_THREADS=1 python bench/kernels.py [--repeats 5]

Cases (bf16, pages laid out as the engine's arena lays them out, one layer of four):
* prefill: chunks of queries over cached prefixes, `cpu_kernels.paged_prefill` against the
  portable path (`AttentionBatch._attend`: gather pages, SDPA with a padded mask). The PRM's
  scoring steps (53 sequences x 6 new tokens over 150 cached, 8 query / 4 KV heads of 32 dims)
  and a Gemma-3-270M-shaped prompt (2048 tokens, 4 / 1 heads of 256 dims).
* decode: one query per sequence, `cpu_kernels.paged_decode` against the same portable path;
  64 and 240 beams of 200 tokens. With 240 beams the KV (25 MB) no longer fits this machine's
  caches; the "shared" rows give 15 beams of each group their first 70% of pages in common, as
  beams of one problem share the prefix cache's pages.
* rope: `cpu_kernels.rope_bf16` against the three PyTorch ops (240 tokens, 8 heads of 32).
Prints the median time of each over `--repeats` runs of ~0.3 s and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from treeserve.engine.attention import AttentionBatch, SeqGroup  # noqa: E402
from treeserve.kernels import cpu as cpu_kernels  # noqa: E402
from treeserve.kv.arena import KVArena  # noqa: E402
from treeserve.layers.rotary import RotaryEmbedding, _rotate_half, rope_inv_freq  # noqa: E402


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.3:
            fn()
            calls += 1
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def attention_case(
    seqs: int, queries: int, context: int, dim: int, heads: tuple[int, int], block: int, shared: float = 0.0
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(kernel, portable path) for `seqs` sequences computing their last `queries` of `context` tokens."""
    q_heads, kv_heads = heads
    pages = -(-context // block)
    common = int(pages * shared)
    groups = seqs // 15 if shared else 0
    arena = KVArena(groups * common + seqs * (pages - common) + 1, 4, block, kv_heads, dim, torch.bfloat16, "cpu")
    arena.buffer.normal_()
    rows, fresh = [], groups * common
    for b in range(seqs):
        g = b // 15
        rows.append([*range(g * common, (g + 1) * common), *range(fresh, fresh + pages - common)])
        fresh += pages - common
    tables = torch.tensor(rows)
    lens = torch.full((seqs,), queries)
    ctx = torch.full((seqs,), context)
    starts = torch.cumsum(lens, 0) - lens
    q = torch.randn(seqs * queries, q_heads, dim, dtype=torch.bfloat16)
    k_cache, v_cache = arena.layer(1)
    step = torch.arange(queries)[None]
    group = SeqGroup(
        block_tables=tables,
        context_lens=ctx,
        query_index=starts[:, None] + step,
        query_pos=ctx[:, None] - queries + step,
        query_valid=torch.ones(seqs, queries, dtype=torch.bool),
        query_start=starts,
        query_len=lens,
    )
    portable = AttentionBatch(arena=arena, slot_pages=tables, slot_offsets=tables, groups=[group])
    out = torch.empty_like(q)
    if queries == 1:
        kernel = lambda: cpu_kernels.paged_decode(q, k_cache, v_cache, tables, ctx, dim**-0.5, None)  # noqa: E731
    else:
        kernel = lambda: cpu_kernels.paged_prefill(q, k_cache, v_cache, tables, starts, lens, ctx, dim**-0.5, None, out)  # noqa: E731
    return kernel, lambda: portable._attend(group, q, k_cache, v_cache, None)


def rope_case() -> tuple[Callable[[], object], Callable[[], object]]:
    qkv = torch.randn(240, 512).bfloat16()
    q = qkv[:, :256].view(-1, 8, 32)
    rope = RotaryEmbedding(rope_inv_freq(32, 10000.0, None), 512, "cpu")
    cos, sin = rope.lookup(torch.randint(0, 500, (240,)), torch.bfloat16)
    return lambda: cpu_kernels.rope_bf16(q, cos, sin), lambda: q * cos + _rotate_half(q) * sin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not cpu_kernels.bf16_built():
        sys.exit("the bf16 kernels are not built here (no C compiler or no AVX512-BF16)")
    cases = {
        "prefill: PRM step, 53 seqs x 6 new of 150": attention_case(53, 6, 150, 32, (8, 4), 4),
        "prefill: one 2048-token prompt, Gemma 3 270M heads": attention_case(1, 2048, 2048, 256, (4, 1), 16),
        "decode: 64 beams x 200 tokens": attention_case(64, 1, 200, 32, (8, 4), 10),
        "decode: 240 beams x 200 tokens": attention_case(240, 1, 200, 32, (8, 4), 10),
        "decode: 240 beams x 200, 70% shared": attention_case(240, 1, 200, 32, (8, 4), 10, shared=0.7),
        "rope: 240 tokens x 8 heads": rope_case(),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}")
    print("| case | C kernel (ms) | PyTorch path (ms) | speed-up |\n|---|---|---|---|")
    for name, (kernel, portable) in cases.items():
        fast, slow = median_ms(kernel, args.repeats), median_ms(portable, args.repeats)
        print(f"| {name} | {fast:.3f} | {slow:.3f} | {slow / fast:.1f}x |")


if __name__ == "__main__":
    main()
