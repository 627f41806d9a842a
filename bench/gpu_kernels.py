"""The Triton kernels at the thesis's shapes on one GPU: decode attention's bandwidth, prefill
attention's tensor-core throughput, the sampler's time, each against its roofline.

    python bench/gpu_kernels.py --out bench/out/gpu                      # a CUDA GPU
    python bench/gpu_kernels.py --before .before --out bench/out/gpu     # also the kernels in .before/
    python bench/gpu_kernels.py --device cpu --tiny --out /tmp/k         # a smoke run (Triton interpreter)

Cases (bf16 caches laid out as one layer of the engine's arena, pages shuffled):
* decode: the 1B generator's attention (32 q / 8 KV heads of 64 dims, 16-token pages), one
  query per sequence over 700 keys, at batch 16, 64 and 512 (the issue's target: >= 60% of
  HBM bandwidth at 512 x 700). Bytes counted: the K and V rows read, once per KV head.
* prefill: the 8B PRM's scoring step (32 q / 8 KV heads of 128 dims, 4-token pages, as in
  the shared arena), 64 sequences of 100 new tokens over 300 cached (N=16 x 4 beams), and
  256 of them (N=64). FLOPs counted: 4 x queries x visible keys x q heads x head_dim (QK^T
  and PV, causal; target >= 40% of bf16 dense peak).
* sampler: `sample_rows` over Llama 3's 128256-id vocabulary at batch 1 and 512, µs.
Each kernel runs at its defaults and at the tile / warp / stage settings of `--sweep`
(the constants a GPU run tunes); `--before DIR` also times the kernel files found in DIR
(decode_attention.py, prefill_attention.py: the earlier version, saved with `git show`).
Every output is checked against a PyTorch reference (max abs error recorded). Times: calls
captured in a CUDA graph over 256 MiB of K/V copies (so reads come from HBM, not L2), the
median of 7 replays. JSON to `--out`/kernels.json, printed as a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from roofline_floor import GPUS  # noqa: E402
from thesis_shapes import gpu_key  # noqa: E402

VOCAB = 128256
COPY_BYTES = 256 << 20  # K/V the timed calls cycle through (the H100's L2 holds 50 MB)
REPLAYS = 7
DECODE_SWEEP = [{"block_n": 32}, {"block_n": 128}, {"num_warps": 8}, {"num_stages": 3}]
PREFILL_SWEEP = [{"block_n": 32}, {"block_n": 128}, {"num_warps": 8}, {"num_stages": 3}, {"block_m": 64}]


def paged(batch: int, context: int, kv_heads: int, dim: int, page: int, device: str, seed: int) -> tuple:
    """K and V caches of `batch` sequences of `context` tokens on shuffled pages, and block
    tables: on CUDA several copies of the batch over different pages, COPY_BYTES of K/V in
    all, so that timing them in turn reads HBM, not the L2 cache."""
    g = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-context // page)
    batch_bytes = 2 * batch * per_seq * page * kv_heads * dim * 2
    copies = 1 if device == "cpu" else max(1, -(-COPY_BYTES // batch_bytes))
    pages = copies * batch * per_seq + 1
    k = torch.randn(pages, page, kv_heads, dim, generator=g, device=device).to(torch.bfloat16)
    v = torch.randn(pages, page, kv_heads, dim, generator=g, device=device).to(torch.bfloat16)
    order = torch.randperm(pages - 1, generator=g, device=device) + 1
    tables = [t.view(batch, per_seq).contiguous() for t in order[: copies * batch * per_seq].view(copies, -1)]
    return k, v, tables


def gathered(k: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, context, D] in fp32: each sequence's keys (or values) in order."""
    return k[tables].flatten(1, 2)[:, :context].transpose(1, 2).float()


def time_ms(fn: Any, device: str, copies: int = 1) -> float:
    """Milliseconds a call of `fn(i)` (i: which copy of the inputs) takes. On CUDA: at least 16
    calls, cycling through the copies, captured in one CUDA graph and replayed (no host launch
    gaps in the time), the median of REPLAYS replays per call. On a CPU (the interpreter) one
    call: it proves the kernel runs; its time means nothing."""
    if device == "cpu":
        start = time.perf_counter()
        fn(0)
        return 1e3 * (time.perf_counter() - start)
    calls = max(copies, 16)
    for i in range(min(copies, 2)):
        fn(i)  # compiled and warm, outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def load_before(directory: str | None, name: str) -> Any:
    path = directory and os.path.join(directory, f"{name}.py")
    if not path or not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location(f"before_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(module: Any, before: Any, sweep: list[dict]) -> list[tuple[str, Any, dict]]:
    out = [("default", module, {})] + [(json.dumps(kw), module, kw) for kw in sweep]
    return out + ([("before", before, {})] if before is not None else [])


def decode_case(
    kernel: Any, before: Any, batch: int, context: int, device: str, sweep: list[dict], peak: tuple
) -> list[dict]:
    q_heads, kv_heads, dim, page = 32, 8, 64, 16
    k, v, tables = paged(batch, context, kv_heads, dim, page, device, seed=batch)
    q = torch.randn(batch, q_heads, dim, device=device).to(torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    scale = dim**-0.5
    keys, values = gathered(k, tables[0], context), gathered(v, tables[0], context)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None], keys, values, scale=scale, enable_gqa=True
    )[:, :, 0]
    nbytes = 2 * batch * context * kv_heads * dim * k.element_size()
    rows = []
    for name, module, kw in variants(kernel, before, sweep):
        row = {"kernel": "decode", "batch": batch, "context": context, "variant": name}
        try:
            fn = lambda i, m=module, kw=kw: m.paged_decode(q, k, v, tables[i], lens, scale, None, **kw)  # noqa: E731
            row["max_err"] = (fn(0).float() - ref).abs().max().item()
            row["ms"] = time_ms(fn, device, len(tables))
            row["GB/s"] = nbytes / row["ms"] / 1e6
            row["of_peak"] = row["GB/s"] * 1e9 / peak[0] if peak else None
        except Exception as e:  # a setting this kernel does not take, or a failure: recorded
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def prefill_case(
    kernel: Any, before: Any, batch: int, new: int, cached: int, device: str, sweep: list[dict], peak: tuple
) -> list[dict]:
    q_heads, kv_heads, dim, page = 32, 8, 128, 4
    context = cached + new
    k, v, tables = paged(batch, context, kv_heads, dim, page, device, seed=batch + 1)
    q = torch.randn(batch * new, q_heads, dim, device=device).to(torch.bfloat16)
    starts = torch.arange(0, batch * new, new, device=device)
    q_lens = torch.full((batch,), new, dtype=torch.int64, device=device)
    lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    scale = dim**-0.5
    keys, values = gathered(k, tables[0], context), gathered(v, tables[0], context)
    mask = torch.arange(context, device=device)[None, :] <= (cached + torch.arange(new, device=device))[:, None]
    ref = (
        torch.nn.functional.scaled_dot_product_attention(
            q.float().view(batch, new, q_heads, dim).transpose(1, 2),
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        .transpose(1, 2)
        .reshape(batch * new, q_heads, dim)
    )
    flops = 4 * batch * q_heads * dim * sum(cached + i + 1 for i in range(new))
    rows = []
    for name, module, kw in variants(kernel, before, sweep):
        row = {"kernel": "prefill", "batch": batch, "new": new, "cached": cached, "variant": name}
        out = torch.empty_like(q)
        try:
            fn = lambda i, m=module, kw=kw, out=out: m.paged_prefill(  # noqa: E731
                q, k, v, tables[i], starts, q_lens, lens, scale, None, out, max_query_len=new, **kw
            )
            fn(0)
            row["max_err"] = (out.float() - ref).abs().max().item()
            row["ms"] = time_ms(fn, device, len(tables))
            row["TFLOP/s"] = flops / row["ms"] / 1e9
            row["of_peak"] = row["TFLOP/s"] * 1e12 / peak[1] if peak else None
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def sampler_case(sampling: Any, batch: int, device: str) -> list[dict]:
    logits = torch.randn(batch, VOCAB, device=device)
    uniforms = torch.rand(batch, dtype=torch.float64, device=device)
    fn = lambda i: sampling.sample_rows(logits, uniforms)  # noqa: E731
    return [{"kernel": "sampler", "batch": batch, "variant": "default", "us": 1e3 * time_ms(fn, device)}]


def print_table(rows: list[dict]) -> None:
    print("| kernel | shape | variant | ms | throughput | of peak | max abs err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        shape = {"decode": f"B={r['batch']} x {r.get('context')}", "sampler": f"B={r['batch']} x {VOCAB}"}.get(
            r["kernel"], f"B={r['batch']} x {r.get('new')} new over {r.get('cached')}"
        )
        if "error" in r:
            print(f"| {r['kernel']} | {shape} | {r['variant']} | failed: {r['error']} |")
            continue
        speed = r.get("GB/s") and f"{r['GB/s']:.0f} GB/s" or r.get("TFLOP/s") and f"{r['TFLOP/s']:.1f} TFLOP/s"
        ms = f"{r['ms']:.3f}" if "ms" in r else f"{r['us']:.1f} µs"
        peak = f"{r['of_peak']:.0%}" if r.get("of_peak") is not None else "-"
        err = f"{r['max_err']:.1e}" if "max_err" in r else "-"
        print(f"| {r['kernel']} | {shape} | {r['variant']} | {ms} | {speed or '-'} | {peak} | {err} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes, no sweep: a smoke run (CPU interpreter)")
    ap.add_argument("--before", default=None, help="a folder with earlier decode_attention.py / prefill_attention.py")
    ap.add_argument("--no-sweep", action="store_true", help="defaults (and --before) only")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "gpu"))
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    from treeserve.kernels.triton import decode_attention, prefill_attention, sampling

    os.makedirs(args.out, exist_ok=True)
    key = gpu_key(args.device, None) if args.device.startswith("cuda") else None
    peak = GPUS[key] if key else None
    sweep = not (args.tiny or args.no_sweep)
    decode_before = load_before(args.before, "decode_attention")
    prefill_before = load_before(args.before, "prefill_attention")
    cases = (
        [("decode", 2, 40), ("prefill", 2, 8, 24), ("sampler", 2)]
        if args.tiny
        else [
            ("decode", 512, 700),
            ("decode", 64, 700),
            ("decode", 16, 700),
            ("prefill", 64, 100, 300),
            ("prefill", 256, 100, 300),
            ("sampler", 1),
            ("sampler", 512),
        ]
    )
    doc = {"device": torch.cuda.get_device_name() if key else args.device, "gpu": key, "peak": peak, "rows": []}
    for case in cases:
        if case[0] == "decode":
            rows = decode_case(
                decode_attention, decode_before, *case[1:], args.device, DECODE_SWEEP if sweep else [], peak
            )
        elif case[0] == "prefill":
            rows = prefill_case(
                prefill_attention, prefill_before, *case[1:], args.device, PREFILL_SWEEP if sweep else [], peak
            )
        else:
            rows = sampler_case(sampling, case[1], args.device)
        doc["rows"] += rows
        for r in rows:
            print(json.dumps(r), flush=True)
        with open(os.path.join(args.out, "kernels.json"), "w") as f:
            json.dump(doc, f, indent=1)
    print_table(doc["rows"])


if __name__ == "__main__":
    main()
