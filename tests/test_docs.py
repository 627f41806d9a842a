"""Every Python and shell example in README.md and docs/ runs here, so no example can rot.

Sybil (docs/writing-docs.md says why Sybil) parses the pages: each ```python block runs in one
namespace per page, in page order; each ```bash block runs in `bash -euo pipefail` in one
temporary folder per page, with this Python's `treeserve` first on PATH. A block that cannot run
here (a download, a GPU, a server on a port, a cluster) is preceded in the page's source by
`<!-- skip: next "why" -->`, which pytest reports as a skip with that reason. Examples are kept
cheap (the shipped tiny arithmetic models, `--limit 2`), so the whole file takes well under a
minute on two cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sybil = pytest.importorskip("sybil")
from sybil import Example, Sybil  # noqa: E402
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Fence languages a page may use. Shell goes in ```bash (it runs); the others are data or output.
LANGUAGES = {"python", "bash", "json", "text", "toml", "yaml"}
BASH_TIMEOUT_S = 120


def run_bash(example: Example) -> None:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", example.parsed],
        cwd=example.namespace["workdir"],
        env=env,
        capture_output=True,
        text=True,
        timeout=BASH_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"{example.path}:{example.line}: exit code {done.returncode}\n"
            f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
        )


SYBIL = Sybil(parsers=[PythonCodeBlockParser(), CodeBlockParser("bash", run_bash), SkipParser()])


class Page:
    """A parsed page and how far its examples have run (they share state, so they run in order)."""

    def __init__(self, path: Path):
        self.document = SYBIL.parse(path)
        self.examples = list(self.document)
        self.outcomes: list[BaseException | None] = []

    def run_through(self, index: int, workdir: Path) -> BaseException | None:
        self.document.namespace.setdefault("workdir", workdir)
        while len(self.outcomes) <= index:
            example = self.examples[len(self.outcomes)]
            cwd = os.getcwd()
            os.chdir(self.document.namespace["workdir"])
            try:
                example.evaluate()
                self.outcomes.append(None)
            except BaseException as e:  # noqa: BLE001 - reported by the example's own test
                if isinstance(e, KeyboardInterrupt):
                    raise
                self.outcomes.append(e)
            finally:
                os.chdir(cwd)
        return self.outcomes[index]


_pages: dict[Path, Page] = {}


def _page(path: Path) -> Page:
    if path not in _pages:
        _pages[path] = Page(path)
    return _pages[path]


def _cases():
    for path in PAGES:
        for i, example in enumerate(_page(path).examples):
            yield pytest.param(path, i, id=f"{path.relative_to(ROOT)}:{example.line}")


@pytest.mark.parametrize(("path", "index"), list(_cases()))
def test_example(path: Path, index: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    page = _page(path)
    outcome = page.run_through(index, tmp_path_factory.mktemp(path.stem))
    if outcome is not None:
        raise outcome


FENCE = re.compile(r"^\s*```(\S*)", re.MULTILINE)


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_fences_name_their_language(path: Path) -> None:
    """An unlabelled or ```sh fence would escape the runner: every opening fence names a known language."""
    opening = FENCE.findall(path.read_text())[::2]  # every other fence closes a block
    assert all(lang in LANGUAGES for lang in opening), f"{path.name}: fence languages {opening}"
