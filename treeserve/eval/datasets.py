"""`treeserve eval --dataset` specs: `arith[:level=4,5,size=200,seed=0]` (the built-in task) or a MATH-500
JSONL path (string `problem`, `answer`; optional int `level`, string `unique_id` (default `line-N`),
`grader` "math" or "arith"). Every record gets `level`, `unique_id` and `grader`; a file is validated
whole before any work starts."""

from __future__ import annotations

import json
from pathlib import Path

from treeserve.eval import arith

GRADER_KINDS = ("arith", "math")
ARITH_OPTIONS = ("level", "size", "seed")
_ARITH_DEFAULTS = {"size": 500, "seed": 0, "level": tuple(sorted(arith.LEVELS))}


def load_dataset(spec: str) -> list[dict]:
    """Records for `arith[:options]` or a JSONL path; ValueError for a malformed spec or file (naming
    the option, or the file and line), FileNotFoundError for a missing file."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("dataset spec must be a non-empty string: 'arith[:level=..,size=..,seed=..]' or a JSONL path")
    spec = spec.strip()
    if spec == "arith" or spec.startswith("arith:"):
        options = parse_arith_spec(spec)
        records = arith.arith_dataset(size=options["size"], seed=options["seed"], levels=options["level"])
        return [{**record, "grader": "arith"} for record in records]
    return load_jsonl(spec)


def parse_arith_spec(spec: str) -> dict:
    """{"level": tuple[int, ...], "size": int, "seed": int} of an `arith[:key=value,...]` spec; keyless
    values after `level=` (alias `levels=`) are more levels: `arith:level=1,2,size=10`."""
    head, _, body = spec.partition(":")
    if head != "arith":
        raise ValueError(f"not an arith spec: {spec!r}")
    raw: dict[str, list[str]] = {}
    key: str | None = None
    for token in body.split(",") if body.strip() else []:
        token = token.strip()
        if "=" in token:
            key, _, value = token.partition("=")
            key = key.strip()
            key = "level" if key == "levels" else key
            if key not in ARITH_OPTIONS:
                raise ValueError(f"unknown arith option {key!r} in {spec!r}; known options: {', '.join(ARITH_OPTIONS)}")
            if key in raw:
                raise ValueError(f"arith option {key!r} given twice in {spec!r}")
            raw[key] = [value.strip()]
        elif key == "level":
            raw[key].append(token)
        else:
            where = "at the start" if key is None else f"after {key}={raw[key][0]}"
            raise ValueError(f"bad arith spec {spec!r}: expected key=value {where}, got {token!r}")

    options = dict(_ARITH_DEFAULTS)
    if "level" in raw:
        levels = tuple(_parse_int(v, "level", spec) for v in raw["level"])
        bad = [lv for lv in levels if lv not in arith.LEVELS]
        if bad:
            raise ValueError(f"arith level must be one of {sorted(arith.LEVELS)}, got {bad[0]} in {spec!r}")
        if len(set(levels)) != len(levels):
            raise ValueError(f"arith levels repeat in {spec!r}")
        options["level"] = levels
    if "size" in raw:
        options["size"] = _parse_int(raw["size"][0], "size", spec)
        if options["size"] < 1:
            raise ValueError(f"arith size must be >= 1, got {options['size']} in {spec!r}")
    if "seed" in raw:
        options["seed"] = _parse_int(raw["seed"][0], "seed", spec)
    return options


def _parse_int(value: str, key: str, spec: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"arith option {key} must be an integer, got {value!r} in {spec!r}") from None


def load_jsonl(path: str | Path) -> list[dict]:
    """Validated records of a MATH-500-style JSONL file (blank lines are skipped)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"dataset file not found: {path} (a dataset spec is 'arith[:options]' or a path to a JSONL file)"
        )
    if not path.is_file():
        raise ValueError(f"dataset path is not a file: {path}")
    records: list[dict] = []
    seen_ids: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = _validate_record(line, path, line_no)
            first = seen_ids.setdefault(record["unique_id"], line_no)
            if first != line_no:
                raise ValueError(f"{path}:{line_no}: unique_id {record['unique_id']!r} already used on line {first}")
            records.append(record)
    if not records:
        raise ValueError(f"{path}: no records (expected one JSON object per line)")
    return records


def _validate_record(line: str, path: Path, line_no: int) -> dict:
    where = f"{path}:{line_no}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("problem", "answer"):
        if key not in obj:
            raise ValueError(f"{where}: missing required key {key!r}")
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise ValueError(f"{where}: {key!r} must be a non-empty string, got {obj[key]!r:.80}")
    level = obj.get("level")
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
        raise ValueError(f"{where}: 'level' must be an integer, got {level!r:.80}")
    unique_id = obj.get("unique_id", f"line-{line_no}")
    if not isinstance(unique_id, str) or not unique_id:
        raise ValueError(f"{where}: 'unique_id' must be a non-empty string, got {unique_id!r:.80}")
    grader = obj.get("grader", "math")
    if grader not in GRADER_KINDS:
        raise ValueError(f"{where}: 'grader' must be one of {GRADER_KINDS}, got {grader!r:.80}")
    return {**obj, "level": level, "unique_id": unique_id, "grader": grader}
