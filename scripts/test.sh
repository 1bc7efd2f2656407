#!/usr/bin/env bash
# Runs the test suite. Sets up ./.venv (with test extras) on first use. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh "test"
if [ -z "${GLASSLM_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
    export GLASSLM_DATA_DIR="$(cd ../shared/data && pwd)"
fi
export TIKTOKEN_CACHE_DIR="${TIKTOKEN_CACHE_DIR:-${GLASSLM_DATA_DIR:-}/tiktoken_cache}"
exec python -m pytest "$@"
