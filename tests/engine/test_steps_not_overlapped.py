"""The core engine tests again, with overlapped steps off (the rest of the suite runs them on).

Each test module imported below is collected a second time here, with `TREESERVE_ASYNC_SCHEDULING=0`
for every engine its tests build: the plain path (read back in the same `step()` that launched)
keeps every property the overlapped path is tested for.
"""

from __future__ import annotations

import pytest

from tests.engine.test_api import *  # noqa: F403
from tests.engine.test_atomic_steps import *  # noqa: F403
from tests.engine.test_dedup import *  # noqa: F403
from tests.engine.test_preemption import *  # noqa: F403
from tests.engine.test_prompt_logprobs_penalties import *  # noqa: F403
from tests.engine.test_sampling import *  # noqa: F403
from tests.engine.test_stop import *  # noqa: F403


@pytest.fixture(autouse=True)
def steps_not_overlapped(monkeypatch):
    monkeypatch.setenv("TREESERVE_ASYNC_SCHEDULING", "0")


def test_engines_here_step_without_overlap(llama_dir, make_llm):
    assert not make_llm(llama_dir).engine.async_scheduling
