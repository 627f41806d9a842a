"""Paged KV memory: the page arena and the page manager with its prefix cache."""

from treeserve.kv.arena import KVArena
from treeserve.kv.page_manager import CacheStats, NoFreePages, PageManager, PrefixHit

__all__ = ["PageManager", "CacheStats", "KVArena", "NoFreePages", "PrefixHit"]
