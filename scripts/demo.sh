#!/usr/bin/env bash
# The main job: train the shakespeare-char-cpu model on tiny Shakespeare and print a sample.
# Sets up ./.venv on first use. Extra arguments go to `glasslm train` (e.g. --max-steps 500).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh ""  # (an explicit empty argument: a bare `source` would pass on our "$@")
# Offline machines (as on CI) keep a shared copy beside the checkout: copy it, sha256-checked, into
# the data directory every glasslm command uses (--data-dir, else $GLASSLM_DATA_DIR, else
# ~/.cache/glasslm), so later commands find it without this script. Else glasslm downloads it.
# Every known dataset the folder holds is copied (tiny Shakespeare; gpt2/: GPT-2's tokenizer files).
if [ -d ../shared/data ]; then
    glasslm fetch --from ../shared/data
fi
# --overwrite: the demo starts a fresh run in its own directory each time (glasslm refuses to
# train over an existing run otherwise).
exec glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare-char-cpu --overwrite "$@"
