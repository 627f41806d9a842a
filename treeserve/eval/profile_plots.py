"""The figures of `treeserve profile` (thesis figures 6.1-6.7) from its profile.json: timeline.png (pages
over time), budget.png (hit rate and thrash vs KV budget), split.png (problems/min vs the PRM's share),
batch.png (throughput over the batch grid). matplotlib's object API on Agg, as in `plots.py`."""

from __future__ import annotations

from pathlib import Path

from treeserve.eval.plots import draw_pages


def _figure(ncols: int, width: float = 5.0):  # noqa: ANN202
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, 4.0))
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def plot_timeline(timelines: dict[str, dict], out: Path) -> Path:
    fig, axes = _figure(max(len(timelines), 1), 6.0)
    for ax, (label, logs) in zip(axes, timelines.items(), strict=False):  # a static split's pools: no one free count
        draw_pages(ax, logs, f"pages over time: {label}", free="free (shared)" if label == "shared" else None)
        ax.legend(fontsize=7)
    return _save(fig, out / "timeline.png")


def plot_budget(runs: list[dict], out: Path) -> Path:
    fig, (hit, thrash) = _figure(2)
    for label, split in (("shared", None), ("PRM 0.3", 0.3)):
        rows = sorted(
            (r for r in runs if r["prm_kv_fraction"] == split and r["max_num_seqs"] is None and not r["error"]),
            key=lambda r: r["kv_cache_memory"],
        )
        mib = [r["kv_cache_memory"] / (1 << 20) for r in rows]
        hit.plot(mib, [r["generator_hit_rate"] for r in rows], "o-", label=f"generator, {label}")
        hit.plot(mib, [r["prm_hit_rate"] for r in rows], "s--", label=f"PRM, {label}")
        thrash.plot(mib, [r["thrash"] for r in rows], "o-", label=label)
    hit.set(title="prefix-cache hit rate vs KV budget", xlabel="KV MiB", ylabel="hit rate", xscale="log")
    thrash.set(title="thrash (misses on evicted keys) vs KV budget", xlabel="KV MiB", ylabel="events", xscale="log")
    budgets = sorted({r["kv_cache_memory"] / (1 << 20) for r in runs})
    for ax in (hit, thrash):
        ax.minorticks_off()
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.legend(fontsize=7)
    return _save(fig, out / "budget.png")


def plot_split(runs: list[dict], out: Path) -> Path:
    fig, (ax,) = _figure(1, 6.0)
    budgets = sorted({r["kv_cache_memory"] for r in runs})
    for budget in budgets:
        rows = [r for r in runs if r["kv_cache_memory"] == budget and r["max_num_seqs"] is None]
        static = sorted((r for r in rows if r["prm_kv_fraction"] is not None), key=lambda r: r["prm_kv_fraction"])
        line = ax.plot(
            [r["prm_kv_fraction"] for r in static],
            [r["problems_per_min"] for r in static],
            "o-",
            label=f"static split, KV {budget / (1 << 20):g} MiB",
        )[0]
        for r in rows:
            if r["prm_kv_fraction"] is None:
                ax.axhline(
                    r["problems_per_min"],
                    linestyle="--",
                    color=line.get_color(),
                    label=f"shared arena, KV {budget / (1 << 20):g} MiB",
                )
    ax.set(title="throughput vs PRM share of KV", xlabel="PRM share of KV", ylabel="problems/min")
    ax.legend(fontsize=7)
    return _save(fig, out / "split.png")


def plot_batch(runs: list[dict], out: Path) -> Path:
    rows = [r for r in runs if r["max_num_seqs"] is not None]
    seqs = sorted({r["max_num_seqs"] for r in rows})
    tokens = sorted({r["max_num_batched_tokens"] for r in rows})
    fig, axes = _figure(2)
    for ax, (name, key) in zip(axes, (("generator", "generator_throughput"), ("PRM", "prm_throughput")), strict=True):
        grid = [[float("nan")] * len(tokens) for _ in seqs]
        for r in rows:
            grid[seqs.index(r["max_num_seqs"])][tokens.index(r["max_num_batched_tokens"])] = r[key]
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_yticks(range(len(seqs)), [str(s) for s in seqs])
        ax.set(title=f"{name} tokens/s of step time", xlabel="max_num_batched_tokens", ylabel="max_num_seqs")
        ax.figure.colorbar(image, ax=ax)
    return _save(fig, out / "batch.png")


def plot_all(result: dict, out: Path) -> list[Path]:
    runs = result["runs"]
    paths = [plot_timeline(result["timelines"], out), plot_budget(runs, out), plot_split(runs, out)]
    if any(r["max_num_seqs"] is not None for r in runs):
        paths.append(plot_batch(runs, out))
    return paths


def _save(fig, path: Path) -> Path:  # noqa: ANN001
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
