"""The command line: the generate demo runs, and bad input gets a clear error (exit 2)."""

from __future__ import annotations

from treeserve.cli import main


def test_generate_runs(llama_dir, capsys):
    code = main(["generate", "--model", llama_dir, "--raw", "hello", "--n", "2", "--max-tokens", "5",
                 "--kv-cache-memory", str(8 << 20), "--dtype", "float32"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0
    assert "=== hello" in out.out and "completion 1" in out.out and "tok/s" in out.err


def test_bad_input_exits_2(llama_dir, capsys):
    assert main(["generate", "--model", "/does/not/exist"]) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert main(["generate", "--model", llama_dir, "--n", "0", "x", "--kv-cache-memory", str(8 << 20)]) == 2
    assert "n must be" in capsys.readouterr().err
