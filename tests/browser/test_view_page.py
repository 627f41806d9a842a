"""`treeserve view` pages and the server's /ui in headless Chromium: they load offline with no
console errors, draw the expected trees, show a clicked step's text, render markup in results
as text, and /ui works behind an API key. Writes bench/out/view_tree.png (the README's kind of
screenshot)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.browser.conftest import Watched
from tests.eval.test_view import HOSTILE, hostile_copy, make_traced_results
from tests.server.conftest import API_KEY, start_server
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.eval.view import write_view
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.trace import nodes
from treeserve.server.settings import ServerSettings

pytestmark = pytest.mark.browser
OUT = Path(__file__).resolve().parents[2] / "bench" / "out"


def open_page(w: Watched, url: str) -> float:
    start = time.perf_counter()
    w.page.goto(url)
    w.page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return time.perf_counter() - start


def show(w: Watched, uid: str) -> None:
    w.page.click(f"tr.problem[data-uid='{uid}']")
    w.page.wait_for_selector(f"h2:text-is('problem {uid}')")
    w.page.wait_for_selector("section.run .tree svg")


@pytest.fixture(scope="module")
def traced_results(tmp_path_factory) -> Path:
    """Searched on a thread of its own: Playwright's sync API keeps an event loop running on this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(make_traced_results, tmp_path_factory.mktemp("view")).result()


@pytest.fixture(scope="module")
def report(traced_results, tmp_path_factory) -> Path:
    return write_view([traced_results], tmp_path_factory.mktemp("page") / "report.html")


def test_the_page_loads_offline_without_errors_and_draws_each_tree(watched, report, traced_results):
    doc = json.loads(traced_results.read_text())
    open_page(watched, report.as_uri())
    assert watched.page.locator("tr.problem").count() == len(doc["problems"])
    for problem in doc["problems"]:
        show(watched, problem["unique_id"])
        drawn = watched.page.locator("section.run[data-run='0'] .node")
        assert drawn.count() == len(problem["trace"]["nodes"])
        faded = watched.page.locator("section.run .node.faded").count()
        assert faded == sum(n["fate"] in ("pruned", "duplicate") for n in nodes(problem["trace"]))
    OUT.mkdir(parents=True, exist_ok=True)
    watched.page.screenshot(path=str(OUT / "view_tree.png"))
    assert watched.errors == [] and watched.blocked == []


def test_clicking_a_node_shows_its_step_and_filters_narrow_the_list(watched, report, traced_results):
    problem = json.loads(traced_results.read_text())["problems"][1]
    open_page(watched, report.as_uri())
    show(watched, problem["unique_id"])
    for node in nodes(problem["trace"])[::7]:
        watched.page.click(f"section.run .node[data-id='{node['id']}']")
        assert watched.page.locator(".details .step-text").text_content() == node["text"]
        assert node["fate"] in watched.page.locator(".details dl").text_content()
    watched.page.fill("#filter-text", problem["unique_id"])
    assert watched.page.locator("tr.problem:visible").count() == 1
    watched.page.fill("#filter-text", "")
    watched.page.select_option("#filter-status", "correct")
    doc = json.loads(traced_results.read_text())
    assert watched.page.locator("tr.problem:visible").count() == sum(p["correct"] for p in doc["problems"])
    assert watched.errors == []


def test_markup_in_a_step_renders_as_text(watched, traced_results, tmp_path):
    hostile, node_id = hostile_copy(traced_results, tmp_path / "hostile.json")
    page = write_view([hostile], tmp_path / "hostile.html")
    open_page(watched, page.as_uri())
    show(watched, "q0")
    assert watched.page.locator(".question").text_content() == HOSTILE
    watched.page.click(f"section.run .node[data-id='{node_id}']")
    assert watched.page.locator(".details .step-text").text_content() == HOSTILE
    assert watched.page.evaluate("window.pwned") is None
    assert watched.page.locator("#view img[src='x']").count() == 0
    assert watched.errors == [] and watched.blocked == []


def test_a_run_without_traces_says_how_to_record_them(watched, traced_results, tmp_path):
    doc = json.loads(traced_results.read_text())
    for p in doc["problems"]:
        del p["trace"]
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(doc))
    open_page(watched, write_view([plain], tmp_path / "plain.html").as_uri())
    assert "--trace" in watched.page.locator("#no-traces").text_content()
    show_row = watched.page.locator("tr.problem[data-uid='q0']")
    show_row.click()
    watched.page.wait_for_selector("section.run .notice")
    assert "has no search trace" in watched.page.locator("section.run .notice").text_content()
    assert watched.errors == []


def test_two_runs_side_by_side(watched, traced_results, tmp_path):
    doc = json.loads(traced_results.read_text())
    doc["problems"] = doc["problems"][1:]
    other = tmp_path / "b" / "traced.json"
    other.parent.mkdir()
    other.write_text(json.dumps(doc))
    open_page(watched, write_view([traced_results, other], tmp_path / "both.html").as_uri())
    show(watched, "q1")
    assert watched.page.locator("section.run").count() == 2
    assert watched.page.locator("section.run .tree svg").count() == 2
    watched.page.click("tr.problem[data-uid='q0']")
    watched.page.wait_for_selector("section.run[data-run='1'] >> text=not in this file")
    assert watched.errors == []


def test_ui_behind_an_api_key(browser):
    settings = ServerSettings(
        ModelSettings(DEFAULT_GENERATOR),
        ModelSettings(DEFAULT_PRM),
        api_key=API_KEY,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )
    live = start_server(settings)
    try:
        body = {
            "problem": "Compute (3 + 4) * 5. <b>bold?</b>",
            "n": 4,
            "beam_width": 2,
            "num_iterations": 6,
            "seed": 1,
            "trace": True,
        }
        auth = {"Authorization": f"Bearer {API_KEY}"}
        result = httpx.post(live.base_url + "/v1/search", json=body, headers=auth, timeout=120).json()
        w = Watched(browser, allowed=live.base_url)
        try:
            assert w.page.goto(live.base_url + "/ui").status == 401
            w.page.goto(f"{live.base_url}/ui?token={API_KEY}")
            assert w.page.url == live.base_url + "/ui"  # the token left the address bar
            w.page.click(f"a[href='/ui/{result['id']}']")
            w.page.wait_for_selector("body[data-ready='1']")
            w.page.wait_for_selector("section.run .tree svg")
            assert w.page.locator("section.run .node").count() == len(result["trace"]["nodes"])
            assert w.page.locator(".question").text_content() == body["problem"]
            w.errors = [e for e in w.errors if "401" not in e]  # the first, refused visit
            assert w.errors == [] and w.blocked == []
        finally:
            w.close()
    finally:
        live.stop()
        live.served.runtime.check_pages_idle()
