"""Tensor parallelism: one model's every decoder layer split over N workers, as Megatron-LM splits it.

Each worker holds 1/N of every layer: attention by KV-head groups (its query heads and the KV heads they read, and
the KV cache of those heads alone), the MLP's gate/up columns and down rows, and the embedding and LM head by
vocabulary. A column-parallel linear (q/k/v, gate/up) needs no communication; a row-parallel one (o, down) sums
its partial outputs over the workers in one all-reduce, so a decoder layer costs two all-reduces, the embedding
one and the LM head one all-gather of the logits.

- `parallel.py`: `TensorParallel`, this worker's rank, the world size and the process group, passed explicitly
  to whatever communicates; at world size 1 it holds no group and every collective returns its input.
- `process_group.py`: joining a tensor-parallel group over torch.distributed (NCCL on CUDA, gloo on CPU).
- `shards.py`: which slice of a full tensor a rank keeps, and the refusal of sizes that do not split evenly.
- `linears.py`: column- and row-parallel linears built from a loaded model's linears.

The vocabulary-parallel embedding and LM head are layers (engine/layers/vocab_parallel.py). The executor that runs
a step over N workers, their loop and their launchers are engine/executor/: this package is the layers' building
blocks, and imports nothing above them.

The model classes say how their own layers split (`check_tensor_parallel` and `shard` in engine/models/llama.py
and gpt2.py); `engine.models.check_tensor_parallel(hf_config, N)` refuses sizes that do not split, naming both
numbers, and `engine.models.load_model(..., parallel=...)` loads the full checkpoint and keeps this rank's shards
before the linears are prepacked. A sharded model runs the modules' path layer by layer: the C++ decoder stack
(engine/models/decoder_stack.py) and CUDA graphs are not built for it.
"""
