"""Paged KV memory: the page arena and the block manager with its prefix cache."""

from treeserve.kv.arena import KVArena
from treeserve.kv.block_manager import BlockManager, CacheStats, NoFreePages, PrefixHit

__all__ = ["BlockManager", "CacheStats", "KVArena", "NoFreePages", "PrefixHit"]
