"""`treeserve plot`: accuracy vs N (log2; one line per @n table, or one point per file without tables),
accuracy vs computed tokens with the Pareto front, and a run's page log. Titles name each file's headline
rule. matplotlib's object API on the Agg canvas (no pyplot), imported only when a plot is drawn."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treeserve.eval.metrics import SELECTIONS
from treeserve.eval.report import answer_rule, read_results
from treeserve.search.config import SearchConfig

_METHOD_STYLES = {"naive": ":", "weighted": "-", "majority": "--"}  # overlapping lines stay visible
DEFAULT_MARK = " (default)"  # an adaptive run at the budget `--adaptive` alone picks: starred


def _label(config: dict, path: Path) -> tuple[str, int | None]:
    search = config.get("search") or config  # `treeserve eval` nests the search's settings
    strategy = str(search.get("strategy") or path.stem)
    n = search.get("n")
    return strategy, n if isinstance(n, int) and not isinstance(n, bool) else None


def headline_title(results: Sequence[tuple[Path, dict]], what: str = "accuracy vs N", with_n: bool = True) -> str:
    """`accuracy vs N; headline rule: beam_search N=16 weighted, best_of_n N=16 naive`."""
    heads: list[str] = []
    for path, document in results:
        strategy, n = _label(document["config"], path)
        head = f"{strategy} N={n}" if n is not None and with_n else strategy
        text = f"{head} {answer_rule(document) or '(rule not recorded)'}"
        if text not in heads:
            heads.append(text)
    return "\n".join(textwrap.wrap(f"{what}; headline rule: {', '.join(heads)}", 90))


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


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (cost, accuracy) points no other point beats, sorted by cost; of equal points, one is kept."""
    front: list[tuple[float, float]] = []
    for cost, accuracy in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or accuracy > front[-1][1]:
            front.append((cost, accuracy))
    return front


def _compute_point(path: Path, results: dict) -> tuple[str, str, float, float]:
    """A results file's (series, label, computed tokens, accuracy); raises if it lacks the tokens."""
    summary = results["summary"]
    tokens = summary.get("computed_tokens")
    if not isinstance(tokens, int | float) or isinstance(tokens, bool):
        raise ValueError(
            f"{path}: its summary has no 'computed_tokens' (generator + PRM tokens run; runs before "
            "adaptive search did not record them): rerun it to plot against compute"
        )
    config = results["config"]
    search = config.get("search") or config
    strategy, n = _label(config, path)
    label = f"{strategy} N={n}" if n is not None else strategy
    series = f"{strategy} fixed"
    if search.get("adaptive"):
        series = f"{strategy} adaptive"
        label += f" adaptive T={search.get('certainty')}"
        if search.get("first_width") is not None:  # runs from several first widths lie on one curve
            label += f" w={search['first_width']}"
        if search.get("budget_tokens") is not None:
            label += f" budget={search['budget_tokens']}"
        elif search.get("budget_fraction") is None:  # (a run from before the run picked its budget)
            label += " no budget"
        else:
            label += f" picked f={search['budget_fraction']}"
            if search["budget_fraction"] == SearchConfig().budget_fraction:
                label += DEFAULT_MARK
    return series, label, float(tokens), float(summary["accuracy"])


def plot_accuracy_vs_compute(
    results_paths: Sequence[str | Path], out_png: str | Path, title: str | None = None, lines: bool = False
) -> Path:
    """Accuracy vs computed tokens with the Pareto front into `out_png`; `lines` joins each series by cost."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if isinstance(results_paths, str | Path):
        results_paths = [results_paths]
    if not results_paths:
        raise ValueError("plot_accuracy_vs_compute needs at least one results file")
    documents = [(Path(p), read_results(p)) for p in results_paths]
    points = [_compute_point(path, results) for path, results in documents]

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    markers = ["o", "s", "^", "D", "v", "P"]
    for i, series in enumerate(dict.fromkeys(s for s, _, _, _ in points)):
        mine = sorted((x, y) for s, _, x, y in points if s == series)
        style = "-" if lines else "none"
        ax.plot([x for x, _ in mine], [y for _, y in mine], marker=markers[i % len(markers)], ls=style, label=series)
    for i, (_, label, x, y) in enumerate(sorted(points, key=lambda p: p[2])):  # neighbours above, below
        ax.annotate(label, (x, y), xytext=(5, 5 if i % 2 else -11), textcoords="offset points", fontsize="x-small")
    starred = [(x, y) for _, label, x, y in points if label.endswith(DEFAULT_MARK)]
    if starred:
        xs, ys = zip(*starred, strict=True)
        ax.scatter(xs, ys, marker="*", s=260, color="gold", edgecolors="black", zorder=3, label="--adaptive alone")
    front = pareto_front([(x, y) for _, _, x, y in points])
    ax.step([x for x, _ in front], [y for _, y in front], where="post", color="black", alpha=0.6, label="Pareto front")
    ax.scatter([x for x, _ in front], [y for _, y in front], s=140, facecolors="none", edgecolors="black")
    ax.set_xscale("log")
    ax.set_xlabel("computed tokens (generator + PRM, log)")
    ax.set_ylabel("accuracy")
    ax.margins(x=0.12, y=0.15)  # room for the labels; runs a point apart stay apart (no 0-1 axis)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title or headline_title(documents, "accuracy vs computed tokens", with_n=False), fontsize="medium")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def plot_pages(page_logs: dict[str, list[dict]], out_png: str | Path) -> Path:
    """A run's page log (`eval --page-logs`): pages and cumulative prefix-cache hit rate over time."""
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
    """Each model's pages in use (solid) and cached (dashed) over time, and unless `free` is None the
    first model's free pages (all models' when they share one arena); also `treeserve profile`'s."""
    for name, rows in page_logs.items():
        t = [r["time_s"] for r in rows]
        ax.plot(t, [r["in_use"] for r in rows], label=f"{name} in use")
        ax.plot(t, [r["cached"] for r in rows], "--", label=f"{name} cached")
    if page_logs and free is not None:
        rows = next(iter(page_logs.values()))
        ax.plot([r["time_s"] for r in rows], [r["free"] for r in rows], ":", color="grey", label=free)
    ax.set(title=title, xlabel="seconds", ylabel="pages")
