"""The quantised matmuls (`kernels/triton/quant_matmul.py`) on one GPU: W4A16 decode bandwidth
and FP8 prefill throughput, each against its target in issue 88.

    python bench/gpu_quant.py                          # a CUDA GPU: JSON lines, then a table
    python bench/gpu_quant.py --out bench/out/gpu      # also OUT/quant.json
    python bench/gpu_quant.py --device cpu --tiny      # a smoke run: Triton's interpreter, tiny shapes

Cases (random weights drawn on the device, no downloads; [n, k] = out x in features, an 8B
Llama's q/o projection and its gate/up):
* W4A16 decode: `int_weight_matmul` at m = 1, 4, 16 rows of bf16 on [4096, 4096] and
  [14336, 4096], groups of 128 with zero points. Bytes: the codes, bf16 scales and zeros read
  once; GB/s against the card's HBM bandwidth (target >= 60% at 1-16 rows). Beside it, bf16
  `torch.matmul` on the same shape (4x the weight bytes). The weights cycle through copies of
  256 MiB in all, so reads come from HBM, not the L2 cache.
* FP8 prefill: `fp8_matmul` (per-row activation quantisation included, per-channel weight
  scales) at m = 512 ... 4096 on the same shapes against bf16 `torch.matmul`: TFLOP/s (2mnk)
  and the ratio (target >= 1.5x on an H100/H200). The backend it took is recorded.
Every output is checked against its PyTorch reference (max error relative to the largest
value). Times: `gpu_kernels.time_ms` (calls captured in a CUDA graph, median of 7 replays).
On a CPU only `--tiny` runs (it proves the script and kernels execute; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

COPY_BYTES = 256 << 20
GROUP = 128
SHAPES = [(4096, 4096), (14336, 4096)]
DECODE_ROWS = [1, 4, 16]
PREFILL_ROWS = [512, 1024, 2048, 4096]
TINY_SHAPES = [(96, 256)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def w4_weights(n: int, k: int, copies: int, device: str) -> list[tuple[torch.Tensor, ...]]:
    """`copies` independent (codes, scales, zeros) of a W4A16 [n, k] weight, groups of GROUP."""
    g = torch.Generator(device=device).manual_seed(n + k)
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 256, (n, k // 2), generator=g, device=device, dtype=torch.uint8)
        scales = (torch.rand(n, k // GROUP, generator=g, device=device) * 0.02).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (n, k // GROUP), generator=g, device=device, dtype=torch.uint8)
        out.append((codes, scales, zeros))
    return out


def decode_case(qm: Any, time_ms: Any, n: int, k: int, rows: list[int], device: str, peak: tuple | None) -> list[dict]:
    per_copy = n * k // 2 + n * (k // GROUP) * 3  # nibbles, bf16 scales, uint8 zeros
    copies = 1 if device == "cpu" else max(1, -(-COPY_BYTES // per_copy))
    weights = w4_weights(n, k, copies, device)
    dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(1 if device == "cpu" else 2)]
    matmul = qm.int_weight_matmul if device != "cpu" else qm.int_weight_matmul_triton
    out = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        row = {"case": "w4a16-decode", "m": m, "n": n, "k": k, "group": GROUP, "copies": copies}
        codes, scales, zeros = weights[0]
        want = qm.int_weight_matmul_reference(x, codes, 4, scales, zeros, GROUP)
        row["rel_err"] = rel_err(matmul(x, codes, 4, scales, zeros, GROUP), want)
        row["ms"] = time_ms(
            lambda i, x=x: matmul(x, weights[i][0], 4, weights[i][1], weights[i][2], GROUP), device, copies
        )
        row["GB/s"] = per_copy / row["ms"] / 1e6
        row["of_hbm"] = row["GB/s"] * 1e9 / peak[0] if peak else None
        row["bf16_ms"] = time_ms(lambda i, x=x: x @ dense[i % len(dense)].T, device, len(dense))
        row["speedup_vs_bf16"] = row["bf16_ms"] / row["ms"]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def prefill_case(qm: Any, time_ms: Any, n: int, k: int, rows: list[int], device: str, peak: tuple | None) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(n)
    dense = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    scale = dense.float().abs().amax(dim=1) / 448
    weight = (dense.float() / scale[:, None]).to(torch.float8_e4m3fn)
    fp8 = qm.fp8_matmul if device != "cpu" else qm.fp8_matmul_scaled
    backend = qm.fp8_backend(torch.device(device), n, k) if device != "cpu" else "scaled_mm (torch CPU)"
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g, device=device, dtype=torch.bfloat16)
        row = {"case": "fp8-prefill", "m": m, "n": n, "k": k, "backend": backend}
        want = qm.fp8_matmul_reference(x, weight, scale, quantize_activations=backend.startswith("scaled_mm"))
        row["rel_err"] = rel_err(fp8(x, weight, scale), want)
        flops = 2 * m * n * k
        row["ms"] = time_ms(lambda i, x=x: fp8(x, weight, scale), device)
        row["bf16_ms"] = time_ms(lambda i, x=x: x @ dense.T, device)
        row["TFLOP/s"] = flops / row["ms"] / 1e9
        row["bf16_TFLOP/s"] = flops / row["bf16_ms"] / 1e9
        row["speedup_vs_bf16"] = row["bf16_ms"] / row["ms"]
        row["of_bf16_peak"] = row["TFLOP/s"] * 1e12 / peak[1] if peak else None
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def print_table(rows: list[dict]) -> None:
    print("| case | m x n x k | ms | throughput | of peak | bf16 ms | vs bf16 | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["case"] == "w4a16-decode":
            speed, peak = f"{r['GB/s']:.0f} GB/s", r["of_hbm"]
        else:
            speed, peak = f"{r['TFLOP/s']:.1f} TFLOP/s ({r['backend']})", r["of_bf16_peak"]
        peak = f"{peak:.0%}" if peak is not None else "-"
        print(
            f"| {r['case']} | {r['m']} x {r['n']} x {r['k']} | {r['ms']:.4f} | {speed} | {peak} | "
            f"{r['bf16_ms']:.4f} | {r['speedup_vs_bf16']:.2f}x | {r['rel_err']:.1e} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run (on a CPU, Triton's interpreter)")
    ap.add_argument("--out", default=None, help="a folder for quant.json (default: stdout only)")
    args = ap.parse_args()
    if args.device == "cpu":
        if not args.tiny:
            sys.exit(
                "bench/gpu_quant.py measures a GPU: run it with --device cuda on one, or --device cpu --tiny "
                "for a smoke run in Triton's interpreter (its times mean nothing)"
            )
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    elif not torch.cuda.is_available():
        sys.exit(f"bench/gpu_quant.py: --device {args.device} but torch sees no CUDA GPU (--device cpu --tiny smokes)")
    from gpu_kernels import time_ms
    from roofline_floor import GPUS
    from thesis_shapes import gpu_key

    from treeserve.kernels.triton import quant_matmul as qm

    key = gpu_key(args.device, None)
    peak = GPUS.get(key) if key else None
    shapes = TINY_SHAPES if args.tiny else SHAPES
    prefill_rows = [32] if args.tiny else PREFILL_ROWS
    doc = {"device": torch.cuda.get_device_name() if key else args.device, "gpu": key, "peak": peak, "rows": []}
    for n, k in shapes:
        doc["rows"] += decode_case(qm, time_ms, n, k, DECODE_ROWS, args.device, peak)
    for n, k in shapes:
        doc["rows"] += prefill_case(qm, time_ms, n, k, prefill_rows, args.device, peak)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant.json"), "w") as f:
            json.dump(doc, f, indent=1)
    print_table(doc["rows"])


if __name__ == "__main__":
    main()
