"""The `treeserve` command (`python -m treeserve`): `cli.main` with the cyclic collector paused
while the command's imports load. Those (torch and the rest) live as long as the process, so they
are frozen out of the collector's reach once loaded instead of walked by its passes meanwhile."""

from __future__ import annotations

import gc
import sys


def main() -> int:
    gc.disable()
    try:
        from treeserve import cli
    finally:
        gc.freeze()
        gc.enable()
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
