"""Model cards (README.md) and eval summaries for the shipped arithmetic checkpoints,
written from the training and evaluation logs so that a rebuild refreshes every number."""

from __future__ import annotations

import json
from pathlib import Path

from tools.arith.common import (
    BAD_ID,
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    GOOD_ID,
    PAD_ID,
    SHIPPED_SEED,
    SPECIAL_TOKENS,
    STEP_TAG_ID,
    VOCAB,
    read_json,
    write_json,
)
from tools.arith.data import NOISE_LEVEL_SCALE
from tools.arith.evaluate import format_table
from tools.arith.prm_io import PRM_FORMAT
from treeserve.eval.arith import LEVELS

COMMAND = f"python -m tools.arith.build_all --seed {SHIPPED_SEED}"


def _levels_table() -> str:
    rows = ["| level | operations | numbers | results up to |", "|---|---|---|---|"]
    for lv, spec in LEVELS.items():
        rows.append(f"| {lv} | {spec.n_ops} | 1-{spec.max_leaf} (factors 2-9) | {spec.max_value} |")
    return "\n".join(rows)


def _arch(config: dict, n_params: int) -> str:
    return (
        f"Llama (`LlamaForCausalLM`), {n_params / 1e6:.2f}M parameters: hidden {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} attention heads "
        f"({config['num_key_value_heads']} KV heads, head dim {config['head_dim']}), "
        f"MLP {config['intermediate_size']}, "
        f"vocab {config['vocab_size']}, RoPE theta {config['rope_parameters']['rope_theta']:g}, "
        f"tied input/output embeddings, {config['max_position_embeddings']} positions; weights stored in bf16."
    )


def minutes_text(seconds: float | None) -> str:
    """Minutes, or a plain statement that the run's time was not recorded."""
    return "not recorded" if seconds is None else f"{seconds / 60:.1f}"


def _phases(phases: list[dict]) -> str:
    rows = [
        "| phase | steps | warm (level 1) | drill fraction | noise per digit | peak lr | threads | minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, p in enumerate(phases, 1):
        rows.append(
            f"| {k} | {p['steps']} | {p['warm_steps']} | {p['drill_fraction']} | {p['noise_per_digit']} "
            f"| {p['peak_lr']} | {p['threads']} | {minutes_text(p['train_seconds'])} |"
        )
    return "\n".join(rows)


def _tokens() -> str:
    specials = ", ".join(f"`{t}`={VOCAB[t]}" for t in SPECIAL_TOKENS)
    return (
        "Numbers as tokens (`tokenizers` WordLevel, `Fuse` decoder): every run of up to 3 digits (leading zeros "
        "included) is one token, longer runs split into 3-digit pieces, every other character (`\\n` and "
        "printable ASCII) is one token, unknown characters map to `<|unk|>`. "
        f"Special tokens: {specials}. The tokenizer adds no special tokens by itself; the chat template "
        "writes `<|bos|>`."
    )


def generator_card(ckpt: Path, train: dict, results: dict) -> str:
    config = read_json(ckpt / "config.json")
    minutes = minutes_text(train["train_seconds"])
    return f"""# arith-generator

The generator of treeserve's built-in arithmetic world: a tiny Llama that solves multi-step
integer arithmetic problems (`treeserve.eval.arith`) step by step, imperfectly on purpose,
so that test-time search (best-of-N, beam search with the `arith-prm` PRM) has mistakes to fix.
It runs on a laptop CPU and needs no download. It is not a general model.

## Format

Chat template (Jinja, `tokenizer_config.json`); system messages are dropped (the model follows
no instructions), the problem is the user message:

```
{CHAT_TEMPLATE}
```

e.g. `<|bos|><|user|>Compute 3 * (5 - 2) + 4.<|end|><|assistant|>`. The answer is one operation per
step, steps separated by a blank line, then the boxed answer and EOS (`<|end|>`, id {EOS_ID}):

```
5 - 2 = 3, leaving 3 * 3 + 4.

3 * 3 = 9, leaving 9 + 4.

9 + 4 = 13.

The answer is \\boxed{{13}}.<|end|>
```

Search stops steps at `"\\n\\n"`. Ids: bos {BOS_ID}, eos {EOS_ID}, pad {PAD_ID}.

## Model

{_arch(config, train["parameters"])}

{_tokens()}

## Data

Problems from `treeserve.eval.arith.make_problem` (levels below), drawn from seeded streams;
the 500 problems of the test split (`arith_dataset(500, seed=0)`) are never trained on.
{_levels_table()}

Targets come from a noisy teacher (`tools/arith/data.py`): each step's result is replaced by a
plausible wrong value (off by 1-2, off by a power of ten, swapped or changed digit) with
probability p x digits(result) x level scale {NOISE_LEVEL_SCALE}
(p: "noise per digit" below), and later steps use the wrong value consistently. Training
({len(train["phases"])} phases, each continuing from the one before): batches of ~512 tokens; a
fraction of them are arithmetic drills (the operations of reference solutions, one `a op b = c.`
per line, loss on the results), the rest chat-formatted problems of one level each with
noisy-teacher answers (loss on the answer and EOS). Curriculum: level 1 only for the warm
batches, then one more level unlocked every 7.5% of the rest, then uniform. AdamW (weight decay
0.1), cosine decay to 10%, bf16 autocast, seed {train["seed"]}.

{_phases(train["phases"])}

The last phase is a copy phase: chat rows only, the noisy teacher at a higher rate. After phase 2
the model miscopied often at T=0.4-0.8 (an operand copied wrong from the expression, e.g.
`6 + 15 = 21` for `(6 + 14) + 4`, or a wrong rewritten rest): 39% of the first mistakes of its
samples, 10% after the copy phase (the PRM card). The PRM checks results well and copies hardly
at all (its card), so beam search with it steered towards those miscopies. The copy phase
sharpens the copies while the noisier teacher keeps the sampled results spread: the error mix
PRM-guided search can fix (the results below; `docs/prm-copy-check.md`, "A generator that
copies"). The PRM is built on the generator after phase 2 (`common.PRM_BASE_DIR`).

## Training

`{COMMAND}` (this model: `python -m tools.arith.train_generator --seed {train["seed"]}`) on a 2-core
CPU (threads per phase in the table above); generator training time in minutes: {minutes}.

**Reproducible on one thread.** Every phase runs on one thread, and there the recipe repeats
bit for bit on the machine that built this checkpoint (AMD EPYC with AVX512-BF16, no AMX): two
runs of phases 1-2 at seed 2 logged the same losses at every log line and wrote byte-identical
weights (2026-11-24), and a third rerun of the whole recipe wrote the phase-2 weights shipped
until then and phase-3 weights identical to a copy phase trained on its own from them. A CPU whose bf16 matmuls
round differently (AMX, say) will train a different generator, and the outcome swings with the
seed and the length of phase 2: at seed 0 the recipe gave greedy 2% at level 5 on this machine;
at seed 2 with phase 2 at 5,000 steps greedy was 55% at level 5 but pass@16 only 19 points above
it (+18 at 3,500 steps). The copy phase's noise is set by the same target: at 0.02-0.04 per digit
pass@16 is under 20 points above greedy at level 4, at 0.08 just under; 0.06 meets it at both
levels (`docs/prm-copy-check.md`). The generator shipped before the seed-2 one (seed 0, phase 2 on
two threads, greedy 100%, 85%, 64%, 44%, 20%) could not be rebuilt.

## Results (test split, `python -m tools.arith.evaluate`)

Greedy on all 100 problems per level; T={results["temperature"]} sampling (top-k/top-p off) with
n={results["n"]} samples for the first {results["per_level_sampled"]} problems of each level (sampled
accuracy = mean over samples). Until this checkpoint the cards sampled the first 50 problems per
level only; halves of a level differ by up to 9 points in pass@16, so greedy and pass@16 are now
measured on the same problems. The old way (pass@16 on the first 50, greedy on all 100) puts this
generator's pass@16 18 and 19 points over greedy at levels 4 and 5; on the first 50 alone, 20 and 24.
PRM column: the `arith-prm` step-level ROC-AUC on those samples.

{format_table(results)}

Numbers are for fp32 compute with these bf16 weights in treeserve's engine (`LLM.chat`, seeded
requests); bf16 compute can differ by a few problems.
"""


STAGE_TEXT = {
    "table": ("the result of every `a op b` (4,647 facts)", "`fact_row`: 8 true facts, loss on each result"),
    "check": ("is a written result right?", "`check_row`: half the results wrong, '+'/'-' at each"),
    "route": ("reading the check at the step tag", "`drill_row`: one fact drill, '+'/'-' at its tags"),
}


def _stage_rows(stages: dict) -> str:
    rows = [
        "| stage | teaches | rows | layers trained | lr | steps | stopped at (held-out) | minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, st in stages.items():
        teaches, rows_text = STAGE_TEXT[name]
        layers = f"{st['extra_layers']} new on top (rest frozen)" if st["extra_layers"] else "all"
        schedule = "cosine" if name == "table" else "constant"
        score = st["log"][-1]["held_out_score"]
        stopped = f"{score:.3f} (target {st['target']})" if score is not None else f"table {st['table_accuracy']:.1%}"
        rows.append(
            f"| {name} | {teaches} | {rows_text} | {layers} | {st['peak_lr']} {schedule} | {st['steps']} "
            f"| {stopped} | {st['train_seconds'] / 60:.1f} |"
        )
    return "\n".join(rows)


def _corruption_rows(corruptions: dict) -> str:
    rows = ["| mistake | first wrong step | right step before it | step AUC |", "|---|---|---|---|"]
    for kind, m in corruptions.items():
        rows.append(f"| {kind} | {m['first_wrong']:.2f} | {m['right_before']:.2f} | {m['auc']:.3f} |")
    return "\n".join(rows)


def _first_mistake_rows(mistakes: dict) -> str:
    rows = ["| first mistake | share of wrong solutions | first wrong step vs good steps: AUC |", "|---|---|---|"]
    for kind, m in mistakes.items():
        rows.append(f"| {kind} | {m['share']:.1%} ({m['solutions']}) | {m['auc']:.3f} |")
    return "\n".join(rows)


def _search_rounds(rounds: list[dict]) -> str:
    if not rounds:
        return ""
    first = rounds[0]
    rows = [
        "| round | started from | distinct final beams mined | with a bad step | mined so far | labelled steps "
        "| AdamW steps | minutes mining + training |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        rows.append(
            f"| {r['round']} | {r['init']} | {r['mined_this_round']} | {r['mined_bad']} | {r['mined_solutions']} "
            f"| {r['steps_labelled']} | {r['optimizer_steps']} | {r['mine_seconds'] / 60:.1f} + "
            f"{r['train_seconds'] / 60:.1f} |"
        )
    return f"""
## Then search rounds

Beam search selects hard on the PRM's score, so the solutions it returns collect the PRM's blind
spots: a step it wrongly likes survives every pruning. Each round (`python -m tools.arith.mine_search`)
runs treeserve's beam search (N=16, beam width 4) with the PRM so far on {first["mined_per_level"]} fresh
training problems of each of levels 4 and 5 at T=0.4 and again at T=0.8, labels every step of every
distinct final beam with `step_labels`, and fine-tunes the PRM on the data above plus every solution
mined so far: every layer, {first["epochs"]} epoch, peak lr {first["peak_lr"]}, the same losses. Mining
runs on one thread, the fine-tuning on two.

{chr(10).join(rows)}
"""


def prm_card(ckpt: Path, train: dict, results: dict) -> str:
    config = read_json(ckpt / "config.json")
    prm = results["prm"]
    rows = ["| level | held-out steps | bad steps | step ROC-AUC |", "|---|---|---|---|"]
    for lv, m in prm["by_level"].items():
        rows.append(f"| {lv} | {m['steps']} | {m['bad_steps']} | {m['auc']:.3f} |")
    rows.append(f"| all | {prm['steps']} | {prm['bad_steps']} | {prm['auc']:.3f} |")
    stage_minutes = sum(st["train_seconds"] for st in train["stages"].values()) / 60
    added = sum(st["extra_layers"] for st in train["stages"].values()) + train["extra_layers"]
    return f"""# arith-prm

The process reward model of treeserve's built-in arithmetic world, Math-Shepherd style: a step
tag after each step, and the score of a step is P('+') against P('-') at its tag. It judges the
steps of `arith-generator` solutions. Not a general model.

## Input format (also in `prm_config.json`)

```
<|bos|><|user|>{{problem}}<|end|><|assistant|>{{step 1}}<|step|>\\n\\n{{step 2}}<|step|>...
```

i.e. `prompt_format + step_separator.join(step + step_tag for step in steps)` with steps stripped
(no trailing blank line). The score of step i is `softmax([logit('+'), logit('-')])[0]` at the
position of the i-th `<|step|>` (the label is the next-token prediction at the tag). Ids: `<|step|>`
{STEP_TAG_ID}, `+` {GOOD_ID}, `-` {BAD_ID}, bos {BOS_ID}, eos {EOS_ID}.

```json
{json.dumps(PRM_FORMAT, indent=2)}
```

## Model

{_arch(config, train["parameters"])}
The {config["num_hidden_layers"] - added} layers of the generator before its copy phase
(`common.PRM_BASE_DIR`) plus {added} added during training (below).
{_tokens()}

## Training: a curriculum, then judged solutions

A PRM can only call `87 + 15 = 101` wrong if it knows that 87 + 15 is 102, compares that with
the 101 written, and reports the comparison at the step's tag. Trained on judged solutions
alone, a model of this size learns none of the three (it learned to judge steps by their depth
and their copying instead, and beam search with it lost to majority voting). So it is taught
one at a time, each stage starting from the last (`python -m tools.arith.facts --stage NAME`;
all rows in the PRM's input format, AdamW, batches of 32 rows, bf16 autocast):

{_stage_rows(train["stages"])}

The table and check rows sit under a problem of one of three kinds (`row_problem`): the row's
first fact alone, a chain that starts with it (as above a real first step), or an unrelated
problem (as above later steps). Under the first kind alone, a seed-2 table model got the first
step under `Compute (a op b) + 7.` right only 49% of the time, and the route above it stalled
at 0.86. The check forms late: it stays at chance for about 2,000 steps and then climbs (a
decaying learning rate stalls it, hence the constant one). The route needs 2 new layers: with 1
it stayed at chance for 4,250 steps; with 2 it leaves chance after 500-750 steps.

Then the PRM itself (`python -m tools.arith.train_prm`), {train["extra_layers"]} more new layers and
all earlier ones trained (those at {train["base_lr_scale"]} x the lr): the cross-entropy of
the label ('+' good, '-' bad) at each tag, plus {train["lm_weight"]} x the next-token loss of each
good step's result (keeps the table) and {train["fact_check_weight"]} x '+'/'-' at each result
token (keeps the check). A step is good iff its arithmetic is right and it uses correct earlier
results (`treeserve.eval.arith_labels.step_labels`: the step is an operation of the true current
expression with correct operands, its result and its rewritten rest are exact; the final step is
good iff its boxed value is the true answer). Data: {train["on_policy_solutions"]} samples of
the generator before its copy phase (T=0.8 and T=1.0) on training problems; {train["synthetic_solutions"]} synthetic
solutions (reference solutions corrupted on purpose: wrong result, several slips, miscopied
operand, miscopied rest, wrong order of operations, wrong final answer, each next to its correct
reference); {train["drills"]} fact drills (one pass over the table, each fact right and wrong), so
the route stays in use. {train["steps_labelled"]} labelled steps, {train["bad_steps"]} bad;
{train["optimizer_steps"]} AdamW steps ({train["epochs"]} epochs, ~{train["max_tokens_per_batch"]} tokens
each), peak lr {train["peak_lr"]}, seed {train["seed"]}.

`{COMMAND}` runs every stage; on this 2-core CPU (2 threads) the curriculum took {stage_minutes:.0f} min,
sampling the generator {train["sample_seconds"] / 60:.1f} min and the PRM {train["train_seconds"] / 60:.1f} min.
Unlike the generator's, this part runs on two threads (`PRM_THREADS`); this checkpoint's stages ran one
by one with the same calls. A rerun of the table stage logged the same losses for 750 steps (2026-11-24),
but a whole rerun has not been compared.
{_search_rounds(train.get("search_rounds", []))}
## Results

Step-level ROC-AUC on held-out generator samples (test-split problems, T={results["temperature"]},
{results["n"]} samples for each of the first {results["per_level_sampled"]} problems per level),
labels from `step_labels`:

{chr(10).join(rows)}

Does it check the step itself? Fact drills (one operation, right or a plausible wrong result,
nothing else to go on; 0.5 = no check): step AUC **{prm["fact_drill_auc"]:.3f}**. Copy drills (a step
with an operand or a rest number copied wrong, against the right step after the same steps,
`tools.arith.copy_drills`): step AUC **{prm.get("copy_drill_auc", float("nan")):.3f}**. Synthetic mistakes
on levels 3-5, the mean score of the first wrong step against the right step just before it
(`tools.arith.evaluate.corruption_check`; step AUC on generator samples also rewards knowing that
deep steps are more often wrong, this does not):

{_corruption_rows(prm.get("corruptions", dict()))}

And the generator's own mistakes: the held-out samples above, by the kind of their first wrong
step (`treeserve.eval.arith_labels.step_verdicts`: "operation" is an `a op b` the true state does
not have, mostly a miscopied operand; "rest" is a right result with a miscopied rest):

{_first_mistake_rows(prm.get("first_mistakes", dict()))}

## Known limitation: it checks results, not copies

It catches a wrong result and a wrong order of operations, but a miscopied operand or rest much
less well (the rows "operation" and "rest" above; the search round raised them, but not to the
level of the result check), and a step that differs from the right one only in the miscopy not
at all (the copy drills above). Checking a copy means comparing the numbers of a step with those of
the expression before it, a skill the curriculum does not teach yet. Beam search selects hard on
this PRM's score, so it steered towards those miscopies, most at T=0.8, until the generator
learned to copy (its card, the copy phase): its samples now rarely miscopy, and what is left for
the PRM to judge is mostly results. What was tried to teach the check: `docs/prm-copy-check.md`.
"""


def write_cards(generator_dir: Path, prm_dir: Path, gen_train: dict, prm_train: dict, results: dict) -> None:
    (generator_dir / "README.md").write_text(generator_card(generator_dir, gen_train, results))
    (prm_dir / "README.md").write_text(prm_card(prm_dir, prm_train, results))
    summary = {k: v for k, v in results.items() if k != "prm"}
    write_json(generator_dir / "eval.json", {**summary, "train_seconds": gen_train["train_seconds"]})
    write_json(prm_dir / "eval.json", {**results["prm"], "train_seconds": prm_train["train_seconds"]})
