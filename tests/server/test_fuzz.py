"""API fuzzing with schemathesis against the server's own OpenAPI schema: no input may
produce a 5xx, and the pool is back at its baseline afterwards.

The fuzzed server has a 64-token context, so even the largest requests the schema allows
(n=256, the longest completions) stay cheap; the number of examples is bounded. Both of
schemathesis' modes run: bodies the schema accepts, and bodies it rejects.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import API_KEY, LiveServer, start_server
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.server.settings import ServerSettings

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[LiveServer]:
    settings = ServerSettings(
        ModelSettings.from_flat(DEFAULT_GENERATOR, max_model_len=64),
        ModelSettings.from_flat(DEFAULT_PRM, max_model_len=64),
        api_key=API_KEY,
        runtime=RuntimeSettings.from_flat(kv_cache_memory=32 << 20),
    )
    server = start_server(settings)
    yield server
    server.check_baseline()
    server.stop()


@pytest.mark.slow  # ~23s (CI runs the slow step); the default suite keeps to ~10 minutes
def test_no_input_makes_a_server_error(fuzz_server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/search"}
    cases = [
        (op, mode)
        for op in operations
        for mode in schemathesis.GenerationMode
        if op.method.upper() == "POST" or mode == schemathesis.GenerationMode.POSITIVE
    ]  # GETs take no input
    for operation, mode in cases:

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def call(case: schemathesis.Case) -> None:
            response = case.call(base_url=fuzz_server.base_url, headers=AUTH, timeout=60)
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.status_code}"
            if response.status_code >= 400:
                assert "error" in response.json()

        call()
