"""A server whose generator decodes speculatively: the same outputs as the plain shared server,
and the drafting counters on `/metrics`."""

from __future__ import annotations

import httpx
from openai import OpenAI

from tests.server.conftest import API_KEY, MODEL, LiveServer, start_server
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.server.settings import ServerSettings


def test_speculative_server_answers_as_the_plain_one(server: LiveServer) -> None:
    generator = ModelSettings(DEFAULT_GENERATOR, speculative_config={"method": "tree", "num_speculative_tokens": 4})
    settings = ServerSettings(
        generator,
        ModelSettings(DEFAULT_PRM),
        served_model_name=MODEL,
        api_key=API_KEY,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )
    spec = start_server(settings)
    try:
        clients = [
            OpenAI(base_url=s.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) for s in (server, spec)
        ]
        prompt = "Compute ((12 + 7) * 3) - 15."
        messages = [{"role": "user", "content": prompt}]
        texts = [
            c.chat.completions.create(model=MODEL, messages=messages, max_tokens=96, temperature=0.8, seed=5)
            .choices[0]
            .message.content
            for c in clients
        ]
        assert texts[0] == texts[1]
        body = {"problem": prompt, "strategy": "beam_search", "n": 4, "beam_width": 2, "num_iterations": 10, "seed": 3}
        searches = [c.post("/search", body=body, cast_to=object) for c in clients]
        assert [c["text"] for c in searches[0]["completions"]] == [c["text"] for c in searches[1]["completions"]]
        metrics = httpx.get(spec.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        name = 'treeserve_spec_decode_num_accepted_tokens_total{model="generator"}'
        accepted = [line for line in metrics.splitlines() if line.startswith(name)]
        assert accepted and float(accepted[0].split()[-1]) > 0
        spec.check_baseline()
        assert not spec.served.runtime.engines["generator"].speculator.groups.groups  # every search forgot its group
    finally:
        spec.stop()
