"""treeserve's beam search on a search workload (run in a subprocess by bench/search.py).

Usage: python bench/peers/run_treeserve_search.py WORKLOAD_JSON OUT_JSON [--reference] [--int8]
       [--quant-activations=bf16] [--speculative-config JSON] [--async-scheduling]

The same settings as the peers get, through `treeserve eval`'s code path (`run_eval`) with
every optimisation on, or the reference mode (no caches, one problem at a time); `--int8`
runs both models with int8 weights (`--quantization int8 --prm-quantization int8`), and
`--quant-activations=bf16` multiplies them with bf16 activations (AMX tiles). The last
iteration samples to EOS (`final_to_eos`), as search-and-learn does. `--speculative-config`
turns on the generator's speculative decoding (issue 35), `--async-scheduling` overlapped
steps (issue 52; off by default on a CPU). Model loading is not
timed; the search is, from the first problem to the last.
"""

from __future__ import annotations

import json
import sys

from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig


def main() -> None:
    args = sys.argv[1:]
    spec = None
    if "--speculative-config" in args:
        at = args.index("--speculative-config")
        spec, args = json.loads(args[at + 1]), args[:at] + args[at + 2 :]
    workload_path, out_path = [arg for arg in args if not arg.startswith("--")][:2]
    with open(workload_path) as f:
        w = json.load(f)
    settings = EvalSettings(
        dataset="inline",
        generator=ModelSettings(w["generator"], speculative_config=spec),
        prm=ModelSettings(w["prm"]),
        runtime=RuntimeSettings.from_flat(
            dtype=w["dtype"], kv_cache_memory=w["kv_gib"] << 30, device=w.get("device", "cpu")
        ),
        reference="--reference" in sys.argv,
        progress=False,
    )
    for model in (settings.generator, settings.prm):
        if "--int8" in sys.argv:
            model.quantization = "int8"
        if "--quant-activations=bf16" in sys.argv:
            model.quant_activations = "bf16"
        if "--async-scheduling" in sys.argv:
            model.async_scheduling = True
    config = SearchConfig(
        strategy="beam_search",
        n=w["n"],
        beam_width=w["beam_width"],
        num_iterations=w["num_iterations"],
        temperature=w["temperature"],
        top_p=w["top_p"],
        max_tokens=w["max_tokens"],
        agg=w["agg"],
        final_to_eos=True,
        fixed_steps=w["fixed_steps"],
        seed=w["seed"],
    )
    records = [{"problem": p["problem"], "answer": p["answer"], "unique_id": p["unique_id"]} for p in w["problems"]]
    results = run_eval(settings, config, inline=records)
    s = results["summary"]
    problems = [
        {
            "unique_id": p["unique_id"],
            "completions": [{"text": c["text"], "step_scores": c["step_scores"]} for c in p["completions"]],
        }
        for p in results["problems"]
    ]
    out = {
        "system": "treeserve-reference" if settings.reference else "treeserve",
        "wall_s": s["wall_time_s"],
        "generated_tokens": s["generated_tokens"],
        "prm_tokens_prefilled": s["prm_tokens_prefilled"],
        "prm_unique_tokens": s["prm_unique_tokens"],
        "problems": problems,
    }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
