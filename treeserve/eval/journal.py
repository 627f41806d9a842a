"""`OUTPUT.partial.jsonl`, which lets a killed run resume: a `{"journal": 1, "config": {...}}` header, then one
fsynced `{"record", "session", "elapsed_s", "counters"}` line per finished problem. Resuming needs an equal
config (OPERATIONAL keys aside), drops torn lines, and yields the document of an uninterrupted run."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from treeserve.eval.report import PROBLEM_KEYS, upgrade_config

VERSION = 1
# config keys that say how a run was executed, not what it computes: they may change on resume
OPERATIONAL = ("memory_report", "page_logs", "progress", "distributed", "overlap_models")
# the same within a model's settings (the config's "generator", "prm" and "verifier" sections)
MODEL_OPERATIONAL = (
    "async_scheduling",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "distributed_executor_backend",
    "enforce_eager",
)
MODEL_SECTIONS = ("generator.", "prm.", "verifier.")


def journal_path(output: str | Path) -> Path:
    """`results.json` -> `results.partial.jsonl` (any other name gets `.partial.jsonl` appended)."""
    output = Path(output)
    if output.suffix == ".json":
        return output.with_suffix(".partial.jsonl")
    return output.with_name(output.name + ".partial.jsonl")


@dataclass
class Journal:
    path: Path | None  # None: kept in memory only (a run without an output file)
    config: dict
    records: dict[str, dict] = field(default_factory=dict)  # unique id -> record, finished problems
    sessions: dict[str, tuple[float, dict]] = field(default_factory=dict)  # session -> its last (elapsed, counters)
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    _file: IO[str] | None = None

    @classmethod
    def open(cls, path: str | Path | None, config: Mapping[str, Any], resume: bool = False) -> Journal:
        """A new journal, or the existing one if its config matches (ValueError if not; `resume` needs one)."""
        config = json.loads(json.dumps(config))  # as it reads back from the file
        if path is None:
            return cls(None, config)
        path = Path(path)
        if not path.exists():
            if resume:
                raise FileNotFoundError(f"--resume: no partial results to resume at {path}")
            journal = cls(path, config)
            path.parent.mkdir(parents=True, exist_ok=True)
            journal._file = path.open("w", encoding="utf-8")
            journal._write({"journal": VERSION, "config": config})
            return journal
        journal = cls(path, config)
        journal._read(config)
        journal._file = path.open("a", encoding="utf-8")
        return journal

    def _read(self, config: dict) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # the last write did not finish: cut it off before appending
            _warn(f"{self.path}: dropping a torn last line ({len(data) - end} bytes); that problem is searched again")
            with self.path.open("r+b") as f:
                f.truncate(end)
        lines = data[:end].decode("utf-8", errors="replace").splitlines()
        header = _parse(lines[0]) if lines else None
        if not header or header.get("journal") != VERSION or not isinstance(header.get("config"), dict):
            raise ValueError(
                f"{self.path} is not a treeserve partial-results file; move it away or choose another output"
            )
        differences = config_differences(upgrade_config(header["config"]), config)
        if differences:
            raise ValueError(
                f"{self.path} was written by a run with another config ({'; '.join(differences)}); "
                "run the same command to resume it, or move the file away to start afresh"
            )
        for number, line in enumerate(lines[1:], start=2):
            entry = _parse(line)
            record = entry.get("record") if entry else None
            if (
                not isinstance(record, dict)
                or any(k not in record for k in PROBLEM_KEYS)
                or any(k not in entry for k in ("session", "elapsed_s", "counters"))
            ):
                _warn(f"{self.path}:{number}: not a problem record; that problem is searched again")
                continue
            self.records[str(record["unique_id"])] = record
            self.sessions[entry["session"]] = (float(entry["elapsed_s"]), entry["counters"])

    def add(self, record: dict, elapsed_s: float, counters: dict[str, int]) -> None:
        """Record one finished problem durably (flushed and fsynced before returning)."""
        entry = {"record": record, "session": self.session, "elapsed_s": elapsed_s, "counters": counters}
        self._write(entry)
        self.records[str(record["unique_id"])] = record
        self.sessions[self.session] = (elapsed_s, counters)

    def _write(self, obj: dict) -> None:
        if self.path is None:
            return
        assert self._file is not None, "journal is closed"
        self._file.write(json.dumps(obj, ensure_ascii=False, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def totals(self) -> tuple[float, dict[str, int]]:
        """Search seconds and counters summed over every session that finished a problem."""
        wall, total = 0.0, {}
        for elapsed, counters in self.sessions.values():
            wall += elapsed
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
        return wall, total

    def close(self, remove: bool = False) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if remove and self.path is not None:
            self.path.unlink(missing_ok=True)


def config_differences(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    old_name: str = "in the file",
    new_name: str = "now",
    prefix: str = "",
) -> list[str]:
    """'key: X in the file, Y now' per differing (nested) key, operational keys aside; a key the file
    lacks whose value is now empty is a setting added since, at its default: the same run."""
    out = []
    for key in sorted(set(old) | set(new)):
        if (not prefix and key in OPERATIONAL) or (prefix in MODEL_SECTIONS and key in MODEL_OPERATIONAL):
            continue
        if key not in old and new[key] in (None, False, "", [], {}):
            continue
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, old_name, new_name, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} {old_name}, {b!r} {new_name}")
    return out


def _parse(line: str) -> dict | None:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _warn(message: str) -> None:
    print(f"treeserve: {message}", file=sys.stderr)
