"""CUDA graphs for decode steps (engine/cuda_graphs.py).

On a CPU the capture logic runs with an eager stand-in for torch.cuda.CUDAGraph (its replay
runs the captured forward again on the same static buffers): the buckets, the packed static
inputs, padding rows that store nothing, the fallback to eager for other steps, and an
engine whose decode steps go through the graphs giving the plain engine's outputs, with
preemption and prefix hits. On CUDA (marked, skipped here) real graphs: replay == the same
padded forward run eagerly, bit for bit, at every bucket; the engine with graphs against
`enforce_eager`; the memory plan's measured graph memory.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import build_checkpoint
from treeserve import LLM, SamplingParams
from treeserve.config import EngineConfig
from treeserve.engine import cuda_graphs
from treeserve.engine.cuda_graphs import capture_sizes
from treeserve.engine.forward_batch import ForwardBatch

PROMPTS = ["def f(x):", "hello world", "the quick brown fox", "1 + 2 =", "once upon a time"]
PAGE = 2 * 2 * 4 * 2 * 16 * 4  # layers * k/v * block * kv_heads * head_dim * fp32 bytes (tiny llama, 4-token pages)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class EagerGraph:
    """torch.cuda.CUDAGraph's stand-in on a CPU: replay runs the captured forward again, into
    the output tensor capture returned (as a graph writes its outputs in place)."""

    replays = 0

    def capture(self, fn, pool):  # noqa: ANN001, ANN201
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        EagerGraph.replays += 1
        self.out.copy_(self.fn())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama", num_hidden_layers=2)


@pytest.fixture
def cpu_llm(make_llm):
    """make_llm on the CPU, also where a GPU is present: the eager stand-in and the sdpa
    backend's padding-row check are CPU-only (graphs on CUDA run the Triton backend)."""
    return lambda model, **kwargs: make_llm(model, device="cpu", **kwargs)


@pytest.fixture
def fake_graphs(monkeypatch):
    """Graphs on a CPU: any engine captures them, with the eager stand-in."""
    monkeypatch.setattr(cuda_graphs, "graphs_apply", lambda device, backend, eager, parallel: not eager)
    monkeypatch.setattr(cuda_graphs, "GRAPH_CLASS", EagerGraph)
    EagerGraph.replays = 0


def test_buckets_are_vllms_and_cut_to_max_num_seqs():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs itself: every decode batch has a graph
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(512) == [1, 2, 4, 8, *range(16, 257, 8), *range(272, 513, 16)]  # steps of 16 above 256
    assert capture_sizes(4096)[-1] == cuda_graphs.MAX_CAPTURE
    assert capture_sizes(64, [1, 8, 32, 512]) == [1, 8, 32, 64]  # a list larger than max_num_seqs is cut to it


@pytest.mark.parametrize("sizes", [[], [0, 4], "8", [2.5], [True]])
def test_bad_bucket_lists_are_refused(checkpoint, sizes):
    with pytest.raises(ValueError, match="cuda_graph_sizes must be a non-empty list of positive batch sizes"):
        EngineConfig.from_kwargs(model=checkpoint, cuda_graph_sizes=sizes)


def test_enforce_eager_on_a_cpu_is_accepted_and_changes_nothing(checkpoint, cpu_llm):
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=3)
    plain, eager = cpu_llm(checkpoint), cpu_llm(checkpoint, enforce_eager=True)
    assert plain.engine.runner.graphs is None and eager.engine.runner.graphs is None  # graphs are for CUDA
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)] == [
        o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)
    ]
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig.from_kwargs(model=checkpoint, enforce_eager="yes")


def decode_batch(engine, n: int) -> ForwardBatch:  # noqa: ANN001
    """n decodes at scattered positions over scattered pages of `engine`'s arena."""
    width = 4
    tables = torch.randperm(engine.arena.num_pages - 1, generator=torch.Generator().manual_seed(n))[: n * width]
    tables = (tables + 1).view(n, width).numpy()
    starts = torch.randint(0, width * engine.page_size, (n,), generator=torch.Generator().manual_seed(n)).numpy()
    vocab = engine.model_config.vocab_size
    ids = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n + 1)).numpy()
    return ForwardBatch(ids, starts, starts * 0 + 1, starts < 0, tables)


def test_every_bucket_replays_the_eager_forward_and_padding_stores_nothing(checkpoint, cpu_llm, fake_graphs):
    """Batches of every size from 1 to 12 through buckets 1, 2, 4, 8, 12: the real rows' hidden
    states are the unpadded eager forward's bit for bit (fp32 on a CPU: row-invariant), and the
    only KV slots written are the real rows'."""
    llm = cpu_llm(checkpoint, attention_backend="sdpa", max_num_seqs=12)
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    assert sorted(graphs.graphs) == graphs.sizes == [1, 2, 4, 8, 12]
    for n in range(1, 13):
        batch = decode_batch(engine, n)
        before = engine.arena.buffer.clone()
        replayed = runner.forward(batch).clone()
        after_replay = engine.arena.buffer.clone()
        engine.arena.buffer.copy_(before)
        runner.graphs = None
        eager = runner.forward(batch)
        runner.graphs = graphs
        assert torch.equal(replayed, eager), n
        assert torch.equal(after_replay, engine.arena.buffer), n  # the same slots written, the same bytes
        engine.arena.buffer.copy_(before)
        assert graphs.bucket(batch) == next(b for b in graphs.sizes if b >= n)
    assert EagerGraph.replays >= 12


def test_the_previous_steps_samples_are_filled_in_on_the_device(checkpoint, cpu_llm, fake_graphs):
    """Overlapped steps on CUDA: rows whose token is the previous step's sample are written into
    the static token buffer from the device tensor (`fill`), not from the host batch."""
    import numpy as np

    llm = cpu_llm(checkpoint, attention_backend="sdpa", max_num_seqs=8)
    engine, runner = llm.engine, llm.engine.runner
    batch = decode_batch(engine, 5)
    previous = torch.tensor([7, 11, 13], dtype=torch.int64)  # the previous step's samples
    at, source = np.array([0, 3], dtype=np.int64), np.array([2, 0], dtype=np.int64)
    filled = ForwardBatch(batch.token_ids.copy(), batch.starts, batch.lens, batch.drafted, batch.tables)
    filled.token_ids[at] = previous.numpy()[source]
    before = engine.arena.buffer.clone()
    with torch.inference_mode():  # as ModelRunner.execute runs it
        got = runner.graphs.run(batch, 8, runner.staging, (at, source, previous)).clone()
    engine.arena.buffer.copy_(before)
    runner.graphs, graphs = None, runner.graphs
    assert torch.equal(got, runner.forward(filled))
    runner.graphs = graphs


def test_other_steps_run_eagerly(checkpoint, cpu_llm, fake_graphs):
    llm = cpu_llm(checkpoint, attention_backend="sdpa", max_num_seqs=4)
    graphs = llm.engine.runner.graphs
    one = decode_batch(llm.engine, 1)
    prefill = ForwardBatch(one.token_ids.repeat(3), one.starts, one.lens * 3, one.drafted, one.tables)
    assert graphs.bucket(prefill) is None  # a chunk of 3 tokens
    assert graphs.bucket(decode_batch(llm.engine, 5)) is None  # more rows than the largest bucket
    wide = decode_batch(llm.engine, 2)
    wide.tables = wide.tables.repeat(200, axis=1)
    assert graphs.bucket(wide) is None  # a wider table than captured


def test_an_engine_replaying_graphs_gives_the_plain_engines_outputs(checkpoint, cpu_llm, fake_graphs):
    """Greedy, and seeded sampling with n > 1, with prefix hits (shared prompts) on 24 pages of
    4 tokens (sequences are preempted and recomputed): the tokens of an engine without graphs;
    pages idle after (cpu_llm checks)."""
    kwargs = {
        "attention_backend": "sdpa",
        "max_num_seqs": 8,
        "page_size": 4,
        "kv_cache_memory": 24 * PAGE,
        "max_model_len": 72,
    }
    prompts = PROMPTS + [PROMPTS[0] + " return", PROMPTS[1] + " again"]  # prefix hits
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=40, seed=11, n=3, ignore_eos=True),
    ]
    with_graphs = cpu_llm(checkpoint, **kwargs)
    assert with_graphs.engine.runner.graphs is not None
    got = [[c.token_ids for o in with_graphs.generate(prompts, p) for c in o.outputs] for p in params]
    assert EagerGraph.replays > 20 and with_graphs.engine.scheduler.num_preemptions > 0
    stats = with_graphs.engine.graph_stats  # each forward's choice counted: replayed, or why not
    assert stats["replays"] == EagerGraph.replays and stats["eager"]["prefill or drafted rows"] > 0
    assert with_graphs.engine.pages.stats.hits > 0
    plain = cpu_llm(checkpoint, enforce_eager=True, **kwargs)
    assert plain.engine.runner.graphs is None
    want = [[c.token_ids for o in plain.generate(prompts, p) for c in o.outputs] for p in params]
    assert got == want


def test_a_capture_out_of_memory_names_enforce_eager(checkpoint, monkeypatch, fake_graphs):
    class Exhausted(EagerGraph):
        def capture(self, fn, pool):  # noqa: ANN001, ANN201
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cuda_graphs, "GRAPH_CLASS", Exhausted)
    with pytest.raises(ValueError, match="ran out of device memory: run with --enforce-eager"):
        LLM(checkpoint, dtype="float32", kv_cache_memory=8 << 20, attention_backend="sdpa")


# ---- on a GPU --------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_replay_is_the_padded_eager_forward_bit_for_bit(checkpoint, make_llm, dtype):
    llm = make_llm(checkpoint, device="cuda", dtype=dtype, max_num_seqs=40)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    for n in [1, 2, 3, 4, 5, 8, 9, 16, 17, 30, 40]:
        batch, bucket = decode_batch(engine, n), graphs.bucket(decode_batch(engine, n))
        before = engine.arena.buffer.clone()
        with torch.inference_mode():  # as ModelRunner.execute runs it
            eager = graphs.run(batch, bucket, engine.runner.staging, None, eager=True).clone()
            engine.arena.buffer.copy_(before)
            replayed = graphs.run(batch, bucket, engine.runner.staging, None).clone()
        assert torch.equal(replayed, eager), n


@cuda
def test_graphs_give_enforce_eagers_tokens_and_enter_the_memory_plan(checkpoint, make_llm):
    kwargs = {"device": "cuda", "dtype": "float32", "max_num_seqs": 16, "kv_cache_memory": 1 << 20}
    prompts = PROMPTS + [PROMPTS[0] + " return", PROMPTS[1] + " again"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, n=2)
    with_graphs, eager = make_llm(checkpoint, **kwargs), make_llm(checkpoint, enforce_eager=True, **kwargs)
    assert with_graphs.engine.graph_stats["memory_bytes"] > 0 and eager.engine.graph_stats is None
    got = [c.token_ids for o in with_graphs.generate(prompts, params) for c in o.outputs]
    want = [c.token_ids for o in eager.generate(prompts, params) for c in o.outputs]
    assert got == want  # fp32: the padded and unpadded matmuls agree on greedy tokens


def test_the_triton_kv_store_skips_padding_rows():
    """Slot page -1 (a graph's padding row) is written nowhere; the other rows as before
    (a GPU, or CPU tensors in Triton's interpreter)."""
    from treeserve.kernels.triton.kv_store import store_kv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, v = torch.randn(3, 2, 16, device=device), torch.randn(3, 2, 16, device=device)
    k_cache, v_cache = torch.zeros(4, 4, 2, 16, device=device), torch.zeros(4, 4, 2, 16, device=device)
    pages, offsets = torch.tensor([2, -1, 0], device=device), torch.tensor([1, 3, 2], device=device)
    store_kv(k, v, k_cache, v_cache, pages, offsets)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[2, 1], want_k[0, 2], want_v[2, 1], want_v[0, 2] = k[0], k[2], v[0], v[2]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
