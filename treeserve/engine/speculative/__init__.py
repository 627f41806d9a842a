"""Speculative decoding: drafts proposed before a step, verified by the target's own samples
(`speculator.py`, `prompt_lookup.py`, `draft_model.py`; read back in `engine/postprocess.py`)."""
