"""The server's recent traced searches (`/v1/search` with `"trace": true`) and their pages.

Owns `TraceRing`, a bounded in-memory ring (`--trace-ring`, ServerSettings.trace_ring) of
the newest traced results, which `GET /v1/search/{id}/trace` returns and `GET /ui` lists; and
the HTML of `/ui` (a list, escaped) and `/ui/{id}` (`treeserve view`'s page of that search,
built as a one-problem results document with no gold answer).
"""

from __future__ import annotations

import html
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from treeserve.eval.view import build_page


@dataclass
class TraceRing:
    size: int = 32
    entries: OrderedDict[str, dict] = field(default_factory=OrderedDict)  # id -> traced result

    def add(self, result: dict) -> None:
        """Keep a traced `/v1/search` result (its "trace" and "problem"); others are not kept."""
        if self.size <= 0 or not result.get("trace"):
            return
        self.entries[result["id"]] = result
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, search_id: str) -> dict | None:
        return self.entries.get(search_id)

    def missing(self, search_id: str) -> str:
        return (
            f"no traced search {search_id!r} among the {len(self.entries)} kept (the server keeps the newest "
            f'{self.size}, --trace-ring; send "trace": true on /v1/search to record one)'
        )


def as_results(result: dict) -> dict:
    """A traced `/v1/search` result as a one-problem results document for the view."""
    completions = [
        {
            "text": c["text"],
            "answer": c["answer"],
            "step_scores": c["step_scores"],
            "score": c["score"],
            "correct": None,
        }
        for c in result["completions"]
    ]
    trace = result["trace"]
    record = {
        "unique_id": result["id"],
        "level": None,
        "problem": result["problem"],
        "answer": None,
        "pred": result["answer"],
        "correct": None,
        "completions": completions,
        "trace": trace,
    }
    config = {
        "search": {
            "strategy": result["strategy"],
            "n": trace["n"],
            "beam_width": trace["beam_width"],
            "agg": result["agg"],
        },
        "selection": result["selection"],
    }
    return {"config": config, "summary": {}, "problems": [record]}


def search_page(result: dict) -> str:
    return build_page([(f"search {result['id']}", as_results(result))])


def list_page(ring: TraceRing) -> str:
    """`/ui`: the kept searches, newest first, each linking to its page."""
    rows = []
    for search_id, result in reversed(ring.entries.items()):
        cells = [
            f'<a href="/ui/{html.escape(search_id)}">{html.escape(search_id)}</a>',
            html.escape(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(result["created"]))),
            html.escape(f"{result['strategy']} n={result['trace']['n']}"),
            html.escape(str(result["answer"])),
            html.escape(result["problem"][:200]),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    body = "".join(rows) or '<tr><td colspan="5">no traced searches yet: POST /v1/search with "trace": true</td></tr>'
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">'
        "<title>treeserve: traced searches</title><style>body{font:13px system-ui,sans-serif;margin:16px}"
        "td,th{padding:3px 8px;border-bottom:1px solid #eaeef2;text-align:left}</style></head><body>"
        f"<h1>Traced searches</h1><p>The newest {ring.size} kept in memory.</p><table><thead><tr><th>search</th>"
        "<th>created</th><th>strategy</th><th>answer</th><th>problem</th></tr></thead><tbody>"
        f"{body}</tbody></table></body></html>"
    )
