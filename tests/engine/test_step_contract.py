"""The step's contract and who owns a sequence's progress (issue 65).

* `step_plan.py` and `step_result.py` hold data and nothing else: dataclasses and exceptions,
  no functions of their own beyond a property or a read of the result.
* Rows describe themselves: a request with n = 3 samples its parent's row (which counts its
  forks) and then one row per fork, each naming its fork; a speculating sequence's drafted
  positions name their position.
* Only `postprocess.py` writes a sequence's progress (`num_computed_tokens`, `num_pending`,
  `pending_forks`) once it runs; the scheduler sets where a sequence starts (a prefix-cache hit
  on admission, a preemption's reset). Checked over the package's source with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import treeserve
from treeserve import SamplingParams
from treeserve.engine import step_plan, step_result
from treeserve.engine.step_plan import SampleRow

PACKAGE = Path(treeserve.__file__).parent
PROGRESS = {"num_computed_tokens", "num_pending", "pending_forks"}
# module -> the progress fields it may write on a sequence (not on `self`)
WRITERS = {
    "engine/postprocess.py": PROGRESS,
    "engine/scheduler.py": {"num_computed_tokens"},  # admission (prefix hit) and preemption set where it starts
    "engine/speculative/draft_model.py": {"num_computed_tokens"},  # the draft model's own sequences (DraftSeq)
}


NOT_SEQUENCES = {"self", "engine"}  # an object's own counters; the engine's total of computed tokens


def progress_writes(path: Path) -> set[str]:
    """Progress fields assigned on an object other than `self` (or an engine) in the module at `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        for target in targets:
            for t in ast.walk(target):
                owner = t.value.id if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) else None
                if isinstance(t, ast.Attribute) and t.attr in PROGRESS and owner not in NOT_SEQUENCES:
                    found.add(t.attr)
    return found


def test_only_postprocess_writes_a_sequences_progress():
    writes = {str(p.relative_to(PACKAGE)): progress_writes(p) for p in PACKAGE.rglob("*.py")}
    offenders = {m: f - WRITERS.get(m, set()) for m, f in writes.items() if f - WRITERS.get(m, set())}
    assert not offenders, f"sequence progress written outside postprocess.py: {offenders}"
    assert writes["engine/postprocess.py"] == PROGRESS  # the check sees the writes it is about


def test_the_check_finds_a_planted_write(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(seq):\n    seq.num_pending += 1\n    self_like = seq\n    self_like.pending_forks = 0\n")
    assert progress_writes(planted) == {"num_pending", "pending_forks"}


def test_contract_modules_hold_data_only():
    for module in (step_plan, step_result):
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # imported names
            assert inspect.isclass(obj), f"{module.__name__}.{name} is not a type"
            assert dataclasses.is_dataclass(obj) or issubclass(obj, Exception), f"{name}: not data"
            own = {k for k, v in vars(obj).items() if inspect.isfunction(v) and not k.startswith("__")}
            assert own <= {"sampled", "wait"}, f"{module.__name__}.{name} has behaviour: {own}"  # the read-back wait


def test_rows_name_their_sequence_and_role(llama_dir, make_llm):
    llm = make_llm(llama_dir, async_scheduling=False)
    engine = llm.engine
    seen = []
    prepare = engine.inputs.prepare

    def recording(batch, copies):  # noqa: ANN001, ANN202 - InputBatch.prepare's signature
        step = prepare(batch, copies)
        seen.append([(row.seq.request.request_id, row.fork, row.forks, row.draft_position) for row in step.samples])
        return step

    engine.inputs.prepare = recording
    engine.add_request("a", "one two three", SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=2))
    engine.add_request("b", "four five", SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    first = seen[0]
    assert first == [("a", 0, 2, 0), ("a", 1, 0, 0), ("a", 2, 0, 0), ("b", 0, 0, 0)]
    assert all(row == (row[0], 0, 0, 0) for row in seen[1])  # then each sequence its own next token
    assert len(seen[1]) == 4
    assert SampleRow(None, fork=1).is_next is False and SampleRow(None, draft_position=2).is_next is False
    assert SampleRow(None).is_next
    engine.check_pages_idle()
