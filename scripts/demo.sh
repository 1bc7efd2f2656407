#!/usr/bin/env bash
# The main job: train the shakespeare-char-cpu model on tiny Shakespeare and print a sample.
# Sets up ./.venv on first use. Extra arguments go to `glasslm train` (e.g. --max-steps 500).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh ""  # (an explicit empty argument: a bare `source` would pass on our "$@")
# Use the shared data copy when it sits beside the checkout (as on CI); else glasslm downloads it.
if [ -z "${GLASSLM_DATA_DIR:-}" ] && [ -f ../shared/data/tinyshakespeare.txt ]; then
    export GLASSLM_DATA_DIR="$(cd ../shared/data && pwd)"
fi
# --overwrite: the demo starts a fresh run in its own directory each time (glasslm refuses to
# train over an existing run otherwise).
exec glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare-char-cpu --overwrite "$@"
