"""lm-evaluation-harness against `treeserve serve`: a log-likelihood task and a generation task.

    bash bench/setup_lmeval.sh                                   # .venv-lmeval with lm-eval
    python bench/lm_eval_harness.py --problems 40 --out bench/out/lm_eval

Two local tasks are written (YAML + JSONL, from the arithmetic world, levels 3-4, seed 0):
* `arith_mc` (multiple choice, scored by log-likelihood): the chat-rendered problem and its
  worked solution up to the last step's "=", four choices (the right value and three wrong
  ones); `acc` is the share where the right value is the most likely continuation.
* `arith_gen_text` / `arith_gen_chat` (generate_until, greedy): the problem, chat-rendered as
  text for `local-completions`, as a message for `local-chat-completions`
  (`--apply_chat_template`); exact match of the `\\boxed{}` answer.

The script starts `treeserve serve` (the shipped generator, fp32) on a free port, runs
`lm_eval --model local-completions` (arith_mc, arith_gen_text) and `lm_eval --model
local-chat-completions` (arith_gen_chat), prints the harness's metrics, and checks every
per-choice log-likelihood the harness logged against `LLM.score` offline on the same
tokens (fp32): the largest difference is printed, and above 1e-4 the script fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import socket
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from treeserve import LLM, ScoreParams  # noqa: E402
from treeserve.eval.arith import arith_dataset  # noqa: E402
from treeserve.eval.runner import DEFAULT_GENERATOR  # noqa: E402

LMEVAL = os.environ.get("LMEVAL", os.path.join(ROOT, ".venv-lmeval", "bin", "lm_eval"))
MODEL = "arith"

MC_YAML = """task: arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""

GEN_YAML = """task: arith_gen_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{{field}}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["<|end|>"]
  max_gen_toks: 256
  do_sample: false
  temperature: 0
filter_list:
  - name: boxed
    filter:
      - function: regex
        regex_pattern: "boxed\\\\{{(-?[0-9]+)\\\\}}"
      - function: take_first
metric_list:
  - metric: exact_match
"""


def write_tasks(directory: str, problems: int) -> list[dict]:
    """The task files; returns the multiple-choice docs (to check the harness's numbers)."""
    llm_tokenizer = LLM(DEFAULT_GENERATOR, dtype="float32", kv_cache_memory=8 << 20).get_tokenizer()
    rng = random.Random(0)
    mc, gen = [], []
    for record in arith_dataset(size=problems, seed=0, levels=(3, 4)):
        steps = record["solution"].split("\n\n")
        last = next(i for i in range(len(steps) - 1, -1, -1) if " = " in steps[i])
        left, right = steps[last].split(" = ", 1)
        value = int(right.split(",")[0].rstrip("."))
        tail = right[len(str(value)) :]
        prefix = "\n\n".join([*steps[:last], left + " ="])
        messages = [{"role": "user", "content": record["problem"]}, {"role": "assistant", "content": prefix}]
        context = llm_tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        wrong = sorted({value + 1, value - 1, value + 10, value * 2, -value} - {value})
        choices = [value, *rng.sample(wrong, 3)]
        rng.shuffle(choices)
        mc.append({"context": context, "choices": [f" {c}{tail}" for c in choices], "target": choices.index(value)})
        chat = [{"role": "user", "content": record["problem"]}]
        text = llm_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        gen.append({"problem": record["problem"], "text": text, "answer": record["answer"]})
    for name, docs in (("arith_mc.jsonl", mc), ("arith_gen.jsonl", gen)):
        with open(os.path.join(directory, name), "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(os.path.join(directory, "arith_mc.yaml"), "w") as f:
        f.write(MC_YAML.format(data=os.path.join(directory, "arith_mc.jsonl")))
    for kind, field in (("text", "text"), ("chat", "problem")):
        with open(os.path.join(directory, f"arith_gen_{kind}.yaml"), "w") as f:
            f.write(GEN_YAML.format(kind=kind, field=field, data=os.path.join(directory, "arith_gen.jsonl")))
    return mc


def start_server(port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "treeserve.cli",
        "serve",
        "--model",
        DEFAULT_GENERATOR,
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "256M",
        "--port",
        str(port),
    ]
    server = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("treeserve serve did not come up")


def run_lm_eval(model: str, url: str, tasks: str, task_dir: str, out: str, chat: bool) -> dict:
    args = f"base_url={url},model={MODEL},num_concurrent=1,max_retries=1"
    if not chat:
        args += f",tokenizer_backend=huggingface,tokenizer={DEFAULT_GENERATOR}"
    cmd = [
        LMEVAL,
        "--model",
        model,
        "--model_args",
        args,
        "--tasks",
        tasks,
        "--include_path",
        task_dir,
        "--output_path",
        out,
        "--log_samples",
        "--seed",
        "0",
    ]
    if chat:
        cmd.append("--apply_chat_template")
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    (results,) = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)[-1:]
    with open(results) as f:
        return json.load(f)["results"]


def harness_loglikelihoods(out: str) -> dict[tuple[int, int], float]:
    """(doc index, choice index) -> the log-likelihood the harness computed from our server."""
    (path,) = glob.glob(os.path.join(out, "**", "samples_arith_mc_*.jsonl"), recursive=True)[-1:]
    found = {}
    with open(path) as f:
        for line in f:
            sample = json.loads(line)
            for choice, resp in enumerate(sample["filtered_resps"]):
                found[(sample["doc_id"], choice)] = float(resp[0])
    return found


def offline_loglikelihood(llm: LLM, context: str, continuation: str) -> float:
    """As the harness tokenizes a pair (trailing spaces of the context move to the continuation;
    the continuation's tokens are what the whole adds to the context's), scored offline."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = llm.get_tokenizer().encode
    whole, ctx = encode(context + continuation, False), encode(context, False)
    cont = whole[len(ctx) :]
    ids = sorted(set(cont))
    out = llm.score([ctx + cont], ScoreParams(positions=list(range(len(ctx) - 1, len(whole) - 1)), token_ids=ids))[0]
    return sum(out.logprobs[i, ids.index(t)].item() for i, t in enumerate(cont))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(HERE, "out", "lm_eval"))
    args = ap.parse_args()
    task_dir = os.path.join(args.out, "tasks")
    os.makedirs(task_dir, exist_ok=True)
    docs = write_tasks(task_dir, args.problems)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(port)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        completions = run_lm_eval(
            "local-completions",
            f"{base}/completions",
            "arith_mc,arith_gen_text",
            task_dir,
            os.path.join(args.out, "completions"),
            chat=False,
        )
        chat = run_lm_eval(
            "local-chat-completions",
            f"{base}/chat/completions",
            "arith_gen_chat",
            task_dir,
            os.path.join(args.out, "chat"),
            chat=True,
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps({**completions, **chat}, indent=1))
    llm = LLM(DEFAULT_GENERATOR, dtype="float32", kv_cache_memory=64 << 20)
    harness = harness_loglikelihoods(os.path.join(args.out, "completions"))
    worst = 0.0
    for (doc, choice), value in harness.items():
        ours = offline_loglikelihood(llm, docs[doc]["context"], docs[doc]["choices"][choice])
        worst = max(worst, abs(ours - value))
    print(f"{len(harness)} harness log-likelihoods vs LLM.score offline: max |difference| {worst:.2e}")
    if len(harness) != 4 * len(docs) or not math.isfinite(worst) or worst > 1e-4:
        sys.exit("the harness's log-likelihoods differ from the offline engine's")


if __name__ == "__main__":
    main()
