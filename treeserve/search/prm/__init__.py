"""PRM adapters, one per input format, and `load_prm`, which picks the one a checkpoint needs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from treeserve.runtime.runtime import Runtime
from treeserve.search.prm.base import PRM, PRMInputTooLong
from treeserve.search.prm.outcome import OutcomeRM
from treeserve.search.prm.reward_head import RewardHeadPRM
from treeserve.search.prm.rlhflow import RLHFlowPRM
from treeserve.search.prm.step_tag import StepTagFormat, StepTagPRM
from treeserve.search.prm.token_classification import TokenClassificationPRM
from treeserve.search.prm.value_head import ValueHeadPRM

PRM_STYLES: dict[str, Callable[[Runtime, str, dict], PRM]] = {
    "step_tag": StepTagPRM,
    "rlhflow": RLHFlowPRM,
    "reward_head": RewardHeadPRM,
    "value_head": ValueHeadPRM,
    "token_classification": TokenClassificationPRM,
    "orm": OutcomeRM,
}
# the `architectures` name endings that tell a style, the first match winning
ARCHITECTURE_STYLES = (
    ("ProcessRewardModel", "reward_head"),
    ("ForTokenClassification", "token_classification"),
    ("ForSequenceClassification", "orm"),
    ("ForRewardModel", "orm"),
)

__all__ = [
    "PRM",
    "PRM_STYLES",
    "OutcomeRM",
    "PRMInputTooLong",
    "RLHFlowPRM",
    "RewardHeadPRM",
    "StepTagFormat",
    "StepTagPRM",
    "TokenClassificationPRM",
    "ValueHeadPRM",
    "check_verifier",
    "detect_style",
    "load_prm",
    "style_from_files",
]


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON file {path!r}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} must hold a JSON object")
    return data


def style_from_files(model_dir: str) -> str | None:
    """The style prm_config.json or config.json's `architectures` names (None: neither tells)."""
    if not os.path.isdir(model_dir):
        return None
    style = _read_json(os.path.join(model_dir, "prm_config.json")).get("style")
    if style is not None:
        if style not in PRM_STYLES:
            raise ValueError(
                f"prm_config.json in {model_dir!r} names unknown style {style!r}; known: {list(PRM_STYLES)}"
            )
        return style
    architectures = _read_json(os.path.join(model_dir, "config.json")).get("architectures") or []
    for ending, found in ARCHITECTURE_STYLES:
        if any(a.endswith(ending) for a in architectures):
            return found
    return None


def check_verifier(model_dir: str, style: str | None = None) -> None:
    """Refuse, before it loads, a verifier whose style or files name a process PRM (files that tell
    nothing are checked once loaded, by `SearchContext`)."""
    found = style or style_from_files(str(model_dir))
    if found is not None and found != "orm":
        raise ValueError(
            f"the verifier re-scores whole solutions, so it must be an outcome reward model (style "
            f"orm), but {str(model_dir)!r} is a {found} PRM: pass it as --prm"
        )


def detect_style(runtime: Runtime, model: str) -> str:
    """The PRM style a checkpoint needs, from its prm_config.json, config.json and head tensors."""
    engine = runtime.engine(model)
    model_dir = engine.config.model
    style = style_from_files(model_dir)
    if style is not None:
        return style
    if any(name.startswith("v_head.") for name in engine.extra_tensors):
        return "value_head"
    raise ValueError(
        f"cannot tell which PRM input format {model_dir!r} expects: pass --prm-style "
        f'(one of {", ".join(PRM_STYLES)}) or add a prm_config.json with a "style" to the model directory'
    )


def load_prm(runtime: Runtime, model: str, style: str | None = None) -> PRM:
    """The adapter for `model` hosted by `runtime`; settings come from the model's prm_config.json."""
    if style is not None and style not in PRM_STYLES:
        raise ValueError(f"unknown PRM style {style!r}; choose one of {list(PRM_STYLES)}")
    style = style or detect_style(runtime, model)
    config = _read_json(os.path.join(runtime.engine(model).config.model, "prm_config.json"))
    if config.get("style", style) != style:  # settings written for another format do not apply
        config = {}
    return PRM_STYLES[style](runtime, model, config)
