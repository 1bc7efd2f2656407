#!/usr/bin/env bash
# Runs the test suite. Sets up ./.venv (with test extras) on first use. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh "test"
if [ -z "${GLASSLM_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
    export GLASSLM_DATA_DIR="$(cd ../shared/data && pwd)"
fi
export TIKTOKEN_CACHE_DIR="${TIKTOKEN_CACHE_DIR:-${GLASSLM_DATA_DIR:-}/tiktoken_cache}"
# The explorer's browser tests need Chromium; without it they are skipped, and this says so.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && [ -z "${GLASSLM_CHROMIUM:-}" ]; then
    echo "note: no Chromium found, so the explorer's browser tests will be skipped;" \
         "install it (Debian/Ubuntu: sudo apt-get install -y chromium) or set GLASSLM_CHROMIUM=/path/to/chrome" >&2
fi
# Two pytest-xdist workers, a core each (CI has 2 cores); tests that need the machine to themselves are
# marked `alone` (tests/conftest.py). Passing -n N (-n 0: serially) or -p no:xdist replaces this.
workers=(-n 2 --dist loadgroup)
for arg in "$@"; do
    case "$arg" in -n|-n[0-9]*|-nauto|--numprocesses*|no:xdist|-pno:xdist) workers=() ;; esac
done
exec python -m pytest ${workers[@]+"${workers[@]}"} "$@"
