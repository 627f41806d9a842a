"""The `treeserve` command line. Each subcommand parses its flags and calls the public API.

    treeserve generate [PROMPT ...] [--model DIR] [--chat] [--n N] [--temperature T] ...

With no model given, commands use the arithmetic generator the project ships
(treeserve/assets/arith-generator), so they run on a fresh machine with no downloads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_GENERATOR = ASSETS / "arith-generator"
DEFAULT_PROBLEMS = ["Compute (12 + 7) * 3 - 15.", "Compute 48 - 6 * 7 + 5."]


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_GENERATOR), help="Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV budget in bytes (default: a fraction of RAM)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def cmd_generate(args: argparse.Namespace) -> int:
    from treeserve import LLM, SamplingParams

    chat = args.chat or (args.model == str(DEFAULT_GENERATOR) and not args.raw)
    prompts = args.prompts or DEFAULT_PROBLEMS
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop or None,
    )
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    loaded = time.perf_counter()
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    done = time.perf_counter()
    tokens = 0
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"=== {prompt}")
        for c in out.outputs:
            tokens += len(c.token_ids)
            print(f"--- completion {c.index} ({len(c.token_ids)} tokens, finish={c.finish_reason})")
            print(c.text)
    print(
        f"\n{len(prompts)} prompts x n={args.n}: {tokens} tokens in {done - loaded:.2f}s "
        f"({tokens / max(done - loaded, 1e-9):.0f} tok/s); model loaded in {loaded - start:.2f}s",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treeserve", description="LLM inference runtime for test-time search")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions (default: the shipped arithmetic model)")
    _add_engine_flags(gen)
    gen.add_argument("prompts", nargs="*", help="prompts (default: two arithmetic problems)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text even to the default model")
    gen.add_argument("--n", type=int, default=4)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"treeserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
