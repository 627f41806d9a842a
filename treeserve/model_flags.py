"""The command line's per-model flags, made from one table (`MODEL_FLAGS`) for every subcommand.

Each row is a setting of `ModelSettings` (its own or one of its sub-configs'): the generator's
flag (`--quantization`), the PRM's (`--prm-quantization`) and the verifier's. A row marked
`both` sets every model unless the model's own flag is given. `model_settings` reads one
model's settings back from the flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from treeserve.config import KV_CACHE_DTYPES
from treeserve.runtime.model_settings import ModelSettings

PRM_STYLES = ["step_tag", "rlhflow", "reward_head", "value_head", "token_classification", "orm"]
LIKEWISE = "the PRM's, likewise"


@dataclass(frozen=True)
class ModelFlag:
    field: str  # the setting: a ModelSettings field or one of its sub-configs' fields
    options: dict = field(default_factory=dict)  # add_argument's keywords but help (the generator's flag's)
    help: str | None = None
    prm_help: str | None = LIKEWISE
    generator: bool = True
    prm: bool = True
    both: bool = False  # the generator's flag sets the PRM's (and verifier's) too, unless its own is given
    verifier: bool | None = None  # the verifier has this flag (None: as the PRM)
    verifier_help: str | None = None  # the verifier's flag's help (None: "the verifier's, likewise")

    def has(self, model: str) -> bool:
        if model == "generator":
            return self.generator
        if model == "verifier" and self.verifier is not None:
            return self.verifier
        return self.prm

    def names(self, model: str) -> list[str]:
        if self.field == "path":
            return ["--generator", "--model"] if model == "generator" else [f"--{model}"]
        flag = "--" + self.field.replace("_", "-")
        return [flag] if model == "generator" else [f"--{model}-" + flag[2:]]

    def dest(self, model: str) -> str:
        """The parsed flags' attribute: `generator`, `prm` and `verifier` for the paths, else the
        field's name (the generator's) or it after `prm_` or `verifier_`."""
        if self.field == "path":
            return model
        return self.field if model == "generator" else f"{model}_{self.field}"


MODEL_FLAGS = (
    ModelFlag(
        "path",
        help="the generator: a checkpoint directory or .gguf file (default: the shipped generator)",
        prm_help="the PRM: a checkpoint directory (default: the shipped PRM; serve: only with no --model)",
        verifier_help="an outcome reward model (style orm) that re-scores and re-ranks the completions "
        "every strategy returns (default: none)",
    ),
    ModelFlag(
        "style",
        {"choices": PRM_STYLES},
        generator=False,
        prm_help="how the PRM reads steps (default: its config's style)",
        verifier_help="the verifier's input format: orm, the only one a verifier may have (default: its config's)",
    ),
    ModelFlag(
        "quantization",
        {"choices": ["int8", "gguf"]},
        "int8: quantise a Hugging Face checkpoint per channel at load; gguf: run a GGUF "
        "file's quantised blocks (the default for a GGUF file on a CPU)",
    ),
    ModelFlag(
        "dequantize",
        {"action": "store_true", "default": False},
        "load GGUF files dense (dequantised), as before",
        both=True,
    ),
    ModelFlag(
        "quant_activations",
        {"choices": ["int8", "bf16"]},
        "what quantised matmuls take activations as (every model): int8 (the default; "
        "llama.cpp's way, fastest at a few rows) or bf16 (on an AMX CPU: bf16 tiles of the "
        "dequantised weights, the dequantised model's exact outputs, for batches of 32+ rows)",
        both=True,
    ),
    ModelFlag(
        "speculative_config",
        {"metavar": "JSON"},
        'speculative decoding, vLLM\'s keys: \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\', method "tree" (drafts from the other beams of a search) or '
        '\'{"model": DIR, "num_speculative_tokens": 4}\' (a draft model); same outputs',
        prm=False,
    ),
    ModelFlag(
        "tensor_parallel_size",
        {"type": int, "default": 1, "metavar": "K"},
        "split the model over K ranks (tensor shards; processes the engine starts; gloo on a CPU, NCCL on CUDA)",
    ),
    ModelFlag(
        "pipeline_parallel_size",
        {"type": int, "default": 1, "metavar": "K"},
        "split the model's layers into K pipeline stages (ranks)",
    ),
    ModelFlag(
        "distributed_executor_backend",
        {"default": "mp", "choices": ["mp", "ray"]},
        "how a parallel model's other ranks start: mp (processes on this host) or ray (actors in a "
        "placement group of the Ray cluster this host belongs to: other hosts too)",
        both=True,
    ),
    ModelFlag(
        "async_scheduling",
        {"action": argparse.BooleanOptionalAction},
        "overlapped steps: schedule the next step while the device runs this one (default: on "
        "with CUDA; on a CPU off, or TREESERVE_ASYNC_SCHEDULING=0|1)",
        both=True,
    ),
    ModelFlag(
        "enforce_eager",
        {"action": "store_true", "default": False},
        "no CUDA graphs: run every step eagerly (on CUDA decode steps replay graphs captured at "
        "load; on a CPU this changes nothing)",
        both=True,
    ),
    ModelFlag("max_model_len", {"type": int}, "the longest sequence (default: the model's own, capped)", both=True),
    ModelFlag(
        "kv_cache_dtype",
        {"choices": list(KV_CACHE_DTYPES)},
        "what the KV pages hold (every model): auto (the model's dtype, the default) or fp8_e4m3 "
        "(one byte a value, scaled per layer: twice the tokens in the same memory)",
        both=True,
    ),
    ModelFlag(
        "kv_fraction",
        {"type": float},
        generator=False,
        verifier=False,
        prm_help="a static split: the PRM's share of KV (default: one arena shared by both models)",
    ),
)


def add_model_flags(parser: argparse.ArgumentParser, prm: bool, verifier: bool = False) -> None:
    """The generator's flags of MODEL_FLAGS and, with `prm`, the PRM's, with `verifier` the verifier's."""
    models = ["generator"] + ["prm"] * prm + ["verifier"] * verifier
    for flag in MODEL_FLAGS:
        for model in models:
            if not flag.has(model):
                continue
            options = dict(flag.options)
            if model == "generator":
                text = flag.help
            elif flag.both:  # None: as the generator's
                options["default"] = None
                if options.get("action") == "store_true":
                    options["action"] = argparse.BooleanOptionalAction
                text = f"the {'PRM' if model == 'prm' else model}'s (default: as {flag.names('generator')[0]})"
            elif model == "prm":
                text = flag.prm_help
            else:
                text = flag.verifier_help or (flag.prm_help or "").replace("the PRM's", "the verifier's")
            parser.add_argument(*flag.names(model), dest=flag.dest(model), help=text, **{"default": None, **options})


def model_settings(args: argparse.Namespace, model: str, tuned: dict | None = None) -> ModelSettings | None:
    """`model`'s ("generator", "prm" or "verifier") settings from flags `add_model_flags` made, with
    `tuned` batch settings (a `--config` file's); None when no path was given (or the subcommand
    has no such model's flags)."""
    if not hasattr(args, model):  # the path's flag
        return None
    values = {}
    for flag in MODEL_FLAGS:
        if not flag.has(model):
            continue
        value = getattr(args, flag.dest(model))
        if value is None and flag.both and model != "generator":
            value = getattr(args, flag.dest("generator"))
        values[flag.field] = value
    path = values.pop("path")
    if path is None:
        return None
    return ModelSettings.from_flat(path, model, **values, **(tuned or {}))
