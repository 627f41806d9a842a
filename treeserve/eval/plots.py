"""Plots of evaluation results: accuracy against the number of completions N.

Owns `plot_accuracy_vs_n`, which reads results documents (`treeserve.eval.report`) and draws
accuracy vs N on a log2 axis, the figure of search-and-learn and "Scaling test-time compute":

* a results file whose summary has `naive@n` / `weighted@n` / `majority@n` tables gets one
  line per table, labelled `<strategy> N=<n>: <method>`, the rule of its headline accuracy
  marked `(headline)`;
* files without tables add one point (their `accuracy` at their N) to a line per strategy and
  answer rule, so separate beam-search runs at N = 4, 16, 64 form one line.

Unless given a title, the figure's title names each file's headline rule (`headline_title`).
`plot_pages` draws a run's page log; its pages panel (`draw_pages`) is also `treeserve
profile`'s timeline (`profile_plots.py`).

It uses matplotlib's object API with the Agg canvas (no pyplot, no global backend change),
imported only when a plot is drawn. It never computes metrics itself.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treeserve.eval.metrics import SELECTIONS
from treeserve.eval.report import answer_rule, read_results

_METHOD_STYLES = {"naive": ":", "weighted": "-", "majority": "--"}  # overlapping lines stay visible


def _label(config: dict, path: Path) -> tuple[str, int | None]:
    search = config.get("search") or config  # `treeserve eval` nests the search's settings
    strategy = str(search.get("strategy") or path.stem)
    n = search.get("n")
    return strategy, n if isinstance(n, int) and not isinstance(n, bool) else None


def headline_title(results: Sequence[tuple[Path, dict]]) -> str:
    """`accuracy vs N; headline rule: beam_search N=16 weighted, best_of_n N=16 naive`."""
    heads: list[str] = []
    for path, document in results:
        strategy, n = _label(document["config"], path)
        head = f"{strategy} N={n}" if n is not None else strategy
        text = f"{head} {answer_rule(document) or '(rule not recorded)'}"
        if text not in heads:
            heads.append(text)
    return "\n".join(textwrap.wrap(f"accuracy vs N; headline rule: {', '.join(heads)}", 90))


def plot_accuracy_vs_n(results_paths: Sequence[str | Path], out_png: str | Path, title: str | None = None) -> Path:
    """Draw accuracy vs N for the given results files into `out_png`; returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if isinstance(results_paths, str | Path):
        results_paths = [results_paths]
    if not results_paths:
        raise ValueError("plot_accuracy_vs_n needs at least one results file")

    lines: list[tuple[str, list[int], list[float], str, str]] = []  # label, xs, ys, marker, line style
    points: dict[str, list[tuple[int, float]]] = {}
    documents = [(Path(p), read_results(p)) for p in results_paths]
    for path, results in documents:
        summary, rule = results["summary"], answer_rule(results)
        strategy, n = _label(results["config"], path)
        tables = {m: summary.get(f"{m}@n") for m in SELECTIONS if summary.get(f"{m}@n")}
        if tables:
            for method, table in tables.items():
                pairs = sorted((int(k), float(v)) for k, v in table.items())
                head = f"{strategy} N={n}" if n is not None else strategy
                style = _METHOD_STYLES.get(method, "-")
                label = f"{head}: {method}" + (" (headline)" if method == rule else "")
                lines.append((label, [x for x, _ in pairs], [y for _, y in pairs], "o", style))
        else:
            x = n if n is not None else summary.get("N")
            if not isinstance(x, int) or x < 1:
                raise ValueError(f"{path}: no @n tables and no N (config 'n' or summary 'N') to place accuracy at")
            points.setdefault(f"{strategy} ({rule or 'rule not recorded'})", []).append((x, float(summary["accuracy"])))
    for strategy, pairs in points.items():
        pairs.sort()
        lines.append((strategy, [x for x, _ in pairs], [y for _, y in pairs], "s", "-"))

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    all_x: set[int] = set()
    for label, xs, ys, marker, style in lines:
        ax.plot(xs, ys, marker=marker, linestyle=style, label=label)
        all_x.update(xs)
    ax.set_xscale("log", base=2)
    ticks = sorted(all_x)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("number of completions N (log2)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title or headline_title(documents), fontsize="medium")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def plot_pages(page_logs: dict[str, list[dict]], out_png: str | Path) -> Path:
    """A run's page log (`eval --page-logs`: one row per engine step, `kv/stats.py`'s columns)
    as two panels: each model's pages in use and cached, and the free pages, over time; and
    each model's prefix-cache hit rate so far (cumulative hits / lookups) over time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8))
    FigureCanvasAgg(fig)
    pages, hits = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    draw_pages(pages, page_logs, "pages over time", free="free")
    for name, rows in page_logs.items():
        t = [r["time_s"] for r in rows]
        hits.plot(t, [r["hits"] / max(r["hits"] + r["misses"], 1) for r in rows], label=name)
    hits.set(title="prefix-cache hit rate so far", xlabel="seconds", ylabel="hits / lookups", ylim=(-0.02, 1.02))
    for ax in (pages, hits):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def draw_pages(ax: Any, page_logs: dict[str, list[dict]], title: str, free: str | None) -> None:
    """The pages panel: each model's pages in use (solid) and cached (dashed) over time, from
    its page log's rows (`kv/stats.py`'s columns), and, labelled `free` unless it is None, the
    free pages of the first model's pool (all models' when they share one arena)."""
    for name, rows in page_logs.items():
        t = [r["time_s"] for r in rows]
        ax.plot(t, [r["in_use"] for r in rows], label=f"{name} in use")
        ax.plot(t, [r["cached"] for r in rows], "--", label=f"{name} cached")
    if page_logs and free is not None:
        rows = next(iter(page_logs.values()))
        ax.plot([r["time_s"] for r in rows], [r["free"] for r in rows], ":", color="grey", label=free)
    ax.set(title=title, xlabel="seconds", ylabel="pages")
