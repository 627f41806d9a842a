"""Hosts several engines (generator, PRM) in one process and one memory budget."""

from treeserve.runtime.runtime import Runtime

__all__ = ["Runtime"]
