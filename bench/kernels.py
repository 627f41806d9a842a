"""The CPU attention and rope kernels against the PyTorch paths they replace, on search's shapes.

    OMP_NUM_THREADS=1 python bench/kernels.py [--repeats 5]
    python bench/kernels.py --rates [--threads 1,2] [--against OLD/cpu_kernels.c]
    OMP_NUM_THREADS=1 python bench/kernels.py --decode-tiles [--repeats 5]

Cases (bf16, pages laid out as the engine's arena lays them out, one layer of four):
* prefill: chunks of queries over cached prefixes, `cpu_kernels.paged_prefill` against the
  portable path (`SdpaBackend.attend`: gather pages, SDPA with a padded mask). The PRM's
  scoring steps (53 sequences x 6 new tokens over 150 cached, 8 query / 4 KV heads of 32 dims)
  and a Gemma-3-270M-shaped prompt (2048 tokens, 4 / 1 heads of 256 dims).
* decode: one query per sequence, `cpu_kernels.paged_decode` against the same portable path;
  64 and 240 beams of 200 tokens. With 240 beams the KV (25 MB) no longer fits this machine's
  caches; the "shared" rows give 15 beams of each group their first 70% of pages in common, as
  beams of one problem share the prefix cache's pages.
* rope: `cpu_kernels.rope_bf16` against the three PyTorch ops (240 tokens, 8 heads of 32).
Prints the median time of each over `--repeats` runs of ~0.3 s and the ratio.

`--rates` (issue 90): paged prefill attention at the PRM's shapes (`PRM_SHAPES`: many sequences
each adding 10-100 tokens over 100-500 cached), per kernel path this CPU has (amx, avx512, avx2,
and the decode kernel a query a call, the route where no prefill kernel fits), as KV GB/s and
FLOP/s against the bf16 matmul's FLOP/s measured in the same run (`rates`).

`--decode-tiles` (issue 90): `cpu_kernels.paged_decode` at GQA shapes (`DECODE_SHAPES`), this
process (AMX tiles where they run and head_dim >= 64) against a child process with
TREESERVE_AMX=0 (the AVX512-BF16 path), the two alternated every repetition; median ms and the
ratio. Pages are 16 tokens, scattered over the arena: "from memory" shapes hold more KV than the
caches, "cached" ones fit in L2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from treeserve.engine.attention import SdpaBackend, SeqGroup, queries_as_decodes  # noqa: E402
from treeserve.kernels import cpu as cpu_kernels  # noqa: E402
from treeserve.kv.arena import KVArena  # noqa: E402
from treeserve.layers.linear import Linear  # noqa: E402
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
    case = paged_case([queries] * seqs, [context] * seqs, dim, heads, block, shared)
    scale = dim**-0.5
    if queries == 1:
        return lambda: cpu_kernels.paged_decode(
            case.q, case.k_cache, case.v_cache, case.tables, case.ctx, scale, None
        ), case.portable
    return lambda: cpu_kernels.paged_prefill(*case.prefill_args(), scale, None, case.out), case.portable


@dataclass
class PagedCase:
    """Sequences' queries over their KV pages, laid out as the engine's arena lays them out."""

    q: torch.Tensor  # [sum(lens), Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # [B, pages]
    starts: torch.Tensor
    lens: torch.Tensor  # new tokens of each sequence (its queries)
    ctx: torch.Tensor  # cached + new tokens of each sequence
    out: torch.Tensor

    def prefill_args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.tables, self.starts, self.lens, self.ctx

    def group(self) -> SeqGroup:
        width = int(self.lens.max())
        step = torch.arange(width)[None]
        return SeqGroup(
            page_tables=self.tables,
            context_lens=self.ctx,
            query_index=self.starts[:, None] + torch.minimum(step, self.lens[:, None] - 1),
            query_pos=self.ctx[:, None] - self.lens[:, None] + step,
            query_start=self.starts,
            query_len=self.lens,
        )

    def portable(self) -> None:
        """The SDPA path the kernels replace: pages gathered, padded to the longest, masked."""
        SdpaBackend().attend(self.group(), self.q, self.k_cache, self.v_cache, None, None, self.out)

    def as_decodes(self) -> None:
        """CpuBackend's path where no prefill kernel fits: each query a decode of the C kernel."""
        rows, tables, lens = queries_as_decodes(self.group())
        scale = self.q.shape[-1] ** -0.5
        self.out[rows] = cpu_kernels.paged_decode(self.q[rows], self.k_cache, self.v_cache, tables, lens, scale, None)


def paged_case(
    lens: list[int], contexts: list[int], dim: int, heads: tuple[int, int], block: int, shared: float = 0.0
) -> PagedCase:
    """Sequence b computes its last lens[b] of contexts[b] tokens; with `shared`, groups of 15
    sequences have that fraction of their pages in common (beams of one problem)."""
    q_heads, kv_heads = heads
    seqs, pages = len(lens), -(-max(contexts) // block)
    common = int(pages * shared)
    groups = seqs // 15 if shared else 0
    arena = KVArena(groups * common + seqs * (pages - common) + 1, 4, block, kv_heads, dim, torch.bfloat16, "cpu")
    arena.buffer.normal_()
    rows, fresh = [], groups * common
    for b in range(seqs):
        g = b // 15
        rows.append([*range(g * common, (g + 1) * common), *range(fresh, fresh + pages - common)])
        fresh += pages - common
    lens_t = torch.tensor(lens)
    q = torch.randn(int(lens_t.sum()), q_heads, dim, dtype=torch.bfloat16)
    k_cache, v_cache = arena.layer(1)
    starts = torch.cumsum(lens_t, 0) - lens_t
    return PagedCase(
        q, k_cache, v_cache, torch.tensor(rows), starts, lens_t, torch.tensor(contexts), torch.empty_like(q)
    )


def rope_case() -> tuple[Callable[[], object], Callable[[], object]]:
    qkv = torch.randn(240, 512).bfloat16()
    q = qkv[:, :256].view(-1, 8, 32)
    rope = RotaryEmbedding(rope_inv_freq(32, 10000.0, None), 512, "cpu")
    cos, sin = rope.lookup(torch.randint(0, 500, (240,)), torch.bfloat16)
    return lambda: cpu_kernels.rope_bf16(q, cos, sin), lambda: q * cos + _rotate_half(q) * sin


# The PRM's scoring shapes: many sequences, each adding 10-100 tokens over a cached prefix of
# 100-500 (no padding to the longest); (head_dim, (query heads, KV heads)), block 16.
PRM_SHAPES = {
    "arith pair (D 32, 8/4 heads)": (32, (8, 4)),
    "Gemma 3 270M (D 256, 4/1 heads)": (256, (4, 1)),
}
MATMUL = (512, 2048, 2048)  # rows x in x out of the bf16 matmul the attention rates are set against


def prm_case(dim: int, heads: tuple[int, int], seqs: int, seed: int = 0) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(10, 101, (seqs,), generator=gen).tolist()
    prefixes = torch.randint(100, 501, (seqs,), generator=gen).tolist()
    return paged_case(lens, [p + n for p, n in zip(prefixes, lens, strict=True)], dim, heads, 16)


def attention_work(case: PagedCase) -> tuple[float, float]:
    """(FLOPs, KV bytes): 4 * q_heads * head_dim per (query, key it sees); each sequence's K and V once."""
    _, q_heads, dim = case.q.shape
    kv_heads = case.k_cache.shape[2]
    flops = kv = 0.0
    for n, c in zip(case.lens.tolist(), case.ctx.tolist(), strict=True):
        keys_seen = n * (c - n) + n * (n + 1) // 2
        flops += 4 * q_heads * dim * keys_seen
        kv += 2 * c * kv_heads * dim * case.k_cache.element_size()
    return flops, kv


def prefill_from(source: Path) -> Callable[[PagedCase], None]:
    """paged_prefill_bf16 as built from `source` (another cpu_kernels.c, its headers beside it)."""
    lib = cpu_kernels.build(source)
    if lib is None:
        sys.exit(f"{source} did not build")
    tiles = "int64_t window, int tiles," in source.read_text()  # a source before the AMX path: no tiles argument
    argtypes = cpu_kernels.load().paged_prefill_bf16.argtypes
    lib.paged_prefill_bf16.argtypes = argtypes if tiles else [*argtypes[:-3], *argtypes[-2:]]
    lib.paged_prefill_bf16.restype = None

    def run(case: PagedCase) -> None:
        _, q_heads, dim = case.q.shape
        block, kv_heads = case.k_cache.shape[1:3]
        v_offset = (case.v_cache.data_ptr() - case.k_cache.data_ptr()) // case.k_cache.element_size()
        lib.paged_prefill_bf16(
            *(case.q.data_ptr(), case.k_cache.data_ptr(), case.k_cache.stride(0), v_offset),
            *(case.tables.data_ptr(), case.tables.stride(0), case.starts.data_ptr(), case.lens.data_ptr()),
            *(case.ctx.data_ptr(), case.tables.shape[0], q_heads, kv_heads, dim, block, dim**-0.5, 0),
            *((1,) if tiles else ()),
            *(torch.get_num_threads(), case.out.data_ptr()),
        )

    return run


def alternated_ms(fns: dict[str, Callable[[], object]], repeats: int, window: float = 0.2) -> dict[str, float]:
    """Median ms a call of each fn, the fns taking turns (order rotated) so drift hits all alike."""
    names = list(fns)
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < window:
                fns[name]()
                calls += 1
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def rates(threads: list[int], repeats: int, seqs: int, against: Path | None) -> None:
    """Paged prefill attention's GB/s and FLOP/s at the PRM shapes against the bf16 matmul's FLOP/s."""
    m, k, n = MATMUL
    x = torch.randn(m, k, dtype=torch.bfloat16)
    linear = Linear(k, n, bias=False).to(torch.bfloat16)
    weight = linear.weight.detach().clone()
    linear.pick_kernel()
    matmuls = {"treeserve bf16 linear": lambda: linear(x), "torch.matmul bf16": lambda: torch.matmul(x, weight.t())}
    cases = {name: prm_case(dim, heads, seqs) for name, (dim, heads) in PRM_SHAPES.items()}
    old = prefill_from(against) if against else None

    def scale(c: PagedCase) -> float:
        return c.q.shape[-1] ** -0.5

    paths: dict[str, Callable[[PagedCase], object]] = {
        f"C {path}": (
            lambda c, path=path: cpu_kernels.paged_prefill(*c.prefill_args(), scale(c), None, c.out, path=path)
        )
        for path, here in (
            ("amx", cpu_kernels.prefill_tiles_available()),
            ("avx512", cpu_kernels.bf16_built()),
            ("avx2", cpu_kernels.load_prefill_avx2() is not None),
        )
        if here
    }
    if old:
        paths[f"C avx512 ({against.name})"] = old
    paths["C decode kernel, a query a call"] = PagedCase.as_decodes
    paths["PyTorch SDPA (gathered, padded)"] = PagedCase.portable
    print(f"{cpu_model()}; torch {torch.__version__}; median of {repeats}; {seqs} sequences a shape")
    for name, case in cases.items():
        flops, kv = attention_work(case)
        print(f"{name}: {int(case.lens.sum())} queries, {flops / 1e9:.2f} GFLOP, {kv / 1e6:.1f} MB of KV a call")
    print("| threads | shape | path | ms | KV GB/s | GFLOP/s | of treeserve matmul | of torch.matmul |")
    print("|---|---|---|---|---|---|---|---|")
    for t in threads:
        torch.set_num_threads(t)
        fns: dict[tuple[str, str], Callable[[], object]] = {("matmul", p): fn for p, fn in matmuls.items()}
        for shape, case in cases.items():
            fns.update({(shape, p): (lambda fn=fn, c=case: fn(c)) for p, fn in paths.items()})
        ms = alternated_ms(fns, repeats)
        mm = {p: 2 * m * n * k / ms[("matmul", p)] / 1e6 for p in matmuls}
        own, ref = mm["treeserve bf16 linear"], mm["torch.matmul bf16"]
        for p in matmuls:
            print(f"| {t} | matmul {m}x{k}x{n} | {p} | {ms[('matmul', p)]:.3f} | | {mm[p]:.1f} | | |")
        for shape, case in cases.items():
            flops, kv = attention_work(case)
            for p in paths:
                t_ms = ms[(shape, p)]
                rate = flops / t_ms / 1e6
                print(
                    f"| {t} | {shape} | {p} | {t_ms:.3f} | {kv / t_ms / 1e6:.2f} | {rate:.1f} "
                    f"| {rate / own:.0%} | {rate / ref:.0%} |"
                )


# name: (head_dim, q heads, KV heads, sequences, context)
DECODE_SHAPES = {
    "Gemma 3 270M, 128 seqs x 96 keys (from memory)": (256, 4, 1, 128, 96),
    "Gemma 3 270M, 128 seqs x 160 keys (from memory)": (256, 4, 1, 128, 160),
    "Gemma 3 270M, 8 seqs x 96 keys (cached)": (256, 4, 1, 8, 96),
    "Llama 3 8B heads (D 128, 32 / 8), 32 seqs x 256 keys": (128, 32, 8, 32, 256),
    "D 128, 32 / 4 heads, 8 seqs x 128 keys (cached)": (128, 32, 4, 8, 128),
    "D 64, 8 / 2 heads, 64 seqs x 200 keys": (64, 8, 2, 64, 200),
}


def decode_ms(repeats: int) -> dict[str, float]:
    """Median ms of one `paged_decode` call per DECODE_SHAPES entry, on this process's path."""
    out = {}
    for name, (dim, q_heads, kv_heads, seqs, context) in DECODE_SHAPES.items():
        torch.manual_seed(0)
        pages = -(-context // 16)
        arena = KVArena(seqs * pages + 4, 1, 16, kv_heads, dim, torch.bfloat16, "cpu")
        arena.buffer.view(torch.bfloat16).normal_()
        k_cache, v_cache = arena.layer(0)
        tables = torch.randperm(seqs * pages).view(seqs, pages)
        lens = torch.full((seqs,), context)
        q = torch.randn(seqs, q_heads, dim, dtype=torch.bfloat16)
        result = torch.empty_like(q)
        call = partial(cpu_kernels.paged_decode, q, k_cache, v_cache, tables, lens, dim**-0.5, None, result)
        out[name] = median_ms(call, repeats)
    return out


def decode_tiles(repeats: int) -> None:
    if not cpu_kernels.prefill_tiles_available():
        sys.exit("no AMX tiles here: the decode kernel has one path")
    child = [sys.executable, __file__, "--decode-child"]
    env = {**os.environ, "TREESERVE_AMX": "0"}
    tiles: dict[str, list[float]] = {name: [] for name in DECODE_SHAPES}
    vector: dict[str, list[float]] = {name: [] for name in DECODE_SHAPES}
    for rep in range(repeats):  # alternated, the order swapped every repetition
        for first in (rep % 2 == 0, rep % 2 == 1):
            if first:
                for name, ms in decode_ms(3).items():
                    tiles[name].append(ms)
            else:
                ran = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
                for name, ms in json.loads(ran.stdout.splitlines()[-1]).items():
                    vector[name].append(ms)
    print(f"{cpu_model()}, {torch.get_num_threads()} thread(s), medians of {repeats}")
    print("| shape | AMX tiles (ms) | AVX512-BF16 (ms) | tiles' speed-up |\n|---|---|---|---|")
    for name in DECODE_SHAPES:
        t, v = statistics.median(tiles[name]), statistics.median(vector[name])
        print(f"| {name} | {t:.3f} | {v:.3f} | {v / t:.2f}x |")


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        lines = f.read().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    marks = [f for f in flags if f in ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")]
    return f"{model} ({', '.join(marks) or 'no AVX512-BF16/AMX'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rates", action="store_true", help="only the prefill attention rates at PRM shapes")
    ap.add_argument("--threads", default="1,2", help="--rates: thread counts, comma-separated")
    ap.add_argument("--seqs", type=int, default=32, help="--rates: sequences a shape")
    ap.add_argument("--against", type=Path, help="--rates: also time paged_prefill_bf16 built from this source")
    ap.add_argument("--decode-tiles", action="store_true", help="only decode attention, AMX tiles against AVX-512")
    ap.add_argument("--decode-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decode_child:
        print(json.dumps(decode_ms(3)))
        return
    if args.decode_tiles:
        decode_tiles(args.repeats)
        return
    if args.rates and cpu_kernels.prefill_path(torch.bfloat16, 32) is None:
        sys.exit("no prefill kernel is built here (no C compiler, or neither AVX2 nor AVX512-BF16)")
    if not args.rates and not cpu_kernels.bf16_built():
        sys.exit("the bf16 kernels are not built here (no C compiler or no AVX512-BF16)")
    if args.rates:
        rates([int(t) for t in args.threads.split(",")], args.repeats, args.seqs, args.against)
        return
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
