#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs glasslm with the given extras into it.
# Idempotent: reinstalls only when pyproject.toml or the extras change.
# Usage: source scripts/venv.sh [extras]   (e.g. "test")
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
venv="$repo_root/.venv"
python_bin="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python_bin" -m venv "$venv"
fi

# A local wheel directory (as on these machines) lets pip take the CPU build of torch
# instead of the registry's default CUDA build; elsewhere pip uses the package index alone.
pip_args=(--quiet --disable-pip-version-check)
[ -d /opt/wheels ] && pip_args+=(--find-links /opt/wheels)

stamp="$venv/.glasslm-installed"
want="$(sha256sum "$repo_root/pyproject.toml" | cut -d' ' -f1) extras=[$extras]"
if [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
    spec="$repo_root"
    [ -n "$extras" ] && spec="$repo_root[$extras]"
    "$venv/bin/python" -m pip install "${pip_args[@]}" -e "$spec"
    echo "$want" >> "$stamp"
fi
export PATH="$venv/bin:$PATH"
