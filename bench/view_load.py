"""What a `treeserve view` page costs: file size, and time to open it and a tree in Chromium.

    python bench/view_load.py RESULTS.json [--problems 500] [--repeats 3] [--output bench/out/view_load.json]

RESULTS.json is a traced run (`treeserve eval --trace`). To reach `--problems` it is tiled:
problem i of the page is the file's problem i mod k under a new id (each tile is compressed
and stored on its own, so the page costs what that many problems of this kind cost). Reported:
the results file's bytes and its traces' share, trace bytes per problem (median and max, JSON
as the results store it), the page's bytes, the seconds until the page is ready (index parsed,
list drawn) and until the largest tree is drawn after a click (medians of `--repeats` fresh
loads in headless Chromium: Debian's `chromium`, driven by Playwright), and the CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from treeserve.device import cpu_model
from treeserve.eval.report import read_results, write_results
from treeserve.eval.view import write_view


def tile(document: dict, count: int) -> dict:
    problems = document["problems"]
    out = dict(document)
    out["problems"] = [
        {**problems[i % len(problems)], "unique_id": f"{problems[i % len(problems)]['unique_id']}#{i // len(problems)}"}
        for i in range(count)
    ]
    return out


def load_times(page: Path, largest: str, repeats: int) -> tuple[list[float], list[float], int]:
    from playwright.sync_api import sync_playwright

    ready, tree, nodes = [], [], 0
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for _ in range(repeats):
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            tab = context.new_page()
            start = time.perf_counter()
            tab.goto(page.as_uri())
            tab.wait_for_selector("body[data-ready='1']", timeout=120_000)
            ready.append(time.perf_counter() - start)
            start = time.perf_counter()
            tab.click(f"tr.problem[data-uid='{largest}']")
            tab.wait_for_selector("section.run .tree svg", timeout=120_000)
            tree.append(time.perf_counter() - start)
            nodes = tab.locator("section.run .node").count()
            context.close()
        browser.close()
    return ready, tree, nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--problems", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="bench/out/view_load.json")
    args = ap.parse_args()

    document = read_results(args.results)
    traced = [p for p in document["problems"] if p.get("trace")]
    if not traced:
        raise SystemExit(f"{args.results} has no traces: run treeserve eval with --trace")
    trace_bytes = [len(json.dumps(p["trace"], ensure_ascii=False)) for p in traced]  # as results store it
    with tempfile.TemporaryDirectory() as tmp:
        tiled = tile(document, args.problems)
        big = write_results(tiled, Path(tmp) / "tiled.json")
        page = write_view([big], Path(tmp) / "report.html")
        largest = max(tiled["problems"], key=lambda p: len((p.get("trace") or {}).get("nodes", [])))
        ready, tree, nodes = load_times(page, largest["unique_id"], args.repeats)
        row = {
            "results": args.results,
            "problems_in_file": len(document["problems"]),
            "problems_on_page": args.problems,
            "n": document["config"]["search"]["n"],
            "results_bytes": Path(args.results).stat().st_size,
            "trace_bytes_median": statistics.median(trace_bytes),
            "trace_bytes_max": max(trace_bytes),
            "tiled_results_bytes": big.stat().st_size,
            "page_bytes": page.stat().st_size,
            "ready_s": statistics.median(ready),
            "largest_tree_s": statistics.median(tree),
            "largest_tree_nodes": nodes,
            "ready_s_all": ready,
            "largest_tree_s_all": tree,
            "cpu": cpu_model(),
            "date": time.strftime("%Y-%m-%d"),
        }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(row, indent=1))
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
