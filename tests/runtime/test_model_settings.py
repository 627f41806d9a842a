"""One model's settings: bad values are refused with errors naming the model, before any weight
loads; `engine_args` is what the model's engine gets (its sub-configs)."""

from __future__ import annotations

import pytest

from treeserve.config import EngineConfig
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM, EvalSettings
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.server.settings import ServerSettings

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    ("name", "settings", "error", "message"),
    [
        ("generator", ModelSettings("/nope"), FileNotFoundError, "generator model not found"),
        ("prm", ModelSettings("/nope"), FileNotFoundError, "prm model not found"),
        ("prm", ModelSettings(DEFAULT_PRM, kv_fraction=1.0), ValueError, r"prm_kv_fraction must be in \(0, 1\)"),
        ("prm", ModelSettings(DEFAULT_PRM, speculative_config=NGRAM), ValueError, "speculative decoding is for the"),
        ("generator", ModelSettings(DEFAULT_GENERATOR, speculative_config="{bad"), ValueError, "not valid JSON"),
        (
            "generator",
            ModelSettings.from_flat(DEFAULT_GENERATOR, speculative_config=NGRAM, async_scheduling=True),
            ValueError,
            "cannot be combined",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_model(name, settings, error, message):
    with pytest.raises(error, match=message):
        settings.check(name, "cpu")


@pytest.mark.parametrize(
    ("name", "values", "message"),
    [
        ("generator", {"tensor_parallel_size": 0}, "generator: tensor_parallel_size must be a positive integer, got 0"),
        ("prm", {"pipeline_parallel_size": -1}, "prm: pipeline_parallel_size must be a positive integer"),
        ("generator", {"distributed_executor_backend": "threads"}, "distributed_executor_backend must be one of"),
        ("generator", {"quant_activations": "fp4"}, "generator: quant_activations must be one of"),
        ("generator", {"enforce_eager": "yes"}, "enforce_eager must be True or False"),
        ("generator", {"max_model_len": 1}, "max_model_len must be >= 2"),
        ("prm", {"max_num_seqs": 0}, "prm: max_num_seqs must be a positive integer"),
        ("prm", {"kv_cache_dtype": "int4"}, "prm: kv_cache_dtype must be one of"),
    ],
)
def test_bad_values_are_refused_when_made(name, values, message):
    """Each sub-config checks its own fields when made; from flat settings the error names the model."""
    with pytest.raises(ValueError, match=message):
        ModelSettings.from_flat(DEFAULT_GENERATOR, name, **values)


def test_check_resolves_what_runs():
    model = ModelSettings(DEFAULT_GENERATOR, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    model.check("generator", "cpu")
    assert model.speculative_config.num_speculative_tokens == 3 and model.scheduler_config.async_scheduling is False
    model.check("generator", "cpu")  # checked twice (the server checks, then its engine core): the same


def test_engine_args_are_the_models_sub_configs():
    """An engine gets the model's sub-configs as they are; the role's page size only when it sets none."""
    model = ModelSettings.from_flat(DEFAULT_GENERATOR, max_num_seqs=8, enforce_eager=True, kv_fraction=0.3)
    args = model.engine_args(4)
    assert args["scheduler_config"] is model.scheduler_config and args["graph_config"].enforce_eager
    assert args["cache_config"].page_size == 4 and model.cache_config.page_size is None
    assert ModelSettings.from_flat(DEFAULT_PRM, page_size=8).engine_args(4)["cache_config"].page_size == 8
    config = EngineConfig.from_kwargs(DEFAULT_GENERATOR, dtype="float32", **args)
    assert config.scheduler_config.max_num_seqs == 8 and config.cache_config.page_size == 4


def test_eval_and_server_check_their_models_the_same_way():
    """Both compose the same settings, so a bad model is refused with the same words by either."""
    bad = ModelSettings("/nope")
    for settings in (EvalSettings(prm=bad), ServerSettings(ModelSettings(DEFAULT_GENERATOR), prm=bad)):
        with pytest.raises(FileNotFoundError, match="prm model not found"):
            settings.check()
    with pytest.raises(ValueError, match="static KV split is given as the PRM's share"):
        RuntimeSettings().check(ModelSettings(DEFAULT_GENERATOR, kv_fraction=0.5), None)
    assert ServerSettings(ModelSettings(DEFAULT_GENERATOR)).name == "arith-generator"


def test_eval_and_server_share_no_field_of_their_own():
    from dataclasses import fields

    common = {f.name for f in fields(EvalSettings)} & {f.name for f in fields(ServerSettings)}
    assert common == {"generator", "prm", "verifier", "runtime"}
