"""Speculative decoding: drafts proposed before a step, verified by the target's own samples.

* `speculator.py`: which sequences draft, how many tokens, and the adaptive drafting length;
* `prompt_lookup.py`: drafts from the sequence's own text or its draft group's (`ngram`, `tree`);
* `draft_model.py`: drafts from a smaller model of the same vocabulary (`model`).
The verification itself is a chunk of queries over cached pages in the ordinary step, and its
read-back is in `engine/postprocess.py`. The setting is `config.SpeculativeConfig`.
"""
