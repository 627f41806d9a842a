"""`treeserve view`: one self-contained HTML page of a run's searches (two files side by side): a JSON
index, each problem's record as gzip + base64 inflated on opening, inline plots, `view_assets/`.
Nothing from a results file becomes markup: data sit in script elements, and the script sets textContent."""

from __future__ import annotations

import base64
import gzip
import html
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treeserve.eval.metrics import describe_accuracy
from treeserve.eval.report import answer_rule, read_results

ASSETS = Path(__file__).with_name("view_assets")
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<link rel="icon" href="data:,"><meta name="viewport" content="width=device-width, initial-scale=1">
<style>{css}</style></head>
<body><header><h1>{title}</h1><div class="runinfo" id="runinfo"></div></header>
<main><section id="list"><div id="filters"></div><div id="rows"></div></section>
<section id="view"><details id="plots" open><summary>plots</summary></details><div id="problem"></div></section></main>
<script id="index" type="application/json">{index}</script>
{blobs}
<script>{js}</script></body></html>
"""


def _json_for_script(obj: Any) -> str:
    """JSON that cannot end its script element or start markup."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _blob(obj: Any) -> str:
    return base64.b64encode(gzip.compress(json.dumps(obj, separators=(",", ":")).encode(), mtime=0)).decode()


def _describe(name: str, document: dict) -> str:
    search = document["config"].get("search") or document["config"]
    s = document["summary"]
    head = f"{name}: {search.get('strategy', '?')} n={search.get('n', '?')}"
    if "accuracy" in s and "naive@n" in s:
        head += f", {describe_accuracy(s)}"
    return head + f", {len(document['problems'])} problems"


UNITS = {"beam_search": "iteration", "dvts": "wave"}  # the unit adaptive decisions count; sampling: rounds


def stop_line(stop: dict | None, search: dict) -> str | None:
    """E.g. "stopped at iteration 3: settled (certainty 0.93 >= 0.9), widths 4 > 8 > 16", from a
    `stop` record (`Budget.decide`'s or a `/v1/search` deadline's); None without one."""
    if not stop or "reason" not in stop:
        return None
    reason = stop["reason"]
    unit = "iteration" if reason == "deadline" else UNITS.get(search.get("strategy"), "round")
    line = f"stopped at {unit} {stop.get('iteration', '?')}: {reason}"
    certainty = (stop.get("certainty") or [None])[-1]
    threshold = search.get("certainty") if search.get("adaptive") else None
    if reason == "deadline":
        line += f" ({stop['deadline_s']:g} s)" if isinstance(stop.get("deadline_s"), int | float) else ""
    elif certainty is not None and threshold is not None:
        line += f" (certainty {certainty:g} {'>=' if certainty >= threshold else '<'} {threshold:g})"
    elif certainty is not None:
        line += f" (certainty {certainty:g})"
    widths = [w for k, w in enumerate(stop.get("widths") or []) if k == 0 or w != stop["widths"][k - 1]]
    return line + (", widths " + " > ".join(str(w) for w in widths) if widths else "")


def _index_entry(i: int, p: dict, search: dict) -> dict:
    trace = p.get("trace") or {}
    return {
        "index": i,
        "level": p.get("level"),
        "problem": str(p.get("problem", ""))[:300],
        "answer": p.get("answer"),
        "pred": p.get("pred"),
        "correct": p.get("correct"),
        "traced": bool(trace),
        "tokens": trace.get("generated_tokens"),
        "seconds": trace.get("seconds"),
        "stopped": stop_line(p.get("stop") or trace.get("stop"), search),
    }


def _plots(paths: Sequence[Path], documents: Sequence[dict]) -> list[dict]:
    """The run's plots as data URLs: accuracy vs N, and its page log's when it kept one."""
    from treeserve.eval.plots import plot_accuracy_vs_n, plot_pages

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [p for p, d in zip(paths, documents, strict=True) if any(k.endswith("@n") for k in d["summary"])]
        if files:
            out.append(("accuracy vs N", plot_accuracy_vs_n(files, Path(tmp) / "accuracy.png")))
        for k, (path, doc) in enumerate(zip(paths, documents, strict=True)):
            if doc.get("page_logs"):
                png = plot_pages(doc["page_logs"], Path(tmp) / f"pages{k}.png")
                out.append((f"{path.name}: pages and prefix hits", png))
        return [
            {"title": t, "src": "data:image/png;base64," + base64.b64encode(f.read_bytes()).decode()} for t, f in out
        ]


def build_page(documents: Sequence[tuple[str, dict]], problem: str | None = None, plots: Sequence[dict] = ()) -> str:
    """The HTML of (name, results document) pairs, only `problem` if given (ValueError if none has it)."""
    if not documents:
        raise ValueError("view needs a results file")
    order: list[str] = []
    runs = []
    for name, doc in documents:
        search = doc["config"].get("search") or doc["config"]
        problems = {str(p["unique_id"]): _index_entry(i, p, search) for i, p in enumerate(doc["problems"])}
        order += [uid for uid in problems if uid not in order]
        runs.append(
            {
                "name": name,
                "describe": _describe(name, doc),
                "problems": problems,
                "traced": any(p["traced"] for p in problems.values()),
            }
        )
    if problem is not None:
        if problem not in order:
            shown = ", ".join(order[:50]) + (f", ... ({len(order) - 50} more)" if len(order) > 50 else "")
            raise ValueError(f"no problem {problem!r} in {', '.join(n for n, _ in documents)}; its ids are: {shown}")
        order = [problem]
        for run in runs:
            run["problems"] = {problem: run["problems"][problem]} if problem in run["problems"] else {}
    blobs = [
        f'<script type="application/octet-stream" id="p{r}_{entry["index"]}">'
        f"{_blob(documents[r][1]['problems'][entry['index']])}</script>"
        for r, run in enumerate(runs)
        for entry in run["problems"].values()
    ]
    names = " vs ".join(name for name, _ in documents)
    index = {"runs": runs, "order": order, "plots": list(plots), "rule": [answer_rule(d) for _, d in documents]}
    return PAGE.format(
        title=html.escape(f"treeserve view: {names}"),
        css=(ASSETS / "view.css").read_text(encoding="utf-8"),
        js=(ASSETS / "view.js").read_text(encoding="utf-8"),
        index=_json_for_script(index),
        blobs="\n".join(blobs),
    )


def write_view(paths: Sequence[str | Path], output: str | Path, problem: str | None = None) -> Path:
    """`treeserve view`: read and check the results files, write the page to `output`."""
    if not 1 <= len(paths) <= 2:
        raise ValueError(f"view takes one results file, or two of the same problems to compare; got {len(paths)}")
    paths = [Path(p) for p in paths]
    documents = [read_results(p) for p in paths]
    if len(documents) == 2:
        ids = [{str(p["unique_id"]) for p in d["problems"]} for d in documents]
        if not ids[0] & ids[1]:
            raise ValueError(f"{paths[0]} and {paths[1]} share no problem: compare runs of the same dataset")
    names = [p.name if len({q.name for q in paths}) == len(paths) else str(p) for p in paths]
    page = build_page(list(zip(names, documents, strict=True)), problem, _plots(paths, documents))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
