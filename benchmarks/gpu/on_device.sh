#!/usr/bin/env bash
# One call on a GPU machine: the CUDA tests (kernels natively, decode graphs with and without adapters, the
# engine's HF and PEFT equivalence on CUDA) and the C++ CPU operators' tests, then the GPU benchmark; or, in the
# serve mode, the HTTP server on the GPU. Logs and results go to $OUT (or ./gpu-out).
#
#   bash benchmarks/gpu/on_device.sh TOKENIZER_CACHE [quick|full|tests|bench|serve|verify]
#
# TOKENIZER_CACHE is a lora-serve cache folder ($LORA_SERVE_CACHE) whose models/smollm2-135m-instruct holds
# SmolLM2's config.json and tokenizer files but no weights, or the archive of one that benchmarks/gpu/carry.sh
# packs (.gpu/tokenizer-cache.tar.xz, unpacked here into $out/cache): the tests that need SmolLM2's tokenizer run, the
# few that need its real weights are marked slow and left out. The image needs torch, transformers, peft and
# triton; Ray, FastAPI, bitsandbytes and llguidance are not needed (the engine imports without them).
#
# serve: the serving wheels (benchmarks/gpu/install_wheelhouse.sh, the .gpu-wheels folder carried), then
# `python -m benchmarks gpu_serve` (`serve run` of a Llama-3-8B-shape model with 16 adapters, loaded over HTTP, against
# its engine offline; in one process without Ray where Ray cannot start), then the serving tests (OpenAI and LoRAX
# routes, streaming, adapter lifecycle, abort on disconnect; none that needs llguidance, bitsandbytes or SmolLM2's
# weights), a short list of CUDA tests and the GPU benchmark with --quick. The whole call stays within SERVE_BUDGET
# seconds (340, for a 6-minute device limit): each phase runs under its own timeout, cut to the time left, and is
# skipped with under 20 s left; $OUT/phases.txt says how each ended.
#
# verify: what docs/gpu.md's table of CUDA paths needs to turn a "not yet" into a device and a commit, in the same
# budgeted phases: the opt-in paths' tests with their options on, their figures against the defaults, then the
# serving wheels, gpu_serve and the serving tests (below).
set -uo pipefail
cache=$(realpath "$1"); mode=${2:-quick}
out=${OUT:-gpu-out}; mkdir -p "$out"
if [[ $cache == *.tar.xz ]]; then  # the tokenizer folder as carried, packed (a fifth of its size)
  mkdir -p "$out/cache" && tar -xJf "$cache" -C "$out/cache" && cache=$(realpath "$out/cache")
fi
export LORA_SERVE_CACHE="$cache" LORA_SERVE_DEVICE=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.
tokenizer="$cache/models/smollm2-135m-instruct"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$out/device.txt"

# -k: the penalty and typical-p reference tests run the real SmolLM2, and the embedded model's test looks for
# its converted weights, which are not carried
skip="not presence_and_frequency and not tiny_typical_p and not embedded_model_resolves"

cuda_tests() {  # cuda_tests SECONDS NAME FILE...: the CUDA tests of the files that exist, logs in $out/NAME.*
  local limit=$1 name=$2 files=() f; shift 2
  for f in "$@"; do [[ -f $f ]] && files+=("$f"); done
  timeout -k 10 "$limit" python3 -m pytest -m "not slow" -k "$skip" -p no:cacheprovider \
    -v -rfEs --durations=15 --timeout "${PER_TEST_TIMEOUT:-120}" \
    --junitxml="$out/$name.xml" "${files[@]}" 2>&1 | tee "$out/$name.log" | grep -v PASSED | tail -60
  return "${PIPESTATUS[0]}"
}

budget_end=0
phase() {  # phase NAME SECONDS COMMAND...: COMMAND under the smaller of SECONDS and what is left of the budget
  local name=$1 limit=$2 left=$(( budget_end - SECONDS )) start=$SECONDS rc; shift 2
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "$name: skipped, ${left} s of the budget left" | tee -a "$out/phases.txt"; return; fi
  echo "== $name (at most $limit s)"
  "$@" "$limit"; rc=$?
  echo "$name: exit $rc after $(( SECONDS - start )) s of at most $limit" | tee -a "$out/phases.txt"
}
wheelhouse() { timeout -k 5 "$1" bash benchmarks/gpu/install_wheelhouse.sh 2>&1 | tee "$out/install.log"; }
# SIGTERM at the limit stops its server first (run_gpu_serve.py), with 20 s for that before SIGKILL;
# GPU_SERVE_ARGS adds options (--quick, --no-ray)
gpu_serve() {
  # shellcheck disable=SC2086
  timeout -k 20 "$1" python3 -m benchmarks gpu_serve --tokenizer "$tokenizer" --out "$out" \
    --start-timeout "${SERVE_START_TIMEOUT:-120}" ${GPU_SERVE_ARGS:-} 2>&1 | tee "$out/gpu_serve.log"
}
# the serving tests without Ray (test_in_process) and through a Serve cluster (test_serve): the routes against the
# offline engine, streaming, adapters and their lifecycle, abort on disconnect; SERVE_TESTS_K widens the choice
# (e.g. "not structured and not response_format": every test of both files that needs no llguidance); pytest's -k
# takes no line breaks
serve_k="(test_in_process or generate_matches_offline or generate_stream_sends or adapter_requests_match"
serve_k+=" or openai_completions_and_chat_match or lorax_client_generate_stream or streamed_echo"
serve_k+=" or openai_n_choices or client_disconnect or lora_lifecycle or bad_adapters_are_refused)"
serve_k+=" and not structured and not response_format"
serving_tests() {
  timeout -k 10 "$1" python3 -m pytest -k "${SERVE_TESTS_K:-$serve_k}" -p no:cacheprovider -v -rfEs \
    --continue-on-collection-errors --durations=10 --timeout "${SERVE_PER_TEST_TIMEOUT:-90}" \
    --junitxml="$out/serve-tests.xml" tests/test_in_process.py tests/test_serve.py 2>&1 \
    | tee "$out/serve-tests.log" | grep --line-buffered -v PASSED
  return "${PIPESTATUS[0]}"
}
short_cuda_tests() {
  cuda_tests "$1" tests tests/test_paged_attention_kernel.py tests/test_paged_prefill_kernel.py \
    tests/test_lora_kernels.py tests/test_cuda_ops.py tests/test_cuda_graphs.py tests/test_multi_lora.py \
    tests/test_async_scheduling.py tests/test_async_engine.py
}
# the opt-in paths of docs/gpu.md's table with their options on: the Triton and FlexAttention prefill kernels
# natively and in the engine (cuda_prefill), async scheduling against the synchronous engine and in the async
# engine, the grouped expert product natively and mixtures of experts on either expert path (cuda_experts)
opt_in_tests() {
  cuda_tests "$1" opt-in-tests tests/test_gpu_paths.py tests/test_paged_prefill_kernel.py \
    tests/test_async_scheduling.py tests/test_async_engine.py tests/test_grouped_gemm.py tests/test_moe.py
}
bench() {  # bench SECONDS [OPTION...]: python -m benchmarks gpu --quick, with the options
  local limit=$1; shift
  timeout -k 10 "$limit" python3 -m benchmarks gpu --quick "$@" --tokenizer "$tokenizer" --out "$out" 2>&1 \
    | tee "$out/bench.log" | tail -40
  return "${PIPESTATUS[0]}"
}
# the opt-in paths measured against the defaults they would replace, in the same run (prefill on each cuda_prefill
# kernel, decode at many sequences with and without async scheduling), with their yardsticks and the 32 adapters
opt_in_bench() { bench "$1" --sections bandwidth,decode_bound,prefill,decode,lora; }
report() {
  echo "== phases"; cat "$out/phases.txt"
  [[ -f $out/gpu_serve.md ]] && { echo "== gpu_serve.md"; cat "$out/gpu_serve.md"; }
  exit 0
}

if [[ $mode == serve ]]; then
  budget_end=$(( SECONDS + ${SERVE_BUDGET:-340} ))
  : > "$out/phases.txt"
  phase "wheelhouse" "${INSTALL_TIMEOUT:-90}" wheelhouse
  phase "gpu_serve" "${SERVE_TIMEOUT:-220}" gpu_serve
  phase "serving tests" "${SERVE_TESTS_TIMEOUT:-120}" serving_tests
  phase "CUDA tests" "${TEST_TIMEOUT:-120}" short_cuda_tests
  phase "gpu --quick" "${BENCH_TIMEOUT:-300}" bench
  report
fi

# verify: what turns a "not yet" of docs/gpu.md's table into a device and a commit, most telling first, within
# VERIFY_BUDGET seconds (340, for a 6-minute device limit). VERIFY_PHASES names the phases to run (all by
# default; a rerun names those the first call skipped): opt_in_tests opt_in_bench wheelhouse gpu_serve serving_tests
if [[ $mode == verify ]]; then
  budget_end=$(( SECONDS + ${VERIFY_BUDGET:-340} ))
  : > "$out/phases.txt"
  wanted=" ${VERIFY_PHASES:-opt_in_tests opt_in_bench wheelhouse gpu_serve serving_tests} "
  chosen() { [[ $wanted == *" $1 "* ]]; }
  chosen opt_in_tests && phase "opt-in tests" "${TEST_TIMEOUT:-90}" opt_in_tests
  chosen opt_in_bench && phase "opt-in bench" "${BENCH_TIMEOUT:-150}" opt_in_bench
  chosen wheelhouse && phase "wheelhouse" "${INSTALL_TIMEOUT:-60}" wheelhouse
  chosen gpu_serve && GPU_SERVE_ARGS=${GPU_SERVE_ARGS:---quick} phase "gpu_serve" "${SERVE_TIMEOUT:-150}" gpu_serve
  chosen serving_tests && phase "serving tests" "${SERVE_TESTS_TIMEOUT:-90}" serving_tests
  report
fi

if [[ $mode != bench ]]; then
  tests=(tests/test_paged_attention_kernel.py tests/test_paged_prefill_kernel.py tests/test_async_scheduling.py
         tests/test_lora_kernels.py tests/test_cuda_ops.py
         tests/test_cuda_graphs.py tests/test_hf_equivalence.py tests/test_multi_lora.py tests/test_lora_layer.py
         tests/test_sampling.py tests/test_scheduler.py tests/test_prefix_caching.py tests/test_async_engine.py
         tests/test_attention.py tests/test_model_files.py)
  # the C++ CPU operators and their own parallel loop on the host's CPU (a Xeon with AMX on the kinds seen);
  # CPU_OPS_TESTS=0 skips them, to keep a short device lease for the CUDA tests
  [[ ${CPU_OPS_TESTS:-1} != 0 ]] && tests+=(tests/test_cpu_ops.py tests/test_work_pool.py)
  cuda_tests "${TEST_TIMEOUT:-330}" tests "${tests[@]}"
fi
if [[ $mode != tests ]]; then
  flag=$([[ $mode == full ]] && echo "" || echo "--quick")
  timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks gpu $flag --tokenizer "$tokenizer" \
    --out "$out" 2>&1 | tee "$out/bench.log" | tail -80
  timeout "${PROFILE_TIMEOUT:-150}" python3 -m benchmarks gpu_profile \
    --tokenizer "$tokenizer" --out "$out" 2>&1 | tail -8
fi
