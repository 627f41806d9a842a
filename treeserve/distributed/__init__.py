"""Process groups and ranks: how a model split over k ranks meets and is started (local or Ray).

`groups.py` holds the collectives the layers call; `ranks.py` and `ray_ranks.py` start, watch
and stop ranks 1..k-1. What a rank runs is handed in by the engine (`engine/rank_worker.py`):
nothing here imports models, kv or the engine.
"""
