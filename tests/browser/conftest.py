"""Headless Chromium for the browser tests (marked `browser`; `.ci/run` runs them in a step of
their own). The browser is Debian's `chromium` package, driven by Playwright over CDP:
nothing downloads a browser build. Without a Chromium the tests skip, unless
TREESERVE_REQUIRE_BROWSER=1 (as in CI), where they fail."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest


def chromium_path() -> str | None:
    return os.environ.get("TREESERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        path = None
    if path is None:
        if os.environ.get("TREESERVE_REQUIRE_BROWSER") == "1":
            pytest.fail("no Chromium (apt-get install chromium) or no playwright (pip install playwright)")
        pytest.skip("no Chromium or playwright: apt-get install chromium; pip install playwright")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


class Watched:
    """A page whose console errors, page errors and requests leaving the machine are recorded;
    requests to anything but file:, data: and `allowed` (a server under test) are blocked."""

    def __init__(self, browser, allowed: str = "") -> None:  # noqa: ANN001
        self.context = browser.new_context(viewport={"width": 1400, "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.blocked: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

        def route(r) -> None:  # noqa: ANN001
            url = r.request.url
            if url.startswith(("file:", "data:")) or (allowed and url.startswith(allowed)):
                r.continue_()
            else:
                self.blocked.append(url)
                r.abort()

        self.page.route("**/*", route)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def watched(browser) -> Iterator[Watched]:  # noqa: ANN001
    w = Watched(browser)
    yield w
    w.close()
