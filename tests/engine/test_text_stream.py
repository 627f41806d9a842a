"""`TextStream` returns, at every step, what `tokenizers`' `DecodeStream` returns (errors included).

Every comparison runs the real `DecodeStream` beside it: the shipped arithmetic tokenizer (WordLevel
+ Fuse), a byte-level BPE, SentencePiece-style vocabularies as `gguf_tokenizer.py` builds them (with
and without the leading-space Strip), a Metaspace decoder, with and without
`skip_special_tokens`, over every token id after contexts of several lengths and over random
sequences rich in special tokens, byte pieces, lone continuation bytes and ids past the vocabulary.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

from tests.tiny_models import train_tokenizer
from treeserve import SamplingParams
from treeserve.engine.detokenizer import StopChecker
from treeserve.engine.text_stream import DecodeSteps, JoinedStream, TextStream, qualifies, stream_table, text_stream
from treeserve.models.gguf_tokenizer import _spm_tokenizer
from treeserve.models.tokenizer import _byte_level_alphabet

TEXT = "Step 1: 12 + 7 = 19. Café, naïve, 日本語 and 🙂, x▁y.\n\nThe answer is 42."
SPM_PIECES = ["▁", "a", "b", "▁a", "▁the", "é", "日本", "▁日本", "▁▁", "x▁y", "�", "a�", "<0xZZ>", "<0x+A>", "1", "2"]
SPECIALS = ["<unk>", "<s>", "</s>", "<start_of_turn>"]


def spm(strip: bool) -> Tokenizer:
    """A SentencePiece vocabulary as a GGUF file's ("llama" model): byte pieces, ▁ as a space; with
    `strip` (add_space_prefix, Llama 2) the decoder strips one leading space (Gemma 3's does not)."""
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    tok = _spm_tokenizer(tokens, np.zeros(len(tokens), np.float32), 0, strip)
    tok.add_tokens([AddedToken("<user_tok>", special=False, normalized=False)])  # GGUF's user-defined
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def byte_level() -> Tokenizer:
    tok = train_tokenizer()
    tok.add_tokens([AddedToken("héllo wörld", special=False, normalized=False)])  # outside the alphabet
    return tok


def metaspace() -> Tokenizer:
    words = ["<unk>", "<s>", "▁a", "b", "▁", "c▁d", "�▁", "▁▁x", "日"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>", "<unk>"])
    return tok


def arithmetic() -> Tokenizer:
    return Tokenizer.from_file("treeserve/assets/arith-generator/tokenizer.json")


def wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "##s": 2, "cat": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


FAMILIES = {"arithmetic": arithmetic, "byte_level": byte_level, "spm_strip": lambda: spm(True)}
FAMILIES |= {"spm": lambda: spm(False), "metaspace": metaspace}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tok(request) -> Tokenizer:
    return FAMILIES[request.param]()


def steps(step, ids: list[int]) -> list:
    """Each step's return value; an error ends the list as ("error", message)."""
    out = []
    for token in ids:
        try:
            out.append(step(token))
        except Exception as e:  # DecodeStream raises a plain Exception
            out.append(("error", str(e)))
            break
    return out


def expected(tok: Tokenizer, context: list[int], ids: list[int], skip: bool) -> list:
    stream = DecodeStream(ids=context, skip_special_tokens=skip)
    return steps(lambda token: stream.step(tok, token), ids)


def fast(tok: Tokenizer, context: list[int], ids: list[int], skip: bool) -> list:
    table = stream_table(tok, skip)
    assert table is not None, "the decoder should qualify"
    stream = text_stream(tok, context, skip)
    assert isinstance(stream, JoinedStream if table.joins_bytes else TextStream)
    return steps(stream.step, ids)


def vocab_size(tok: Tokenizer) -> int:
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def contexts(tok: Tokenizer) -> list[list[int]]:
    """Prompt tails: none, one token, a special token alone, 3 and 6 tokens of text."""
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    special = next(iter(tok.get_added_tokens_decoder()))
    return [[], ids[:1], [special], ids[3:6], ids[-6:], [special, *ids[:5]]]


@pytest.mark.parametrize("skip", [True, False])
def test_every_token_after_each_context(tok, skip):
    follow = tok.encode("a b", add_special_tokens=False).ids  # what the window left shows in the next chunks
    for context in contexts(tok):
        for token in range(vocab_size(tok)):
            ids = [token, *follow]
            assert fast(tok, context, ids, skip) == expected(tok, context, ids, skip), (context, token)


@pytest.mark.parametrize("skip", [True, False])
def test_text_with_split_characters(tok, skip):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    for cut in range(0, 7):
        context, rest = ids[:cut], ids[cut:]
        chunks = fast(tok, context, rest, skip)
        assert chunks == expected(tok, context, rest, skip)
    assert "".join(c for c in fast(tok, [], ids, skip) if c) == tok.decode(ids, skip_special_tokens=skip)


def random_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """Token ids rich in special tokens, single bytes (lone lead and continuation bytes: invalid
    UTF-8) and ids past the vocabulary."""
    size = vocab_size(tok)
    specials = list(tok.get_added_tokens_decoder())
    singles = [i for i in range(size) if (t := tok.id_to_token(i)) and (t.startswith("<0x") or ord(t[-1]) > 127)]
    pools = [specials, singles, singles, list(range(size, size + 3)), list(range(size)), list(range(size))]
    pools = [pool for pool in pools if pool]  # the arithmetic vocabulary has no single bytes
    return [rng.choice(rng.choice(pools)) for _ in range(n)]


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences(tok, skip):
    rng = random.Random(0)
    for _ in range(400):
        context = random_ids(tok, rng, rng.randrange(0, 7))
        ids = random_ids(tok, rng, rng.randrange(1, 24))
        assert fast(tok, context, ids, skip) == expected(tok, context, ids, skip), (context, ids)


@pytest.mark.parametrize("skip", [True, False])
def test_extend_gives_the_steps_chunks_joined_and_their_state(tok, skip):
    """`extend` over runs of tokens, between single steps: the chunks `step` gives, joined, and a
    stream whose later steps give what a stream stepped token by token gives (errors included)."""
    rng = random.Random(2)
    for _ in range(300):
        context = random_ids(tok, rng, rng.randrange(0, 7))
        ids = random_ids(tok, rng, rng.randrange(1, 30))
        reference = expected(tok, context, ids, skip)
        stream, got, at = text_stream(tok, context, skip), [], 0
        while at < len(ids) and not (got and isinstance(got[-1], tuple)):
            run = ids[at : at + rng.choice([1, 1, 2, 5, 30])]
            want = reference[at : at + len(run)]
            if any(isinstance(c, tuple) for c in want):  # an error inside: step up to it
                got += steps(stream.step, run)
            else:
                got.append(stream.extend(run))
                assert got[-1] == "".join(c for c in want if c), (context, ids, at)
            at += len(run)
        if not any(isinstance(c, tuple) for c in reference):
            assert "".join(c for c in got if c) == "".join(c for c in reference if c)
        tail = tok.encode("a b", add_special_tokens=False).ids
        assert steps(stream.step, tail) == expected(tok, context, ids + tail, skip)[len(ids) :] or any(
            isinstance(c, tuple) for c in reference
        ), (context, ids)


def test_byte_level_extend_decodes_once():
    """On a byte-level BPE, `extend` makes the text of many tokens in one decode, whatever their bytes."""
    tok = byte_level()
    letter = {b: tok.token_to_id(c) for b, c in _byte_level_alphabet().items()}
    ids = [letter[b] for b in "日本 and 🙂, 42.".encode()]
    stream = text_stream(tok, [letter[ord("H")]], True)
    assert isinstance(stream, JoinedStream)
    assert stream.extend(ids) == "日本 and 🙂, 42."
    assert stream.extend(ids[:2]) == "" and stream.extend(ids[2:3]) == "日"  # a character split over runs


def test_byte_level_lossy_utf8_as_tokenizers_decodes_it():
    """`JoinedStream` decodes with Python's lossy UTF-8 where tokenizers uses Rust's: byte runs of
    every kind (truncated, overlong, surrogate and out-of-range sequences, lone continuations) give
    the same chunks."""
    tok = byte_level()
    letter = {b: tok.token_to_id(c) for b, c in _byte_level_alphabet().items()}
    rng = random.Random(1)
    leads = [0xC0, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF]
    for _ in range(3000):
        data = [
            rng.choice([rng.randrange(256), rng.choice(leads), rng.randrange(0x80, 0xC0), 0x61])
            for _ in range(rng.randrange(1, 10))
        ]
        ids = [letter[b] for b in data]
        assert fast(tok, [letter[0x61]], ids, True) == expected(tok, [letter[0x61]], ids, True), data


def test_split_characters_wait_and_invalid_bytes_show_later():
    """SentencePiece byte pieces: nothing until a character is whole; DecodeStream's InvalidPrefix
    error where an invalid run is followed by text (mirrored); byte-level: a lone continuation byte
    comes out as U+FFFD with the next text; a prompt ending mid-character puts the prompt's text in
    the first chunk."""
    tok = spm(False)
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    emoji = [byte[x] for x in "🙂".encode()]
    for ids in ([*emoji, a], [byte[0xE6], byte[0x97], byte[0xA5], b], [byte[0x41], byte[0xE6], b]):
        assert fast(tok, [a], ids, True) == expected(tok, [a], ids, True)
    assert fast(tok, [a], emoji, True) == [None, None, None, "🙂"]
    assert fast(tok, [a], [byte[0x41], byte[0xE6], b], True)[-1][0] == "error"

    bl = byte_level()
    letter = {b: bl.token_to_id(c) for b, c in _byte_level_alphabet().items()}
    ids = [letter[0x97], letter[ord("e")], letter[0xE6], letter[0x97], letter[0xA5]]
    assert fast(bl, [letter[ord("H")]], ids, True) == [None, "\ufffde", None, None, "日"]
    context = [letter[ord("H")], letter[0xE6]]
    assert fast(bl, context, [letter[0x97], letter[0xA5]], True) == [None, "H日"]
    assert expected(bl, context, [letter[0x97], letter[0xA5]], True) == [None, "H日"]


def test_decoders_that_qualify():
    spm_steps = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}]
    spm_steps += [{"type": "ByteFallback"}, {"type": "Fuse"}]
    strip = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
    yes = [{"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]
    yes += [{"type": "Fuse"}, {"type": "Sequence", "decoders": spm_steps}]
    yes += [{"type": "Sequence", "decoders": [*spm_steps, strip]}]
    yes += [{"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}]
    no = [None, {"type": "WordPiece", "prefix": "##", "cleanup": True}, {"type": "BPEDecoder", "suffix": "</w>"}]
    no += [{"type": "CTC", "pad_token": "<pad>", "word_delimiter_token": "|", "cleanup": True}]
    no += [{"type": "Sequence", "decoders": [*spm_steps, {**strip, "start": 2}]}]
    no += [{"type": "Sequence", "decoders": spm_steps[1:]}, {"type": "Sequence", "decoders": [strip, *spm_steps]}]
    no += [{"type": "Metaspace", "replacement": "_", "prepend_scheme": "always", "split": True}]
    no += [{"type": "Sequence", "decoders": [{"type": "ByteLevel"}]}]
    assert all(qualifies(d) for d in yes)
    assert not any(qualifies(d) for d in no)


def test_wordpiece_falls_back_to_decode_stream():
    tok = wordpiece()
    assert stream_table(tok, True) is None
    stream = text_stream(tok, [1], True)
    assert isinstance(stream, DecodeSteps)
    ids = tok.encode("the cat the", add_special_tokens=False).ids + [2, 0, 3]
    assert steps(stream.step, ids) == expected(tok, [1], ids, True)
    assert text_stream(tok, [1], True).extend(ids) == "".join(c for c in expected(tok, [1], ids, True) if c)


def test_table_is_cached_per_tokenizer_and_follows_its_decoder():
    tok = byte_level()
    assert stream_table(tok, True) is stream_table(tok, True)
    assert stream_table(tok, False) is not stream_table(tok, True)
    tok.decoder = decoders.WordPiece()
    assert stream_table(tok, True) is None


@pytest.mark.parametrize("skip", [True, False])
def test_stop_checker_text_and_clones(tok, skip):
    """StopChecker's text, stop strings and clones (n > 1) as with DecodeStream's chunks."""
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    specials = list(tok.get_added_tokens_decoder())
    ids = ids[:5] + specials[:1] + ids[5:]
    prompt = tok.encode("The answer", add_special_tokens=False).ids
    params = SamplingParams(max_tokens=None, skip_special_tokens=skip, stop=["answer is"])
    checker = StopChecker(tok, prompt, params, [])
    reference = expected(tok, prompt[-6:], ids, skip)
    text, result = "", None
    for n, (token, chunk) in enumerate(zip(ids, reference, strict=True)):
        if n == len(ids) // 2:
            twin = checker.clone(ids[:n])
        result = checker.append(token)
        text += chunk or ""
        if result:
            break
    assert checker.text == (text[: text.index("answer is")] if result else text)
    assert twin.text == "".join(c or "" for c in reference[: len(ids) // 2])


@pytest.mark.parametrize("include", [True, False])
@pytest.mark.parametrize("read_every_token", [True, False])
def test_text_without_stop_strings_is_made_when_read(tok, include, read_every_token):
    """Without stop strings the text is made when read: the same text read after every token or
    once at the end, as DecodeStream's chunks give it; the ending token's text only when asked."""
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    prompt = tok.encode("The answer", add_special_tokens=False).ids
    end = tok.encode("answer", add_special_tokens=False).ids[0]  # a token of text, not a special one
    ids = [t for t in ids if t != end] + [end]
    params = SamplingParams(max_tokens=None, stop_token_ids=[end], include_stop_str_in_output=include)
    checker = StopChecker(tok, prompt, params, [])
    reference = expected(tok, prompt[-6:], ids, True)
    texts = []
    for token in ids[:-1]:
        assert checker.append(token) is None
        if read_every_token:
            texts.append(checker.text)
    assert checker.append(end) == ("stop", end)
    chunks = [c or "" for c in reference]
    assert checker.text == "".join(chunks if include else chunks[:-1])
    if read_every_token:
        assert texts == ["".join(chunks[: i + 1]) for i in range(len(ids) - 1)]


class CountingTokenizer:
    """Stands in for the tokenizer inside a TextStream, counting its `decode` calls."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.calls = tok, 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False])
def test_whole_characters_after_a_text_context_never_decode(tok, skip):
    """The shortcut's reach: tokens of whole characters after a context of text decode nothing."""
    table = stream_table(tok, skip)
    ids = [i for i in tok.encode(TEXT, add_special_tokens=False).ids if table.texts[i] is not None]
    counting = CountingTokenizer(tok)
    stream = JoinedStream(table, ids[:6]) if table.joins_bytes else TextStream(counting, table, ids[:6], skip)
    calls = counting.calls  # the context's text, once
    assert steps(stream.step, ids[6:]) == expected(tok, ids[:6], ids[6:], skip)
    assert calls <= 1 and counting.calls == calls
