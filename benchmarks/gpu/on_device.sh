#!/usr/bin/env bash
# One call on a GPU machine: the CUDA tests (kernels natively, decode graphs with and without adapters, the
# engine's HF and PEFT equivalence on CUDA) and the C++ CPU operators' tests, then the GPU benchmark. Logs and
# results go to $OUT (or ./gpu-out).
#
#   bash benchmarks/gpu/on_device.sh TOKENIZER_CACHE [quick|full|tests|bench]
#
# TOKENIZER_CACHE is a lora-serve cache folder ($LORA_SERVE_CACHE) whose models/smollm2-135m-instruct holds
# SmolLM2's config.json and tokenizer files but no weights: the tests that need SmolLM2's tokenizer run, the
# few that need its real weights are marked slow and left out. The image needs torch, transformers, peft and
# triton; Ray, FastAPI, bitsandbytes and llguidance are not needed (the engine imports without them).
set -uo pipefail
cache=$(realpath "$1"); mode=${2:-quick}
out=${OUT:-gpu-out}; mkdir -p "$out"
export LORA_SERVE_CACHE="$cache" LORA_SERVE_DEVICE=cuda PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$out/device.txt"

if [[ $mode != bench ]]; then
  tests=(tests/test_paged_attention_kernel.py tests/test_lora_kernels.py tests/test_cuda_ops.py
         tests/test_cuda_graphs.py tests/test_hf_equivalence.py tests/test_multi_lora.py tests/test_lora_layer.py
         tests/test_sampling.py tests/test_scheduler.py tests/test_prefix_caching.py tests/test_async_engine.py
         tests/test_attention.py tests/test_model_files.py)
  # the C++ CPU operators and their own parallel loop on the host's CPU (a Xeon with AMX on the kinds seen);
  # CPU_OPS_TESTS=0 skips them, to keep a short device lease for the CUDA tests
  [[ ${CPU_OPS_TESTS:-1} != 0 ]] && tests+=(tests/test_cpu_ops.py tests/test_work_pool.py)
  # -k: the penalty and typical-p reference tests run the real SmolLM2, and the embedded model's test looks for
  # its converted weights, which are not carried
  skip="not presence_and_frequency and not tiny_typical_p and not embedded_model_resolves"
  timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -m "not slow" -k "$skip" -p no:cacheprovider \
    -v -rfEs --durations=15 --timeout "${PER_TEST_TIMEOUT:-120}" \
    --junitxml="$out/tests.xml" "${tests[@]}" 2>&1 | tee "$out/tests.log" | grep -v PASSED | tail -60
fi
if [[ $mode != tests ]]; then
  flag=$([[ $mode == full ]] && echo "" || echo "--quick")
  timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks gpu $flag --tokenizer "$cache/models/smollm2-135m-instruct" \
    --out "$out" 2>&1 | tee "$out/bench.log" | tail -80
  timeout "${PROFILE_TIMEOUT:-150}" python3 -m benchmarks gpu_profile \
    --tokenizer "$cache/models/smollm2-135m-instruct" --out "$out" 2>&1 | tail -8
fi
