"""Answer extraction and grading: kind "arith" exactly in-process, "math" by math-verify in worker processes
under a per-item deadline (an overrun is wrong; grading never hangs). Voting groups answers by canonical
keys, not pairwise `verify`, so grouping is transitive (`\\frac12` with `0.5`). `None` is always wrong."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from treeserve.eval import arith

GRADER_KINDS = ("arith", "math")
THINK_END = "</think>"  # engine/thinking.py's (not imported: grading workers would load torch)
_MAX_ATTEMPTS = 3  # an item whose worker dies this many times is counted wrong


def extract_answer(completion_text: str, reasoning: bool = False) -> str | None:
    """The last `\\boxed{...}`'s content, stripped, or None; with `reasoning`, only after the last `</think>`."""
    if reasoning:
        completion_text = completion_text.rpartition(THINK_END)[2]
    answer = arith.extract_boxed(completion_text)
    return answer if answer else None


# Run inside worker processes (module level, so it pickles by reference).


def verify_math(gold: str, pred: str) -> bool:
    """math-verify's verdict for a gold answer (no `\\boxed`) and a prediction; no timeout of its own."""
    import math_verify

    pred_text = pred if "\\boxed" in pred else "\\boxed{" + pred + "}"
    gold_parsed = math_verify.parse("\\boxed{" + gold + "}", parsing_timeout=None)
    pred_parsed = math_verify.parse(pred_text, parsing_timeout=None)
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_key(answer: str) -> str:
    """Canonical key of a math answer: its math-verify parse (floats made rational), else the stripped text."""
    import math_verify
    import sympy
    from sympy.matrices.matrixbase import MatrixBase

    for item in math_verify.parse("\\boxed{" + answer + "}", parsing_timeout=None):
        if isinstance(item, sympy.Basic | MatrixBase):
            floats = item.atoms(sympy.Float)
            if floats:
                item = item.xreplace({f: sympy.nsimplify(f, rational=True) for f in floats})
            return "expr:" + str(item)
    return "text:" + _normalize_text(answer)


def _normalize_text(answer: str) -> str:
    return "".join(answer.split()).strip("$").removeprefix("\\text{").removesuffix("}")


class _ItemDeadline(BaseException):
    """Raised by SIGALRM in a worker. A BaseException, so math-verify's `except Exception` cannot swallow it."""


_deadline_armed = False


def _on_alarm(signum: int, frame: Any) -> None:
    if _deadline_armed:
        raise _ItemDeadline


def _init_worker() -> None:
    import math_verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # builds math-verify's grammars here, outside any item's deadline
    math_verify.parse("\\boxed{\\frac{1}{2}}", parsing_timeout=None)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _ping() -> int:
    time.sleep(0.02)  # long enough for every worker, not one eager one, to answer a ping
    return os.getpid()


def _call_with_deadline(fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[str, Any]:
    """Run fn(*args) under a SIGALRM deadline: ("ok", value) | ("timeout", None) | ("error", message)."""
    global _deadline_armed
    _deadline_armed = True
    # Re-fires every 50 ms in case something between here and the interpreter swallowed the first one.
    signal.setitimer(signal.ITIMER_REAL, timeout_s, 0.05)
    try:
        return "ok", fn(*args)
    except _ItemDeadline:
        return "timeout", None
    except Exception as e:  # a grader bug must not take the run down: the item counts as wrong
        return "error", f"{type(e).__name__}: {e}"
    finally:
        _deadline_armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)


@dataclass
class GradingStats:
    graded: int = 0
    keyed: int = 0
    cache_hits: int = 0
    worker_calls: int = 0
    timeouts: int = 0
    errors: int = 0
    pool_restarts: int = 0


class Grader:
    """Grades (prediction, gold, kind) items in batches; a context manager owning its worker processes,
    started at the first math item. `timeout_s` bounds each math item; the parent kills the workers
    past `timeout_s + kill_grace_s`. `verify_fn` and `key_fn` must be module-level (they run in workers)."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        max_workers: int | None = None,
        kill_grace_s: float = 2.0,
        start_timeout_s: float = 120.0,
        verify_fn: Callable[[str, str], bool] = verify_math,
        key_fn: Callable[[str], str] = math_key,
    ) -> None:
        if timeout_s <= 0 or kill_grace_s < 0:
            raise ValueError("timeout_s must be > 0 and kill_grace_s >= 0")
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.start_timeout_s = start_timeout_s
        self.max_workers = max_workers or max(1, min(4, os.cpu_count() or 1))
        self.verify_fn = verify_fn
        self.key_fn = key_fn
        self.stats = GradingStats()
        self._verdicts: dict[tuple[str, str, str], bool] = {}
        self._keys: dict[tuple[str, str], str] = {}
        self._pool: ProcessPoolExecutor | None = None
        self._pings: list[Future] = []  # the started pool's start-up checks, not yet waited on

    def grade(self, pred: str | None, answer: str, kind: str) -> bool:
        return self.grade_many([(pred, answer, kind)])[0]

    def grade_many(self, items: Iterable[tuple[str | None, str, str]]) -> list[bool]:
        """Verdicts for (prediction, gold answer, kind) items, in order; math items run in parallel."""
        items = list(items)
        verdicts: list[bool | None] = [None] * len(items)
        todo: dict[tuple[str, str, str], list[int]] = {}
        for i, (pred, answer, kind) in enumerate(items):
            _check_kind(kind)
            if not isinstance(answer, str):
                raise TypeError(f"gold answer must be a string, got {type(answer).__name__}")
            if pred is None:
                verdicts[i] = False
            elif kind == "arith":
                verdicts[i] = arith.grade(pred, answer)
            elif (key := (kind, pred, answer)) in self._verdicts:
                verdicts[i] = self._verdicts[key]
                self.stats.cache_hits += 1
            else:
                todo.setdefault(key, []).append(i)
        if todo:
            keys = list(todo)
            results = self._run(self.verify_fn, [(answer, pred) for _, pred, answer in keys])
            for key, (status, value) in zip(keys, results, strict=True):
                self._verdicts[key] = status == "ok" and bool(value)
                for i in todo[key]:
                    verdicts[i] = self._verdicts[key]
        self.stats.graded += len(items)
        return [bool(v) for v in verdicts]

    def answer_keys(self, answers: Sequence[str | None], kind: str) -> list[str | None]:
        """Canonical keys: equal keys mean equivalent answers (None stays None)."""
        _check_kind(kind)
        keys: list[str | None] = [None] * len(answers)
        todo: dict[str, list[int]] = {}
        for i, answer in enumerate(answers):
            if answer is None:
                continue
            if kind == "arith":
                value = arith.to_number(answer)
                keys[i] = f"num:{value}" if value is not None else "text:" + _normalize_text(answer)
            elif (kind, answer) in self._keys:
                keys[i] = self._keys[(kind, answer)]
                self.stats.cache_hits += 1
            else:
                todo.setdefault(answer, []).append(i)
        if todo:
            pending = list(todo)
            results = self._run(self.key_fn, [(answer,) for answer in pending])
            for answer, (status, value) in zip(pending, results, strict=True):
                key = value if status == "ok" else "text:" + _normalize_text(answer)
                self._keys[(kind, answer)] = key
                for i in todo[answer]:
                    keys[i] = key
        self.stats.keyed += len(answers)
        return keys

    def equivalent(self, a: str | None, b: str | None, kind: str) -> bool:
        """Whether two answers fall in the same voting group (a missing answer equals nothing)."""
        if a is None or b is None:
            return False
        key_a, key_b = self.answer_keys([a, b], kind)
        return key_a == key_b

    def close(self) -> None:
        """Stop the worker processes (a later math item starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # workers may be mid-item (Ctrl-C, an error): do not wait for them
            self._kill_pool()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            with contextlib.suppress(Exception):  # at interpreter exit multiprocessing may be torn down
                self._kill_pool()

    def _run(self, fn: Callable[..., Any], calls: list[tuple]) -> list[tuple[str, Any]]:
        """fn(*args) per call in workers, one in flight per worker, so a deadline counts from submission."""
        results: list[tuple[str, Any] | None] = [None] * len(calls)
        attempts = [0] * len(calls)
        todo = deque(range(len(calls)))
        in_flight: dict[Future, tuple[int, float]] = {}
        while todo or in_flight:
            pool = self._ensure_pool()
            while todo and len(in_flight) < self.max_workers:
                i = todo.popleft()
                attempts[i] += 1
                future = pool.submit(_call_with_deadline, fn, calls[i], self.timeout_s)
                in_flight[future] = (i, time.monotonic() + self.timeout_s + self.kill_grace_s)
            first_deadline = min(deadline for _, deadline in in_flight.values())
            done, _ = wait(in_flight, timeout=max(0.0, first_deadline - time.monotonic()), return_when=FIRST_COMPLETED)
            broken = False
            for future in done:
                i, _ = in_flight.pop(future)
                try:
                    results[i] = future.result()
                except BrokenProcessPool:
                    broken = True
                    if attempts[i] >= _MAX_ATTEMPTS:
                        results[i] = ("error", "worker process died")
                    else:
                        todo.appendleft(i)
                except _ItemDeadline:  # a second alarm escaped the worker's handler: still a timeout
                    results[i] = ("timeout", None)
                except Exception as e:
                    results[i] = ("error", f"{type(e).__name__}: {e}")
                self.stats.worker_calls += 1
            now = time.monotonic()
            overdue = [f for f, (_, deadline) in in_flight.items() if deadline <= now]
            for future in overdue:
                results[in_flight.pop(future)[0]] = ("timeout", None)
            if overdue or broken:
                # Killing the workers fails every item still in flight: run those again on fresh workers.
                todo.extendleft(i for i, _ in in_flight.values())
                in_flight.clear()
                self._kill_pool()
                self.stats.pool_restarts += 1
        for status, _ in results:  # type: ignore[misc]
            self.stats.timeouts += status == "timeout"
            self.stats.errors += status == "error"
        return results  # type: ignore[return-value]

    def start(self) -> None:
        """Start the math workers without waiting for them. A worker imports the parent's main
        script again (seconds where that imports torch), so `run_eval` starts them while the
        models load, and a search's first graded problem does not wait for them."""
        if self._pool is not None:
            return
        if "forkserver" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__, "math_verify"])
        else:
            context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(self.max_workers, mp_context=context, initializer=_init_worker)
        self._pings = [self._pool.submit(_ping) for _ in range(self.max_workers)]

    def _ensure_pool(self) -> ProcessPoolExecutor:
        self.start()
        if not self._pings:
            return self._pool  # type: ignore[return-value]
        pings, self._pings = self._pings, []
        done, _ = wait(pings, timeout=self.start_timeout_s)
        failed = [f.exception() for f in done if f.exception() is not None]
        if len(done) < len(pings) or failed:
            self._kill_pool()
            if failed:
                raise RuntimeError(
                    f"grading workers failed to start ({failed[0]!r}); a script that grades math answers "
                    "must guard its entry point with `if __name__ == '__main__':` (workers are spawned)"
                )
            raise RuntimeError(f"grading workers did not start within {self.start_timeout_s:.0f} s")
        return self._pool  # type: ignore[return-value]

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # a running call cannot be cancelled (no kill_workers before Python 3.14): kill the processes
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            if process.is_alive():
                process.kill()
        pool.shutdown(wait=True, cancel_futures=True)


def _check_kind(kind: str) -> None:
    if kind not in GRADER_KINDS:
        raise ValueError(f"grader kind must be one of {GRADER_KINDS}, got {kind!r}")
