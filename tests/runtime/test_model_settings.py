"""One model's settings: `check` refuses bad values with errors naming the model, before any
weight loads; `engine_args` is what the model's engine gets (defaults left out)."""

from __future__ import annotations

import pytest

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
        (
            "generator",
            ModelSettings(DEFAULT_GENERATOR, tensor_parallel_size=0),
            ValueError,
            "generator: tensor_parallel_size must be a positive integer, got 0",
        ),
        (
            "prm",
            ModelSettings(DEFAULT_PRM, pipeline_parallel_size=-1),
            ValueError,
            "prm: pipeline_parallel_size must be a positive integer",
        ),
        (
            "generator",
            ModelSettings(DEFAULT_GENERATOR, distributed_executor_backend="threads"),
            ValueError,
            "distributed_executor_backend must be one of",
        ),
        ("prm", ModelSettings(DEFAULT_PRM, kv_fraction=1.0), ValueError, r"prm_kv_fraction must be in \(0, 1\)"),
        ("prm", ModelSettings(DEFAULT_PRM, speculative_config=NGRAM), ValueError, "speculative decoding is for the"),
        ("generator", ModelSettings(DEFAULT_GENERATOR, speculative_config="{bad"), ValueError, "not valid JSON"),
        (
            "generator",
            ModelSettings(DEFAULT_GENERATOR, speculative_config=NGRAM, async_scheduling=True),
            ValueError,
            "cannot be combined",
        ),
        (
            "generator",
            ModelSettings(DEFAULT_GENERATOR, quant_activations="fp4"),
            ValueError,
            "generator: quant_activations must be one of",
        ),
        (
            "generator",
            ModelSettings(DEFAULT_GENERATOR, enforce_eager="yes"),
            ValueError,
            "enforce_eager must be True or False",
        ),
        ("generator", ModelSettings(DEFAULT_GENERATOR, max_model_len=1), ValueError, "max_model_len must be >= 2"),
        ("prm", ModelSettings(DEFAULT_PRM, max_num_seqs=0), ValueError, "prm: max_num_seqs must be a positive integer"),
    ],
)
def test_bad_values_are_refused_naming_the_model(name, settings, error, message):
    with pytest.raises(error, match=message):
        settings.check(name, "cpu")


def test_check_resolves_what_runs():
    model = ModelSettings(DEFAULT_GENERATOR, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    model.check("generator", "cpu")
    assert model.speculative_config["num_speculative_tokens"] == 3 and model.async_scheduling is False
    model.check("generator", "cpu")  # checked twice (the server checks, then its engine core): the same


def test_engine_args_leave_defaults_out():
    assert ModelSettings(DEFAULT_GENERATOR).engine_args() == {}
    args = ModelSettings(
        DEFAULT_GENERATOR,
        quantization="int8",
        enforce_eager=True,
        max_num_seqs=8,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        kv_fraction=0.3,
        style="step_tag",
    ).engine_args()
    assert args == {
        "quantization": "int8",
        "enforce_eager": True,
        "max_num_seqs": 8,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "ray",
    }


def test_eval_and_server_check_their_models_the_same_way():
    """Both compose the same settings, so a bad model is refused with the same words by either."""
    bad = ModelSettings(DEFAULT_PRM, tensor_parallel_size=0)
    for settings in (EvalSettings(prm=bad), ServerSettings(ModelSettings(DEFAULT_GENERATOR), prm=bad)):
        with pytest.raises(ValueError, match="prm: tensor_parallel_size must be a positive integer"):
            settings.check()
    with pytest.raises(ValueError, match="static KV split is given as the PRM's share"):
        RuntimeSettings().check(ModelSettings(DEFAULT_GENERATOR, kv_fraction=0.5), None)
    assert ServerSettings(ModelSettings(DEFAULT_GENERATOR)).name == "arith-generator"


def test_eval_and_server_share_no_field_of_their_own():
    from dataclasses import fields

    common = {f.name for f in fields(EvalSettings)} & {f.name for f in fields(ServerSettings)}
    assert common == {"generator", "prm", "verifier", "runtime"}
