"""Model runner: owns the model and the paged KV cache; turns a scheduled step into one flat batch.

The flat batch holds every new token of the step, decodes first, then prompt chunks, with no
padding: per token an id, a position and a cache slot. Logits are computed only for the last
token of each sequence that completes its prompt (or decodes) in this step, and, for requests that
ask for prompt logprobs, for their prompt tokens (a slice of rows at a time).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine import huge_pages
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, DecodeInputs
from engine.distributed.parallel import TensorParallel
from engine.forward_batch import ForwardBatch, ScoredRows
from engine.kernels import cpu_attention, cpu_ops
from engine.layers.attention import (
    IN_PLACE_CHUNK,
    AttentionMetadata,
    InPlaceQueries,
    PrefillSegment,
    block_rows,
    cuda_prefill_kernel,
    paged_prefill,
)
from engine.lora.linear import wrap_lora_linears
from engine.lora.segments import (
    AdapterRun,
    LoRAStepState,
    build_lora_batch,
    padding_allowance,
    per_token_slots,
    slot_order,
    token_slots,
)
from engine.memory import MemoryReport, weight_bytes
from engine.models import load_model, lora_shapes, use_fused_ops
from engine.models.decoder_stack import build_decoder_stack
from engine.models.moe import wrap_expert_loras
from engine.sampler import token_logprobs, token_ranks
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.tokens_in_flight import PendingInputs
from engine.transfer import to_device


@dataclass
class PromptScores:
    """Log-probabilities of prompt tokens first_index, first_index + 1, ... of seq, computed in this step."""
    seq: Sequence
    first_index: int
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    ranks: list[int]  # each token's rank among the vocabulary's, 1 for the most likely


@dataclass
class PromptChunkScoring:
    """A prompt chunk whose prompt logprobs were asked for: rows row, row + 1, ... of the step's hidden states hold
    prompt positions start, start + 1, ...; each predicts the next prompt token, targets[i]."""
    seq: Sequence
    row: int
    start: int
    targets: list[int]


@dataclass
class StepInputs:
    """A step's flattened batch (decodes first), as _prepare builds it: the model's inputs (`forward`, whose
    sample_rows are the last row of each chunk that completes its prompt) and the sequences they belong to."""
    forward: ForwardBatch  # a token still on the device (`pending`) is filled into its input_ids there
    sampling: list[ScheduledSeq]  # the sequences of forward.sample_rows, in the same order
    scoring: list[PromptChunkScoring]  # those of forward.scored, in the same order
    pending: PendingInputs


@dataclass
class StepResult:
    logits: torch.Tensor  # [len(sampling), vocab] in the model's dtype (the sampler widens them where it must)
    sampling: list[ScheduledSeq]  # the sequences that sample this step
    prompt_scores: list[PromptScores]


@dataclass
class DecodeTables:
    """The decode tokens' block tables [n, widest] and context lengths [n]; for the gather path (CPU without the
    kernel) also the additive mask and the cache rows their blocks are gathered from."""
    block_tables: torch.Tensor | None
    mask: torch.Tensor | None
    context_lens: torch.Tensor | None
    rows: torch.Tensor | None = None


@dataclass
class InPlaceChunk:
    """A decode token or short prompt chunk that the CPU kernel attends by reading the cache in place."""
    block_table: list[int]
    context_len: int  # tokens in the cache once this step's are written
    row: int  # its first token's row in the flat batch
    length: int


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    bytes_per_element: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size


class ModelRunner:
    expert_lora = False  # whether adapters may target the model's experts (set by _wrap_lora_linears)

    def __init__(self, config: EngineConfig, model_path: Path, hf_config, max_model_len: int,
                 parallel: TensorParallel | None = None, agree_blocks: Callable[[int], int] | None = None):
        """parallel: this rank's share of a tensor-parallel model (engine/distributed/), its cache its own KV heads;
        agree_blocks: the KV blocks every rank allocates, given this rank's count (all ranks hold the same)."""
        self.device = config.torch_device
        self.dtype = config.compute_dtype
        if self.dtype != config.torch_dtype:
            warnings.warn(f"{config.dtype} has no native matrix math on this CPU (no AVX-512 BF16, AMX or "
                          f"AVX-NE-CONVERT): the model computes in float32 on its {config.dtype} weights", stacklevel=2)
        self.block_size = config.block_size
        self.kv_dtype = config.kv_torch_dtype  # the model's dtype, even where a bf16 model computes in float32
        self.cpu_ops = cpu_ops.load() if self.device.type == "cpu" and config.cpu_kernels else None
        self.model = load_model(model_path, hf_config, self.dtype, self.device, max_model_len, config.quantization,
                                config.load_format, self.cpu_ops, weight_dtype=config.torch_dtype,
                                parallel=parallel, cuda_experts=config.cuda_experts)
        self.long_rope_rows = self.model.long_rope_rows  # None, or where a longrope model's long factors start
        self.kv_window = self.model.kv_window  # None, or the window every layer attends over
        self.layout = self._kv_layout(config, agree_blocks)
        self.huge_pages = config.huge_pages and self.device.type == "cpu" and huge_pages.supported()
        self.kv_caches = self._allocate_kv_cache()
        self.cuda_ops = self._cuda_ops(config)
        fused = self.cpu_ops or self.cuda_ops  # the C++ or the Triton operators: the same calls
        if fused is not None:
            use_fused_ops(self.model, fused)
        self.kv_write = fused.write_kv_cache if fused is not None else None
        self._choose_attention(config)
        self.lora_state = LoRAStepState()
        self.max_loras = config.max_loras
        self.lora_layers = self._wrap_lora_linears(config, hf_config) if config.max_loras else []
        if self.huge_pages:  # the adapters' slots too: after the LoRA layers are in place
            huge_pages.move_module(self.model)
        if config.decoder_stack:  # after the LoRA wrappers and any move of the weights: the stack holds them
            self.model.decoder_stack = build_decoder_stack(self.model, self.kv_caches, self.cpu_ops,
                                                           self.lora_state)
        self.graphs = None if parallel is not None and parallel.sharded else self._decode_graphs(config, max_model_len)

    def _wrap_lora_linears(self, config: EngineConfig, hf_config) -> list:
        """The model's LoRA-capable linears wrapped with max_loras slots each (and a mixture's experts given slots
        of their own, under "mlp.experts"), and the padding their row cost allows a step's adapter segments
        (lora_padding)."""
        layers = wrap_lora_linears(self.model, self.lora_state, config.max_loras, config.max_lora_rank, self.dtype,
                                   self.device, cpu_ops=self.cpu_ops)
        experts = wrap_expert_loras(self.model, lora_shapes(hf_config, config.expert_lora), self.lora_state,
                                    config.max_loras, config.max_lora_rank, self.dtype, self.device, self.cpu_ops)
        self.expert_lora = any(lora is not None for lora in experts)
        for layer, lora in zip(layers, experts):
            if lora is not None:
                layer["mlp.experts"] = lora
        linears = [lora for layer in layers for lora in layer.values()]
        self.lora_padding = padding_allowance(sum(lora.row_flops for lora in linears) // len(linears))
        return layers

    def _cuda_ops(self, config: EngineConfig):
        """The Triton fused element-wise operators on CUDA (imported there only: triton may be absent on CPU)."""
        if self.device.type != "cuda" or not config.cuda_fused_ops:
            return None
        from engine.kernels import cuda_ops

        return cuda_ops

    def _choose_attention(self, config: EngineConfig) -> None:
        """The attention paths of every step, chosen once: decodes in place or over gathered blocks, which prompt
        chunks join the C++ decode kernel, and the kernel that takes the other chunks."""
        self.paged_decode = self._reads_cache_in_place()
        self.in_place = self.paged_decode and self.device.type == "cpu"  # short chunks join the decodes' kernel
        self.in_place_chunk = self._in_place_chunk()
        self.prefill_kernel = self._prefill_kernel(config)
        self.prompt_kernel = (self.cpu_ops is not None  # long chunks: the C++ prompt kernel where it is faster
                              and cpu_attention.prompt_kernel_usable(self.dtype, self.layout.head_dim,
                                                                     self.block_size))

    def _prefill_kernel(self, config: EngineConfig):
        """CUDA: the in-place kernel for every prompt chunk of a step that config.cuda_prefill names, or None (gather
        + SDPA per chunk). CPU: None, its chunks take the C++ kernels or SDPA."""
        return cuda_prefill_kernel(config.cuda_prefill) if self.device.type == "cuda" else None

    def _in_place_chunk(self) -> int:
        """Prompt chunks shorter than this attend in the C++ kernel with the decodes: IN_PLACE_CHUNK, or every
        chunk for a model whose attention only that kernel computes (Gemma 2's capped scores, Gemma 2's and 3's
        sliding windows). Where the kernel cannot serve, such a model is refused, saying why."""
        needs = self.model.kernel_only_attention
        if needs is None:
            return IN_PLACE_CHUNK
        if not self.in_place:
            raise ValueError(f"this model's attention has {needs}, which only the C++ CPU attention kernel "
                             f"computes, and it cannot serve here: {self._no_kernel()}")
        return sys.maxsize

    def _no_kernel(self) -> str:
        """Why the C++ attention kernel does not read this cache in place."""
        if self.device.type != "cpu":
            return f"the device is {self.device.type}"
        if self.cpu_ops is None:
            return "the C++ operators are off (cpu_kernels) or did not build"
        return (f"its blocks must hold a multiple of {self.cpu_ops.vector_width()} tokens and its heads a multiple "
                f"of 4 dimensions (block_size {self.block_size}, head_dim {self.layout.head_dim})")

    def _reads_cache_in_place(self) -> bool:
        """Whether decode attention reads the cache in place (CUDA: Triton; CPU: the C++ kernel, where it builds
        and unless turned off) rather than gathering each sequence's blocks into a masked copy."""
        if self.device.type == "cuda":
            return True
        return self.cpu_ops is not None and cpu_attention.usable(self.block_size, self.layout.head_dim)

    def _decode_graphs(self, config: EngineConfig, max_model_len: int) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, captured now, unless eager is enforced (or the base is quantized:
        bitsandbytes' kernels are not captured here, nor a mixture of experts: decode_graphs). A tensor-parallel rank
        runs eager: a capture would run the model's collectives on this rank alone, and the driver steps through
        prepare and run, not execute."""
        if self.device.type != "cuda" or config.enforce_eager or config.quantization != "none":
            return None
        if not self.model.decode_graphs:
            return None
        max_blocks = -(-max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, self.kv_caches, self.lora_state, config.max_num_seqs, max_blocks,
                              self.layout.num_blocks, self.block_size, self.device, self.kv_write,
                              config.max_loras)
        graphs.capture()
        return graphs

    def copy_adapter(self, slot: int, adapter) -> None:
        """Copy a LoRAAdapter's weights into device slot `slot` of every LoRA layer (under tensor parallelism, this
        rank's shard of it: engine/lora/shards.py)."""
        for index, layer in enumerate(self.lora_layers):
            weights = adapter.layers.get(index, {})
            for lora in layer.values():
                lora.load_slot(slot, weights)

    def _kv_layout(self, config: EngineConfig, agree_blocks: Callable[[int], int] | None) -> KVLayout:
        num_layers, kv_heads, head_dim = self.model.kv_shape
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        per_block = 2 * num_layers * kv_heads * head_dim * element * config.block_size
        budget = self._kv_budget(config)
        num_blocks = config.num_kv_blocks or budget // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget of {budget} bytes is smaller than one KV block ({per_block} bytes)")
        if agree_blocks is not None:
            num_blocks = agree_blocks(num_blocks)
        return KVLayout(num_layers, kv_heads, head_dim, config.block_size, num_blocks, element)

    def _kv_budget(self, config: EngineConfig) -> int:
        """kv_cache_bytes, or kv_cache_memory_fraction of the device memory free once the weights are loaded."""
        if config.kv_cache_memory_fraction is None:
            return config.kv_cache_bytes
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
        else:
            import psutil

            free = psutil.virtual_memory().available
        return int(free * config.kv_cache_memory_fraction)

    def memory_report(self) -> MemoryReport:
        slots = [lora.packed for layer in self.lora_layers for lora in layer.values()]
        lay = self.layout
        return MemoryReport(weight_bytes(self.model, exclude=slots), lay.bytes_per_token, lay.num_blocks,
                            lay.block_size, sum(s.untyped_storage().nbytes() for s in slots))

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """On CUDA one block more than the block manager hands out: the scratch block that the padded rows of a
        decode graph write to."""
        lay = self.layout
        blocks = lay.num_blocks + (self.device.type == "cuda")
        shape = (lay.num_layers, 2, lay.num_kv_heads, blocks, lay.block_size, lay.head_dim)
        if self.huge_pages:
            cache = huge_pages.zeros(shape, self.kv_dtype)
        else:
            cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        return [(cache[i, 0], cache[i, 1]) for i in range(lay.num_layers)]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], pending_tokens: torch.Tensor | None = None) -> StepResult:
        """Run one step: the logits of the sequences that sample now, and the prompt logprobs of this step's
        prompt chunks that asked for them. pending_tokens: the tokens the step before sampled, on the device,
        which sequences holding a reserved token (Sequence.pending_index) take as their input."""
        ordered = self.decodes_first(scheduled)
        if self._fits_graph(ordered):
            hidden = self.graphs.run(self._decode_inputs(ordered), pending_tokens)
            return StepResult(self.model.compute_logits(hidden), ordered, [])
        return self.run(self.prepare(ordered, pending_tokens))

    def decodes_first(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        return sorted(scheduled, key=lambda s: not self._is_decode(s))  # stable

    @torch.inference_mode()
    def prepare(self, ordered: list[ScheduledSeq], pending_tokens: torch.Tensor | None = None) -> StepInputs:
        """The step's inputs (`ordered`: decodes first), the tokens still on the device filled in."""
        step = self._prepare(ordered)
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
        batch.attention = dataclasses.replace(batch.attention, kv_write=self.kv_write)
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
            state = self.lora_state
            state.batch = state.token_slots = state.slot_order = state.expert_slots = None

    def _sampled(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The hidden rows whose logits are sampled (rows ascending): all of them in a step of decodes alone, else
        gathered, on CPU by the C++ operators (cpu/gather.cpp: torch's indexing woke OpenMP's threads)."""
        if len(rows) == hidden.shape[0]:
            return hidden
        index = to_device(rows, self.device)
        return hidden[index] if self.cpu_ops is None else self.cpu_ops.gather_rows(hidden, index)

    def _set_lora_state(self, runs: list[AdapterRun]) -> None:
        """What the LoRA linears read this step (LoRAStepState): nothing when no token has an adapter."""
        if not self.lora_layers or all(run.slot < 0 for run in runs):
            return
        if self.device.type == "cuda":  # the Triton kernels: tokens grouped by slot
            self.lora_state.slot_order = slot_order(per_token_slots(runs), self.max_loras, self.device)
        elif self.cpu_ops is not None:  # the C++ call reads each token's slot
            self.lora_state.token_slots = token_slots(runs, self.device)
        else:
            self.lora_state.batch = build_lora_batch(runs, self.device, self.lora_padding)
        if self.expert_lora:  # each pair of token and expert reads its token's slot, on every path
            known = self.lora_state.token_slots
            self.lora_state.expert_slots = known if known is not None else token_slots(runs, self.device)

    def _score_prompt(self, hidden: torch.Tensor, chunk: PromptChunkScoring, rows: ScoredRows) -> PromptScores:
        logprobs: list[float] = []
        tops: list[dict[int, float] | None] = []
        ranks: list[int] = []
        for rows_part in rows.slices():
            part = chunk.targets[rows_part.start - chunk.row:rows_part.stop - chunk.row]
            logits = self.model.compute_logits(hidden[rows_part])
            scores = token_logprobs(logits, part, chunk.seq.params.prompt_logprobs, self.cpu_ops)
            logprobs += scores.logprobs
            tops += scores.top
            ranks += token_ranks(logits, part)
        return PromptScores(chunk.seq, chunk.start + 1, logprobs, tops, ranks)

    def _fits_graph(self, ordered: list[ScheduledSeq]) -> bool:
        return (self.graphs is not None and len(ordered) <= self.graphs.max_batch
                and all(self._is_decode(s) for s in ordered))

    def _decode_inputs(self, ordered: list[ScheduledSeq]) -> DecodeInputs:
        bs = self.block_size
        seqs = [s.seq for s in ordered]
        positions = [seq.num_computed_tokens for seq in seqs]
        return DecodeInputs(
            input_ids=[seq.token_slice(p, p + 1)[0] for seq, p in zip(seqs, positions)],
            positions=[p + self._row_offset(seq) for seq, p in zip(seqs, positions)],
            slot_mapping=[seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)],
            block_tables=[seq.block_table for seq in seqs],
            context_lens=[p + 1 for p in positions],
            lora_slots=[-1 if seq.lora_slot is None else seq.lora_slot for seq in seqs],
            pending=_pending_inputs(seqs, range(len(seqs))))

    def _row_offset(self, seq: Sequence) -> int:
        """A token's row in the rotary tables less its position: past its long_rope switch, a sequence reads a
        longrope model's long factors (engine/layers/rotary.py)."""
        return self.long_rope_rows if seq.long_rope else 0

    @staticmethod
    def _is_decode(s: ScheduledSeq) -> bool:
        return s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0

    def _prepare(self, ordered: list[ScheduledSeq]) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        adapter_runs: list[AdapterRun] = []
        sample_rows: list[int] = []
        sampling: list[ScheduledSeq] = []
        decode: list[ScheduledSeq] = []
        in_place: list[InPlaceChunk] = []
        prefills: list[PrefillSegment] = []
        scoring: list[PromptChunkScoring] = []
        last_rows: list[int] = []
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            row = len(input_ids)
            input_ids += seq.token_slice(start, end)
            last_rows.append(len(input_ids) - 1)
            offset = self._row_offset(seq)
            positions += range(start + offset, end + offset)
            slots += (seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            adapter_runs.append(AdapterRun(-1 if seq.lora_slot is None else seq.lora_slot, s.num_new_tokens))
            is_decode = self._is_decode(s)
            if is_decode:
                decode.append(s)
            else:
                scoring += self._prompt_scoring(seq, row, start, end)
            if self.in_place and (is_decode or s.num_new_tokens < self.in_place_chunk):
                in_place.append(InPlaceChunk(seq.block_table, end, row, s.num_new_tokens))
            elif not is_decode:
                prefills.append(self._prefill_segment(seq, row, start, end))
            if s.completes_prompt:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(s)
        meta = self._attention_metadata(self._tensor(slots), decode, prefills, in_place)
        scored = [ScoredRows(chunk.row, len(chunk.targets)) for chunk in scoring]
        batch = ForwardBatch(self._tensor(input_ids), self._tensor(positions), meta, adapter_runs, sample_rows, scored)
        return StepInputs(batch, sampling, scoring, _pending_inputs([s.seq for s in ordered], last_rows))

    @staticmethod
    def _prompt_scoring(seq: Sequence, row: int, start: int, end: int) -> list[PromptChunkScoring]:
        """The chunk's prompt logprobs to compute, if its request asked for them (else none)."""
        scored_end = min(end, len(seq.prompt_token_ids) - 1)  # positions whose next token is the prompt's
        if seq.params.prompt_logprobs is None or scored_end <= start:
            return []
        return [PromptChunkScoring(seq, row, start, seq.prompt_token_ids[start + 1:scored_end + 1])]

    def _prefill_segment(self, seq: Sequence, row: int, start: int, end: int) -> PrefillSegment:
        if self.prompt_kernel:  # it reads the whole context from the cache: no block rows to gather
            return PrefillSegment(row, end - start, end, self._tensor(seq.block_table))
        table = self._tensor(seq.block_table) if start > 0 else None
        rows = self._block_rows(table) if table is not None else None
        return PrefillSegment(row, end - start, end, table, rows)

    def _attention_metadata(self, slots: torch.Tensor, decode: list[ScheduledSeq], prefills: list[PrefillSegment],
                            in_place: list[InPlaceChunk]) -> AttentionMetadata:
        write = self.kv_write
        if self.in_place:
            queries = self._in_place_queries(in_place)
            return AttentionMetadata(slots, len(decode), None, None, prefills, in_place=queries, kv_write=write,
                                     cpu_prompt_kernel=self.prompt_kernel)
        tables = self._decode_tables(decode)
        kernel = self.prefill_kernel
        batch = paged_prefill(prefills, slots, self.block_size) if kernel is not None and prefills else None
        return AttentionMetadata(slots, len(decode), tables.block_tables, tables.mask, prefills, tables.context_lens,
                                 tables.rows, kv_write=write, cpu_prompt_kernel=self.prompt_kernel,
                                 prefill_kernel=kernel, paged_prefill=batch)

    def _in_place_queries(self, chunks: list[InPlaceChunk]) -> InPlaceQueries | None:
        """One padded block table for the kernel's chunks (padding entries are never read: the lengths bound it);
        None when every chunk of the step is long."""
        if not chunks:
            return None
        widest = max(len(c.block_table) for c in chunks)
        tables = [c.block_table + [0] * (widest - len(c.block_table)) for c in chunks]
        return InPlaceQueries(self._tensor(tables), self._tensor([c.context_len for c in chunks]),
                              self._tensor([c.row for c in chunks]), self._tensor([c.length for c in chunks]))

    def _decode_tables(self, decode: list[ScheduledSeq]) -> DecodeTables:
        if not decode:
            return DecodeTables(None, None, None)
        max_blocks = max(len(s.seq.block_table) for s in decode)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in decode]
        context_lens = self._tensor([s.seq.num_computed_tokens + 1 for s in decode])
        if self.paged_decode:  # the paged kernel reads the lengths; it needs no mask
            return DecodeTables(self._tensor(tables), None, context_lens)
        visible = torch.arange(max_blocks * self.block_size, device=self.device)[None, :] < context_lens[:, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        block_tables = self._tensor(tables)
        return DecodeTables(block_tables, mask[:, None, None, :], context_lens, self._block_rows(block_tables))

    def _block_rows(self, block_tables: torch.Tensor) -> torch.Tensor:
        """The cache rows attention gathers these blocks from, computed once per step for all layers (the
        blocks the cache holds: on CUDA one more than the block manager's, see _allocate_kv_cache)."""
        k_cache = self.kv_caches[0][0]
        return block_rows(block_tables, k_cache.shape[0], k_cache.shape[1])

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        """An int64 tensor of a step's (rectangular) lists. On CPU through numpy, which converts holding the GIL:
        torch.tensor releases it for its copy, and in a replica the step thread would then wait for the event
        loop to give it back."""
        if self.device.type == "cpu":
            return torch.from_numpy(np.array(values, dtype=np.int64))
        return to_device(values, self.device, torch.long)


def _pending_inputs(seqs: list[Sequence], last_rows) -> PendingInputs:
    """The rows whose token is still on the device: a reserved token is always its sequence's last, fed in the row
    of the sequence's last token this step (last_rows, one per sequence)."""
    held = [(row, seq.pending_index) for seq, row in zip(seqs, last_rows) if seq.pending_index is not None]
    return PendingInputs([row for row, _ in held], [index for _, index in held])
