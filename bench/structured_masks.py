"""Which constraint library: xgrammar vs llguidance, mask time on treeserve's tokenizers.

    python bench/structured_masks.py [--gguf PATH]

For each tokenizer (the shipped arithmetic generator's byte-level BPE, a SentencePiece-style
tokenizer rebuilt from the Gemma 3 270M GGUF's metadata, 262k tokens) and each constraint
(a typical JSON schema, a regex), it measures: the tokenizer setup, the first compile of the
grammar, a second compile, and the per-token mask time along a valid output (the text's
tokens fed one at a time, the mask computed before each). Both libraries get the same token
bytes (`Tokenizer.token_bytes`, which also covers the arithmetic tokenizer's word-level
vocabulary, which neither library reads from a tokenizer.json itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from treeserve.models.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "treeserve" / "assets"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
}
JSON_TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "12345"}}'
REGEX = r"The answer is \\boxed\{-?[0-9]+\}\."
REGEX_TEXT = r"The answer is \boxed{-1234}."


def llguidance_run(tok: Tokenizer, kind: str, text: str) -> dict:
    import llguidance
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    tokens, specials = tok.token_bytes()
    wrapper = llguidance.TokenizerWrapper(_Wrapped(tok, tokens, specials))
    lltok = llguidance.LLTokenizer(wrapper, n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids)
    t1 = time.perf_counter()
    grammar = (
        llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        if kind == "json"
        else llguidance.LLMatcher.grammar_from_regex(REGEX)
    )
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    t2 = time.perf_counter()
    again = llguidance.LLMatcher(lltok, grammar)
    t3 = time.perf_counter()
    del again
    mask = lltorch.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in tok.encode(text, add_special_tokens=False):
        s = time.perf_counter()
        lltorch.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - s)
        assert matcher.consume_token(t), f"token {t} refused: {matcher.get_error()}"
    return {"tokenizer_s": t1 - t0, "grammar_s": t2 - t1, "second_compile_s": t3 - t2, "mask_us": times}


class _Wrapped:
    """What llguidance.TokenizerWrapper reads: token bytes, specials, EOS/BOS and an encoder."""

    def __init__(self, tok: Tokenizer, tokens: list[bytes], specials: list[int]) -> None:
        self.tok, self.tokens, self.special_token_ids = tok, tokens, specials
        self.eos_token_id = tok.eos_token_ids[0]
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)


def xgrammar_run(tok: Tokenizer, kind: str, text: str) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    tokens, _ = tok.token_bytes()
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=tok.eos_token_ids)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA)) if kind == "json" else compiler.compile_regex(REGEX)
    t2 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA)) if kind == "json" else compiler.compile_regex(REGEX)
    t3 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in tok.encode(text, add_special_tokens=False):
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - s)
        assert matcher.accept_token(t), f"token {t} refused"
    return {"tokenizer_s": t1 - t0, "grammar_s": t2 - t1, "second_compile_s": t3 - t2, "mask_us": times}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default=str(Path.home() / ".cache/treeserve/gguf/gemma-3-270m-q4_k_m.gguf"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    libraries = [("llguidance", llguidance_run)]
    try:
        import xgrammar  # noqa: F401 - only this comparison needs it

        libraries.append(("xgrammar", xgrammar_run))
    except ImportError:
        print("xgrammar is not installed (pip install -c constraints.txt xgrammar==0.2.8): llguidance only")
    tokenizers = {"arith (word-level, %d)": str(ASSETS / "arith-generator")}
    if Path(args.gguf).exists():
        tokenizers["Gemma 3 GGUF (SentencePiece-style, %d)"] = args.gguf
    columns = [
        "tokenizer",
        "constraint",
        "library",
        "tokenizer setup s",
        "first compile s",
        "second compile s",
        "mask us p50",
        "mask us mean",
        "tokens",
    ]
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for label, path in tokenizers.items():
        tok = Tokenizer(path)
        for kind, text in (("json", JSON_TEXT), ("regex", REGEX_TEXT)):
            for name, run in libraries:
                r = run(tok, kind, text)
                us = [t * 1e6 for t in r["mask_us"]]
                cells = [
                    label % tok.vocab_size,
                    kind,
                    name,
                    f"{r['tokenizer_s']:.3f}",
                    f"{r['grammar_s']:.3f}",
                    f"{r['second_compile_s']:.4f}",
                    f"{statistics.median(us):.0f}",
                    f"{statistics.mean(us):.0f}",
                    str(len(us)),
                ]
                print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
