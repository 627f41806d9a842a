"""Each setting is declared once: no field in two settings classes, no flag defined twice."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from treeserve.cli import build_parser
from treeserve.config import SUB_CONFIGS, EngineConfig, SchedulerConfig, SpeculativeConfig
from treeserve.eval.runner import EvalSettings
from treeserve.model_flags import MODEL_FLAGS
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.server.protocol import SEARCH_FIELDS, SearchRequest
from treeserve.server.settings import ServerSettings

ENGINE_SETTINGS = (EngineConfig, SpeculativeConfig, *SUB_CONFIGS.values())
SETTINGS = (SearchConfig, EvalSettings, ServerSettings, RuntimeSettings, ModelSettings, *ENGINE_SETTINGS)
SEARCH_SUBCOMMANDS = ("eval", "solve", "profile", "tune")
# one name, two settings: a search's seed (its problems' draws) and an engine's (requests without
# one); an engine's model and its draft model (vLLM's speculative_config key)
SAME_NAME = {"seed": ["SearchConfig", "EngineConfig"], "model": ["EngineConfig", "SpeculativeConfig"]}


def _declared(cls: type, settings: tuple[type, ...] = SETTINGS) -> set[str]:
    """The fields `cls` declares itself: one whose type is (or may be) another settings class is nesting."""
    nested = {c.__name__ for c in settings}
    return {f.name for f in dataclasses.fields(cls) if not nested & set(f.type.split(" | "))}


def _declared_twice(settings: tuple[type, ...]) -> dict[str, list[str]]:
    owners: dict[str, list[str]] = defaultdict(list)
    for cls in settings:
        for name in _declared(cls, settings):
            owners[name].append(cls.__name__)
    return {name: classes for name, classes in owners.items() if len(classes) > 1}


def test_no_settings_field_is_declared_in_two_classes():
    """Over the search, eval, server, runtime and model settings and the engine's config tree
    (EngineConfig and its sub-configs), a field name belongs to one class, nesting aside
    (EvalSettings holds a RuntimeSettings and ModelSettings, those the engine's sub-configs that
    are theirs). `/v1/search`'s own fields (model, problem, ...) repeat no SearchConfig field, and
    its search fields are SearchConfig's."""
    assert _declared_twice(SETTINGS) == SAME_NAME
    search = {f.name for f in dataclasses.fields(SearchConfig)}
    own = set(SearchRequest.model_fields) - set(SEARCH_FIELDS)
    assert own == {"model", "problem", "messages", "stream", "deadline_s", "verify", "selection"}
    assert set(SEARCH_FIELDS) <= search and not own & search


def test_the_check_fails_when_a_field_is_declared_twice():
    @dataclasses.dataclass
    class Copy:
        max_num_seqs: int = 256  # SchedulerConfig's
        scheduler_config: SchedulerConfig | None = None  # nesting: not a declaration

    assert _declared_twice((*SETTINGS, Copy)) == {**SAME_NAME, "max_num_seqs": ["SchedulerConfig", "Copy"]}


def test_model_and_runtime_settings_hold_the_engines_sub_configs():
    """Every engine setting is held by ModelSettings (per model), RuntimeSettings (shared) or
    EngineConfig alone: each sub-config whole by one of the first two."""
    model, runtime = ({f.name for f in dataclasses.fields(cls)} for cls in (ModelSettings, RuntimeSettings))
    assert set(SUB_CONFIGS) == (model | runtime) & set(SUB_CONFIGS) and not model & runtime
    assert "speculative_config" in model


@contextmanager
def _call_sites() -> Iterator[dict[int, tuple[str, int]]]:
    """Record, for every action argparse makes, the source line of the add_argument call that made it."""
    sites: dict[int, tuple[str, int]] = {}
    original: Callable = argparse._ActionsContainer.add_argument

    def add_argument(self: argparse._ActionsContainer, *args: object, **kwargs: object) -> argparse.Action:
        action = original(self, *args, **kwargs)
        caller = sys._getframe(1)
        sites[id(action)] = (caller.f_code.co_filename, caller.f_lineno)
        return action

    argparse._ActionsContainer.add_argument = add_argument
    try:
        yield sites
    finally:
        argparse._ActionsContainer.add_argument = original


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if a.dest == "command").choices


def _flag_definitions(build: Callable[[], argparse.ArgumentParser], dests: set[str]) -> dict[str, set]:
    """Each flag string that sets one of `dests`, in any subcommand -> the call sites defining it."""
    with _call_sites() as sites:
        parser = build()
    out: dict[str, set] = defaultdict(set)
    for sub in _subcommands(parser).values():
        for action in sub._actions:
            if action.dest in dests:
                for flag in action.option_strings:
                    out[flag].add(sites[id(action)])
    return out


def _settings_dests() -> set[str]:
    fields = {f.name for cls in SETTINGS for f in dataclasses.fields(cls)}
    return fields | {flag.dest(model) for flag in MODEL_FLAGS for model in ("generator", "prm", "verifier")}


def test_no_settings_flag_is_defined_twice():
    """A flag that sets a settings field (the dest is a field of SETTINGS or a per-model flag's) is
    made by exactly one add_argument call in the source, whichever subcommands have it: `--dtype`
    in generate, eval and serve is one definition, and so is `--n` in generate and eval (generated
    from SearchConfig.n). A flag written out by hand a second time (another line) fails this."""
    twice = {
        flag: sites for flag, sites in _flag_definitions(build_parser, _settings_dests()).items() if len(sites) > 1
    }
    assert twice == {}


def test_the_check_fails_when_a_flag_is_written_twice():
    def build() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command")
        sub.add_parser("a").add_argument("--dtype", default="bfloat16")
        sub.add_parser("b").add_argument("--dtype", default="float32")
        return parser

    assert len(_flag_definitions(build, {"dtype"})["--dtype"]) == 2


def test_search_flags_are_searchconfigs_fields():
    """Every search subcommand has one flag per SearchConfig field that has a flag (no hand-written
    extra), with the field's default."""
    parser = build_parser()
    expected = {f.name for f in dataclasses.fields(SearchConfig) if f.metadata.get("flag", True)}
    config = SearchConfig()
    for name in SEARCH_SUBCOMMANDS:
        sub = _subcommands(parser)[name]
        dests = {a.dest for a in sub._actions if a.dest in {f.name for f in dataclasses.fields(SearchConfig)}}
        assert dests == expected, name
        defaults = {a.dest: a.default for a in sub._actions}
        assert {k: defaults[k] for k in expected - {"stop"}} == {k: getattr(config, k) for k in expected - {"stop"}}


def test_vllms_block_size_is_the_page_size(tmp_path):
    """vLLM's `block_size` (LLM's keyword, a tune file's key) names treeserve's `page_size`."""
    import json

    from treeserve.config import CacheConfig, nest
    from treeserve.runtime.tuner import read_config

    assert nest({"block_size": 4}, {"cache_config": CacheConfig})["cache_config"] == CacheConfig(page_size=4)
    assert ModelSettings.from_flat("m", block_size=8).cache_config.page_size == 8
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"engine_args": {"generator": {"block_size": 4, "max_num_seqs": 8}}}))
    assert read_config(str(path))["engine_args"]["generator"] == {"page_size": 4, "max_num_seqs": 8}
