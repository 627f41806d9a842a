"""Fixtures the search tests share."""

from __future__ import annotations

import asyncio

import pytest

from treeserve.config import DeviceConfig
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.runtime import Runtime


@pytest.fixture(scope="module")
def runtime():
    """The shipped arithmetic pair (fp32, 32 MiB of KV) for one test module; closed after it, with
    every page back."""
    rt = Runtime.for_search(DEFAULT_GENERATOR, DEFAULT_PRM, 32 << 20, device_config=DeviceConfig(dtype="float32"))
    yield rt
    asyncio.run(rt.close())
    rt.check_pages_idle()
