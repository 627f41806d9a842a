"""Device and backend selection, and the CUDA branches of the memory queries and the planner,
exercised with substituted CUDA queries (these machines have no GPU)."""

from __future__ import annotations

import pytest
import torch

from treeserve import LLM
from treeserve.cli import main
from treeserve.config import EngineConfig
from treeserve.device import (
    available_memory,
    process_memory,
    resolve_attention_backend,
    resolve_device,
    total_memory,
)
from treeserve.runtime import planner

CUDA = torch.device("cuda")


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch believes in one CUDA device of 80 GiB with 60 GiB free; the allocator is a counter."""
    state = {"allocated": 1000, "peak": 1000}

    def allocate(n: int) -> None:
        state["allocated"] += n
        state["peak"] = max(state["peak"], state["allocated"])

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["allocated"]))
    return allocate


def test_default_device_follows_torch(fake_gpu, monkeypatch):
    assert resolve_device(None) == "cuda"
    assert resolve_attention_backend(None, "cuda") == "triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == "cpu"
    assert resolve_attention_backend(None, "cpu") == "cpu"


def test_cuda_without_a_gpu_names_the_fix():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="torch.cuda.is_available\\(\\) is False.*device='cpu'"):
        resolve_device("cuda")


@pytest.mark.parametrize(
    "device, backend, message",
    [
        ("tpu", None, "device must be"),
        ("not a device", None, "device must be"),
        ("cuda:3", None, "sees 1 CUDA device"),
        ("cpu", "flash", "attention_backend must be one of triton, sdpa, cpu"),
        ("cuda", "cpu", "attention_backend='cpu' runs C kernels on host memory"),
    ],
)
def test_bad_device_or_backend(fake_gpu, device, backend, message):
    with pytest.raises(ValueError, match=message):
        resolve_attention_backend(backend, resolve_device(device))


def test_triton_without_the_interpreter_on_cpu_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton' cannot run here: .*TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu")


def test_triton_missing_names_the_extra(monkeypatch):
    import treeserve.kernels.triton as triton_kernels

    monkeypatch.setattr(triton_kernels, "_import_error", lambda: "No module named 'triton'")
    with pytest.raises(ValueError, match=r"treeserve\[gpu\]"):
        resolve_attention_backend("triton", "cpu")


def test_errors_come_before_the_model_loads(tmp_path, monkeypatch):
    """A bad device is refused before anything reads the model (the path does not even exist)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="device='cuda'"):
        EngineConfig.from_kwargs(model=missing, device="cuda")
    with pytest.raises(ValueError, match="attention_backend must be"):
        LLM(missing, attention_backend="nope")


@pytest.mark.parametrize("command", [["generate"], ["eval"], ["solve", "Compute 1 + 2."]])
def test_cli_device_errors(command, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main([*command, "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's choices: usage line and exit status 2
        main([*command, "--attention-backend", "nope"])


def test_cuda_memory_queries(fake_gpu):
    assert available_memory(CUDA) == 60 << 30
    assert total_memory(CUDA) == 80 << 30
    assert process_memory(CUDA) == 20 << 30  # used on the device: context and workspaces included


def test_activation_peak_reads_the_cuda_allocator(fake_gpu):
    def step() -> None:
        fake_gpu(5000)  # a temporary
        fake_gpu(-5000)
        fake_gpu(700)  # what stays (say, a cache)

    assert planner._peak_bytes(step, CUDA) == 5000


def test_plan_sources_say_measured_or_estimated():
    cuda, cpu = planner.sources(CUDA), planner.sources(torch.device("cpu"))
    assert (
        set(cuda)
        == set(cpu)
        == {
            "total_memory",
            "free_at_start",
            "weights",
            "activation_peak",
            "sampler_peak",
            "other",
            "loaded",
        }
    )
    assert cuda["sampler_peak"].startswith("estimated")
    assert all(how.startswith("measured") for name, how in cuda.items() if name != "sampler_peak")
    assert "CUDA caching allocator" in cuda["activation_peak"] and "profiler" in cpu["activation_peak"]
    assert "mem_get_info" in cuda["free_at_start"] and "meminfo" in cpu["free_at_start"]
