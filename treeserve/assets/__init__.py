"""Shipped tiny checkpoints (the arithmetic world's generator and PRM); data only."""
