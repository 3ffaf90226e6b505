"""Model runner: owns the model and the paged KV cache, and runs a scheduled step through them.

What differs by device (the cache's memory, the attention and LoRA metadata, the fused operators, graphs) is the
step backend's (engine/backends/), chosen once here; the step's flat batch is the StepBuilder's
(engine/step_inputs.py). Logits are computed only for the rows that sample, and, for requests that ask for prompt
logprobs, for their prompt tokens (a slice of rows at a time).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.backends import step_backend
from engine.config import EngineConfig
from engine.distributed.parallel import TensorParallel
from engine.forward_batch import ForwardBatch, ScoredRows
from engine.kv_layout import kv_layout
from engine.lora.backends import LoRAStepState, TokenSlots
from engine.lora.linear import wrap_lora_linears
from engine.lora.segments import AdapterRun, padding_allowance, token_slots
from engine.memory import MemoryReport, weight_bytes
from engine.models import load_model, lora_shapes, use_fused_ops
from engine.models.moe import wrap_expert_loras
from engine.sampler import token_logprobs, token_ranks
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.step_inputs import PromptChunkScoring, StepBuilder, StepInputs, decodes_first, is_decode


@dataclass
class PromptScores:
    """Log-probabilities of prompt tokens first_index, first_index + 1, ... of seq, computed in this step."""
    seq: Sequence
    first_index: int
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    ranks: list[int]  # each token's rank among the vocabulary's, 1 for the most likely


@dataclass
class StepResult:
    logits: torch.Tensor  # [rows, vocab] in the model's dtype (the sampler widens them where it must)
    sampling: list[ScheduledSeq]  # the sequences that sample this step, 1 + len(draft) rows each
    prompt_scores: list[PromptScores]


class ModelRunner:
    expert_lora = False  # whether adapters may target the model's experts (set by _wrap_lora_linears)

    def __init__(self, config: EngineConfig, model_path: Path, hf_config, max_model_len: int,
                 parallel: TensorParallel | None = None, agree_blocks: Callable[[int], int] | None = None):
        """parallel: this rank's share of a tensor-parallel model (engine/distributed/), its cache its own KV heads;
        agree_blocks: the KV blocks every rank allocates, given this rank's count (all ranks hold the same)."""
        self.device, self.dtype = config.backend.torch_device, config.compute_dtype
        model = config.model
        if self.dtype != model.torch_dtype:
            warnings.warn(f"{model.dtype} has no native matrix math on this CPU (no AVX-512 BF16, AMX or "
                          f"AVX-NE-CONVERT): the model computes in float32 on its {model.dtype} weights", stacklevel=2)
        self.backend = backend = step_backend(config, sharded=parallel is not None and parallel.sharded)
        self.model = load_model(model_path, hf_config, self.dtype, self.device, max_model_len, model.quantization,
                                model.load_format, backend.packing, weight_dtype=model.torch_dtype, parallel=parallel)
        self.kv_window = self.model.kv_window  # None, or the window every layer attends over
        kv_dtype = config.kv_torch_dtype
        self.layout = kv_layout(config, self.model.kv_shape, kv_dtype, backend.free_memory, agree_blocks)
        self.kv_caches = backend.allocate_kv_cache(self.layout.cache_shape(backend.scratch_blocks), kv_dtype)
        if backend.fused_ops is not None:
            use_fused_ops(self.model, backend.fused_ops)
        backend.bind_model(self.model)
        self.steps = StepBuilder(backend, config.cache.block_size, self.model.long_rope_rows)
        self.lora_state = LoRAStepState()
        self.max_loras = config.lora.max_loras
        self.lora_layers = self._wrap_lora_linears(config, hf_config) if config.lora.max_loras else []
        backend.place_model(self.model, self.kv_caches, self.lora_state, config)  # after the LoRA wrappers
        self.graphs = backend.decode_graphs(self.model, self.kv_caches, self.lora_state, config, max_model_len,
                                            self.layout.num_blocks)

    def _wrap_lora_linears(self, config: EngineConfig, hf_config) -> list:
        """The model's LoRA-capable linears wrapped with max_loras slots each (and a mixture's experts given slots
        of their own, under "mlp.experts"), and the padding their row cost allows a step's adapter segments
        (lora_padding)."""
        lora = self.backend.lora
        slots = config.lora
        layers = wrap_lora_linears(self.model, self.lora_state, slots.max_loras, slots.max_lora_rank, self.dtype, lora)
        experts = wrap_expert_loras(self.model, lora_shapes(hf_config, slots.expert_lora), self.lora_state,
                                    slots.max_loras, slots.max_lora_rank, self.dtype, lora)
        self.expert_lora = any(lora is not None for lora in experts)
        for layer, lora in zip(layers, experts):
            if lora is not None:
                layer["mlp.experts"] = lora
        linears = [lora for layer in layers for lora in layer.values()]
        self.lora_padding = padding_allowance(sum(lora.row_flops for lora in linears) // len(linears))
        return layers

    def copy_adapter(self, slot: int, adapter) -> None:
        """Copy a LoRAAdapter's weights into device slot `slot` of every LoRA layer (under tensor parallelism, this
        rank's shard of it: engine/lora/shards.py)."""
        for index, layer in enumerate(self.lora_layers):
            weights = adapter.layers.get(index, {})
            for lora in layer.values():
                lora.load_slot(slot, weights)

    def memory_report(self) -> MemoryReport:
        slots = [lora.packed for layer in self.lora_layers for lora in layer.values()]
        lay = self.layout
        return MemoryReport(weight_bytes(self.model, exclude=slots), lay.bytes_per_token, lay.num_blocks,
                            lay.block_size, sum(s.untyped_storage().nbytes() for s in slots))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], pending_tokens: torch.Tensor | None = None) -> StepResult:
        """Run one step: the logits of the sequences that sample now, and the prompt logprobs of this step's
        prompt chunks that asked for them. pending_tokens: the tokens the step before sampled, on the device,
        which sequences holding a reserved token (Sequence.pending_index) take as their input."""
        ordered = self.decodes_first(scheduled)
        if self._fits_graph(ordered):
            hidden = self.graphs.run(self.steps.decode_inputs(ordered), pending_tokens)
            return StepResult(self.model.compute_logits(hidden), ordered, [])
        return self.run(self.prepare(ordered, pending_tokens))

    @staticmethod
    def decodes_first(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        return decodes_first(scheduled)

    @torch.inference_mode()
    def prepare(self, ordered: list[ScheduledSeq], pending_tokens: torch.Tensor | None = None) -> StepInputs:
        """The step's inputs (`ordered`: decodes first), the tokens still on the device filled in."""
        step = self.steps.build(ordered)
        step.pending.fill(step.forward.input_ids, pending_tokens)
        return step

    @torch.inference_mode()
    def run(self, step: StepInputs) -> StepResult:
        """The prepared step's forward, then its prompt scores and its sampled rows' logits, in that order (the
        order in which a tensor-parallel worker computes the same logits: run_forward)."""
        batch = step.forward
        hidden = self._forward(batch)
        scores = [self._score_prompt(hidden, chunk, rows) for chunk, rows in zip(step.scoring, batch.scored)]
        if not batch.sample_rows:
            return StepResult(torch.empty(0, device=self.device), [], scores)
        return StepResult(self.model.compute_logits(self._sampled(hidden, batch.sample_rows)),
                          step.sampling, scores)

    @torch.inference_mode()
    def run_forward(self, batch: ForwardBatch) -> None:
        """A tensor-parallel worker's part of a step the driver prepared: the same forward and the same logits,
        in run's order (each logits call gathers the vocabulary's slices from every rank), the logits dropped."""
        batch = batch.on(self.device)
        batch.attention = dataclasses.replace(batch.attention, kv_write=self.backend.kv_write)
        hidden = self._forward(batch)
        for rows in batch.scored:
            for part in rows.slices():
                self.model.compute_logits(hidden[part])
        if batch.sample_rows:
            self.model.compute_logits(self._sampled(hidden, batch.sample_rows))

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._set_lora_state(batch.adapter_runs)
        try:
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attention)
        finally:
            self.lora_state.clear()

    def _sampled(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The hidden rows whose logits are sampled (rows ascending): all of them in a step of decodes alone."""
        return hidden if len(rows) == hidden.shape[0] else self.backend.gather_rows(hidden, rows)

    def _set_lora_state(self, runs: list[AdapterRun]) -> None:
        """What the LoRA linears read this step (LoRAStepState): nothing when no token has an adapter."""
        if not self.lora_layers or all(run.slot < 0 for run in runs):
            return
        step = self.lora_state.step = self.backend.lora.step(runs, self.max_loras, self.lora_padding)
        if self.expert_lora:  # each pair of token and expert reads its token's slot, on every backend
            known = step.slots if isinstance(step, TokenSlots) else None
            self.lora_state.expert_slots = known if known is not None else token_slots(runs, self.device)

    def _score_prompt(self, hidden: torch.Tensor, chunk: PromptChunkScoring, rows: ScoredRows) -> PromptScores:
        logprobs: list[float] = []
        tops: list[dict[int, float] | None] = []
        ranks: list[int] = []
        for rows_part in rows.slices():
            part = chunk.targets[rows_part.start - chunk.row:rows_part.stop - chunk.row]
            logits = self.model.compute_logits(hidden[rows_part])
            scores = token_logprobs(logits, part, chunk.seq.params.prompt_logprobs, self.backend.sampler_ops)
            logprobs += scores.logprobs
            tops += scores.top
            ranks += token_ranks(logits, part)
        return PromptScores(chunk.seq, chunk.start + 1, logprobs, tops, ranks)

    def _fits_graph(self, ordered: list[ScheduledSeq]) -> bool:
        return (self.graphs is not None and len(ordered) <= self.graphs.max_batch
                and all(is_decode(s) for s in ordered))
