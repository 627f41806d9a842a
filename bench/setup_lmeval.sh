#!/usr/bin/env bash
# Creates the lm-evaluation-harness virtualenv used by bench/lm_eval_harness.py: lm-eval with
# its API models (local-completions / local-chat-completions) and the Hugging Face tokenizer
# backend. torch comes from this machine's disk through constraints.txt (lm-eval imports it).
set -euo pipefail
VENV=${LMEVAL_VENV:-.venv-lmeval}
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet -c constraints.txt "lm-eval[api]==0.4.13" transformers
"$VENV/bin/lm_eval" --help > /dev/null && echo "lm_eval ready: $VENV/bin/lm_eval"
