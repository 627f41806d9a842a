"""Test-time search: strategies as async programs over the runtime, PRM adapters, score cache."""
