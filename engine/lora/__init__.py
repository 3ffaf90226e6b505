"""Multi-LoRA in the engine: how an adapter gets from wherever it lives into a step.

One verb per move:
- **read**: the engine's AdapterProvider (provider.py, a protocol that lora_cache implements) reads an adapter by
  id (ids.py says which ids are valid) and hands back a LoRAAdapter: plain tensors per layer, checked against the
  model's LoRA shapes. Offline, `LLM(model, max_loras=..., adapters_root=...)` gets lora_cache's provider through
  an entry point, with no import of its own.
- **copy**: the slot table (slots.py) gives a request's adapter one of `max_loras` device slots, pinned while a
  request runs on it; when a slot changes hands, the scheduler lists an AdapterCopy and the runner copies the
  adapter's weights into that slot of every LoRA linear before the step. Under tensor parallelism each rank gets
  its own shard (shards.py).
- **step**: every LoRA-capable linear is wrapped (linear.py; experts' in expert_linear.py) and holds all slots'
  weights, stacked. A step's tokens name their slots; the wrappers add each token's delta from its own slot's
  weights through the LoRA backend that the step backend chose (backends.py): segments of one slot in PyTorch
  (segments.py), each token's slot in one C++ call, or tokens grouped by slot for the Triton kernels
  (triton_kernels.py). Base-only tokens skip the LoRA path.
- **merge**: merge_spec.py is LoRAX's merged_adapters spec and its cache key; lora_cache merges.

The server *registers* an adapter at run time (deployments/); that is a name for the provider to read, not a copy.
provider.py, ids.py and merge_spec.py load no torch: the serving side imports them before any model is built.
"""
