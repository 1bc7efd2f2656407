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

# llama-cpp-python (the test and bench extras: llama.cpp, the reference for GGUF files) compiles
# llama.cpp from source for this CPU (-march=native, ~7 minutes on 2 cores). pip's wheel cache would
# hand that build to a machine of another CPU kind, where it dies of an illegal instruction; so the
# wheel is built once per CPU kind, into a folder of pip's cache named by what -march=native means here.
case ",$extras," in
    *,test,*|*,bench,*)
        llama_cpp="$(grep -o 'llama-cpp-python==[0-9.]*' "$repo_root/pyproject.toml" | head -n 1)"
        cpu_kind="$( { gcc -march=native -Q --help=target 2>/dev/null || grep -m 1 '^flags' /proc/cpuinfo; } \
                     | sha256sum | cut -c1-16)"
        wheels="$("$venv/bin/python" -m pip cache dir 2>/dev/null || echo "${XDG_CACHE_HOME:-$HOME/.cache}/pip")"
        wheels="$wheels/glasslm-llama-cpp/$cpu_kind"
        if ! compgen -G "$wheels/llama_cpp_python-${llama_cpp#*==}-*.whl" >/dev/null; then
            echo "building $llama_cpp (llama.cpp for this CPU kind, $cpu_kind; ~7 minutes on 2 cores, once)" >&2
            "$venv/bin/python" -m pip wheel "${pip_args[@]}" --no-cache-dir --no-deps -w "$wheels" "$llama_cpp"
        fi
        pip_args+=(--find-links "$wheels")
        ;;
esac

stamp="$venv/.glasslm-installed"
want="$(sha256sum "$repo_root/pyproject.toml" | cut -d' ' -f1) extras=[$extras]"
if [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
    spec="$repo_root"
    [ -n "$extras" ] && spec="$repo_root[$extras]"
    "$venv/bin/python" -m pip install "${pip_args[@]}" -e "$spec"
    echo "$want" >> "$stamp"
fi
export PATH="$venv/bin:$PATH"
