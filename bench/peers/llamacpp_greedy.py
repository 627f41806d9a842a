"""Greedy continuations from llama.cpp (llama-cpp-python's high-level API), one JSON line out.

Usage (in the llama.cpp venv): python bench/peers/llamacpp_greedy.py MODEL.gguf PROMPTS.json NEW_TOKENS
PROMPTS.json is a list of token-id lists; prints `RESULT [[ids...], ...]`.
"""

from __future__ import annotations

import json
import sys

from llama_cpp import Llama

model, prompts_path, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(prompts_path) as f:
    prompts = json.load(f)
llm = Llama(model_path=model, n_ctx=512, n_threads=2, verbose=False)
outputs = []
for ids in prompts:
    llm.reset()
    out = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == new_tokens:
            break
    outputs.append(out)
print("RESULT " + json.dumps(outputs), flush=True)
