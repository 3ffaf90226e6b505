"""LLMEngine: step() = schedule -> run the model -> sample -> update (the offline API over it: engine/llm.py).

With async scheduling (the async_scheduling option, opt-in: docs/gpu.md) the host does not wait for a step's
tokens before scheduling the next, as vLLM v1 schedules: step N+1 is scheduled and launched while the device still
runs step N, its decode inputs taken from step N's sampled tokens on the device; then step N's tokens are read back
(copied behind N's sampling kernels, so the wait ends when N's tokens are ready, not N+1's) and processed, and step
N+1 is sampled. Every request gets the synchronous engine's tokens: a sequence that step N's token finished has its
row of step N+1 dropped before sampling, so no generator is drawn for it, and sampling N+1 sees every token before
it. The cost: a token reaches its request once the next step is launched rather than before, and a sequence ended by
EOS or a stop string computes one row more, whose result is dropped. Nothing on the host may wait for the device
between launching a step and reading the step before back (engine/transfer.py), or the overlap is lost.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from engine.block_manager import BlockManager, prompt_digests
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import TokenBudget, TokenBudgetError
from engine.executor import start_executor
from engine.grammar import GrammarCompiler, TokenMasks
from engine.layers.rotary import long_rope_switch, runs_long
from engine.lora.provider import AdapterProvider, AdapterProviderFactory, LoadStats, check_rank, default_plugin
from engine.lora.slots import AdapterSlots
from engine.memory import MemoryReport
from engine.model_files import resolve_model
from engine.model_runner import StepResult
from engine.models import context_limit, lora_shapes
from engine.outputs import AdapterStats, AdapterUsage, EngineStats, RequestOutput, RequestTimes
from engine.platform import platform_of
from engine.sampler import SampledTokens, Sampler
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence
from engine.speculative.speculator import Speculator
from engine.step_cost import StepCost, StepShape
from engine.tokens_in_flight import Readback
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.executor.workers import WorkerLauncher

Prompt = str | list[int]


@dataclass
class TrackedRequest:
    """A request the engine holds until it finishes: its sequence and the detokenizer of its text (prepare_request
    makes one, validated, and add_prepared hands it to the scheduler)."""
    seq: Sequence
    detokenizer: IncrementalDetokenizer


@dataclass
class LaunchedStep:
    """A step whose model run is launched: what was scheduled, and the logits to sample."""
    scheduled: list[ScheduledSeq]
    result: StepResult


@dataclass
class InFlight:
    """A step's sampled tokens: on the device, where the next step takes them as inputs, and on their way to the
    host (engine/tokens_in_flight.py)."""
    seqs: list[Sequence]
    sampled: SampledTokens
    readback: Readback[SampledTokens]


def _default_factory() -> AdapterProviderFactory:
    """The factory of the provider an installed package registers as the default (lora_cache's)."""
    plugin = default_plugin()
    if plugin is None:
        raise ValueError("max_loras > 0 needs an adapter provider, and no installed package registers a default one: "
                         "install lora-serve's lora_cache, or pass adapters=")
    return plugin.factory


class LLMEngine:
    def __init__(self, config: EngineConfig, adapters: AdapterProviderFactory | None = None,
                 workers: WorkerLauncher | None = None):
        """adapters: makes the adapters' provider for the model's LoRA shapes if max_loras > 0 (engine/lora/provider.py);
        workers: where tensor-parallel ranks 1..N-1 run (engine/executor/workers.py), None: local processes."""
        self.config = config
        platform_of(config.backend.torch_device).set_threads(config.backend.threads_per_worker)
        model = config.model
        path = resolve_model(model.name, model.model_cache_dir, need_weights=model.load_format != "dummy")
        hf_config = AutoConfig.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model_len = context_limit(hf_config, model.max_model_len)  # ValueError past the model's own
        self.executor = start_executor(config, path, hf_config, model_len, workers)  # rank 0's runner, and any workers
        self.runner = self.executor.runner
        layout = self.runner.layout
        self.max_model_len = min(model_len, layout.token_capacity)
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = self._eos_token_ids(path, hf_config)
        self.block_manager = BlockManager(layout.num_blocks, layout.block_size, config.cache.enable_prefix_caching)
        self.adapter_slots = AdapterSlots(config.lora.max_loras) if config.lora.max_loras else None
        self.adapters = self._adapter_provider(config, hf_config, adapters)
        self.long_rope_switch = long_rope_switch(hf_config)  # None, or the length past which longrope goes long
        self.kv_window = self.runner.kv_window  # None, or the window every layer attends over: blocks behind it go
        self.scheduler = self._scheduler(config)
        self.sampler = Sampler(config.backend.torch_device, model.seed, self.runner.backend.sampler_ops)
        self.requests: dict[str, TrackedRequest] = {}
        self.adapter_usage: dict[str, AdapterUsage] = {}
        self._grammars: GrammarCompiler | None = None  # made on the first structured-output request
        self._grammars_lock = threading.Lock()
        self.overlap = config.scheduler.async_scheduling  # async scheduling (step)
        self._in_flight: InFlight | None = None
        self._timed_shape = StepShape(0, 0)  # async scheduling: the step whose time the next call measures
        self._preload(config.lora.preload_adapters, pin=False)
        self._preload(config.lora.pinned_adapters, pin=True)
        _freeze_startup_objects()
        if config.log_stats:
            self._log_plan(config)

    def _scheduler(self, config: EngineConfig) -> Scheduler:
        """The scheduler over the blocks and adapter slots, with a step-cost model where steps are sized by time."""
        limits = config.scheduler
        self.step_cost = StepCost(limits.step_time_target_s) if limits.step_time_target_s is not None else None
        self.speculator = (Speculator(config.speculative, self.max_model_len, self.step_cost)
                           if config.speculative.enabled else None)
        return Scheduler(self.block_manager, limits.max_num_seqs, limits.max_num_batched_tokens, self.adapter_slots,
                         config.lora.max_adapter_wait_s, self.long_rope_switch, self.step_cost, self.speculator)

    def _log_plan(self, config: EngineConfig) -> None:
        quantized = f", {config.model.quantization}" if config.model.quantization != "none" else ""
        size = config.backend.tensor_parallel_size
        workers = f"; each of {size} tensor-parallel workers" * (size > 1)
        print(f"[lora-serve] {config.model.name} on {config.backend.torch_device} ({self.runner.dtype}{quantized})"
              f"{workers}: {self.memory().summary()}; max_model_len {self.max_model_len}", flush=True)

    def memory(self) -> MemoryReport:
        """Rank 0's: under tensor parallelism every worker holds as much (its share of the weights, its KV heads)."""
        return self.runner.memory_report()

    def workers_alive(self) -> bool:
        """Whether every tensor-parallel worker still runs: a dead one fails the next step (always, with none)."""
        return self.executor.alive()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, after which the engine cannot step (idempotent; also done at
        interpreter exit; nothing to do at tensor_parallel_size 1)."""
        self.executor.close()

    @staticmethod
    def _adapter_provider(config: EngineConfig, hf_config,
                          adapters: AdapterProviderFactory | None) -> AdapterProvider | None:
        if adapters is not None and not config.lora.max_loras:
            raise ValueError("an adapter provider was given but max_loras is 0: LoRA is disabled")
        if not config.lora.max_loras:
            return None
        factory = adapters or _default_factory()
        return factory(config.sources, lora_shapes(hf_config, config.lora.expert_lora, config.lora.max_lora_rank))

    def _eos_token_ids(self, path, hf_config) -> frozenset[int]:
        values = [getattr(hf_config, "eos_token_id", None), self.tokenizer.eos_token_id]
        try:
            values.append(GenerationConfig.from_pretrained(path).eos_token_id)
        except OSError:
            pass  # no generation_config.json
        ids = set()
        for value in values:
            ids.update([value] if isinstance(value, int) else value or [])
        return frozenset(ids)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    adapter_id: str | None = None) -> Sequence:
        request = self.prepare_request(request_id, prompt, params, adapter_id)
        self.add_prepared(request)
        return request.seq

    def prepare_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                        adapter_id: str | None = None) -> TrackedRequest:
        """Validate, tokenize and fetch the adapter into the CPU tier, without touching the running batch
        (safe to call from another thread, so a cold adapter load never stalls a step)."""
        arrival = time.perf_counter()  # before a cold adapter read, so TTFT includes it
        token_ids = self._tokenize(prompt, params)
        params = self._fit_max_tokens(params, len(token_ids))
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = self._outside_vocabulary(ids)
            if outside:
                raise ValueError(f"{name} token ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}")
        if adapter_id is not None:
            self._check_adapter(adapter_id)
        seq = Sequence(request_id, token_ids, params, self.eos_token_ids, prompt if isinstance(prompt, str) else None,
                       adapter_id=adapter_id, arrival_time=arrival)
        grammar = self.grammars.matcher(params.response_format) if params.response_format is not None else None
        seq.constrain(grammar, self._bad_words_ids(params.bad_words))  # ValueError for an invalid schema
        seq.prepared()
        return TrackedRequest(seq, IncrementalDetokenizer(self.tokenizer, token_ids, params.stop,
                                                          params.skip_special_tokens,
                                                          keep_stop=params.include_stop_str_in_output))

    def _fit_max_tokens(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """The request's params with max_tokens resolved: None fills the context (up to max_tokens_limit); a
        number above the limit or past the context is refused with both figures, as vLLM and TGI refuse it,
        rather than accepted and cut short at the context's end."""
        room = self.max_model_len - prompt_tokens
        limit = self.config.scheduler.max_tokens_limit
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=min(room, limit or room))
        if limit is not None and params.max_tokens > limit:
            raise TokenBudgetError(TokenBudget(params.max_tokens, limit))
        if params.max_tokens > room:
            raise TokenBudgetError(TokenBudget(params.max_tokens, room, self.max_model_len, prompt_tokens))
        return params

    @property
    def grammars(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def _preload(self, names: tuple[str, ...], pin: bool) -> None:
        """Into the CPU tier and a device slot now, so a first request finds them warm; a pinned adapter keeps
        one pin on its slot for good, so the slot is never reused. A bad adapter fails the start, with why."""
        for name in names:
            adapter_id = self.adapters.key(name)
            self._check_adapter(adapter_id)
            self._into_slot(adapter_id)
            if not pin:
                self.adapter_slots.release(adapter_id)

    def _into_slot(self, adapter_id: str) -> bool:
        """The adapter in a device slot, with one pin; False when every slot is pinned by other adapters."""
        grant = self.adapter_slots.acquire(adapter_id)
        if grant is not None and grant.needs_load:
            self.executor.copy_adapter(grant.slot, self.adapters.get(adapter_id))
        return grant is not None

    def load_adapter(self, adapter_id: str) -> bool:
        """Into a device slot now, unpinned, so its first request finds it there; False when every slot is pinned
        by running requests of other adapters."""
        if self.adapter_slots is None or not self._into_slot(adapter_id):
            return False
        self.adapter_slots.release(adapter_id)
        return True

    def unload_adapter(self, adapter_id: str) -> bool:
        """Free the adapter's device slot unless a running request pins it; whether it was freed."""
        return self.adapter_slots is not None and self.adapter_slots.evict(adapter_id)

    def _check_adapter(self, adapter_id: str) -> None:
        if self.adapters is None:
            raise ValueError(f"adapter {adapter_id!r} requested but LoRA is disabled: "
                             f"start the engine with max_loras > 0")
        adapter = self.adapters.get(adapter_id)  # AdapterError (a ValueError) names the adapter and the reason
        # a provider's reader refuses these at load already; one shared by servers of other limits may not
        check_rank(adapter_id, adapter.rank, self.config.lora.max_lora_rank)

    def add_prepared(self, request: TrackedRequest) -> None:
        seq = request.seq
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = request
        self.scheduler.add(seq)
        if seq.adapter_id is not None:
            usage = self.adapter_usage.setdefault(seq.adapter_id, AdapterUsage())
            usage.requests += 1
            usage.prompt_tokens += len(seq.prompt_token_ids)

    def _bad_words_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the tokens that spell it at the start of a text and after a space (as vLLM bans it)."""
        variants = {f"{prefix}{word.strip()}" for word in words for prefix in ("", " ")}
        return tuple(sorted({tuple(self.tokenizer(text, add_special_tokens=False).input_ids) for text in variants}))

    def _outside_vocabulary(self, token_ids) -> list[int]:
        return [t for t in token_ids if not 0 <= t < self.vocab_size]

    def _tokenize(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids that the request keeps (all, or its truncate_prompt_tokens last: vLLM's
        truncate_prompt_tokens, TGI's truncate), checked against the context after that cut."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
            bad = self._outside_vocabulary(token_ids)
            if bad:
                raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        else:
            raise TypeError("prompt must be a string or a list of token ids")
        token_ids = params.kept_prompt(token_ids)
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the limit is {self.max_model_len - 1} "
                             f"(max_model_len {self.max_model_len})")
        return token_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return None
        self.scheduler.finish(entry.seq, "abort")
        return self._output(entry.seq, entry.detokenizer, [], [], [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def num_waiting(self) -> int:
        """Requests waiting for their first step (the length of a deque: safe to read from another thread)."""
        return len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        bm, prefix = self.block_manager, self.block_manager.prefix_stats
        return EngineStats(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks,
            preemptions=self.scheduler.total_preemptions,
            waiting_for_adapter=self.scheduler.num_waiting_for_adapter(),
            resident_adapters=self.adapter_slots.resident() if self.adapter_slots else [],
            prefix_cache_queried_tokens=prefix.queried_tokens, prefix_cache_hit_tokens=prefix.hit_tokens,
            prefix_cache_blocks=bm.num_cached_blocks, prefix_cache_evictions=prefix.evictions,
            adapter_slot_acquisitions=self.adapter_slots.acquisitions if self.adapter_slots else 0,
            adapter_slot_loads=self.adapter_slots.loads if self.adapter_slots else 0,
            speculative_proposed_tokens=self.speculator.stats.proposed if self.speculator else 0,
            speculative_accepted_tokens=self.speculator.stats.accepted if self.speculator else 0)

    def cached_prefix_digests(self) -> frozenset[int]:
        """Digests of the prompt blocks in the prefix cache (engine/block_manager.py), for a router."""
        return self.block_manager.cached_digests() if self.block_manager.enable_prefix_caching else frozenset()

    def prompt_digests(self, token_ids: list[int], adapter_id: str | None) -> list[int]:
        """The digests this engine keys a prompt's leading blocks by, to compare with cached_prefix_digests (none
        without prefix caching): a longrope model keys a prompt past its switch apart."""
        if not self.block_manager.enable_prefix_caching:
            return []
        return prompt_digests(token_ids, adapter_id, self.block_manager.block_size,
                              long_rope=runs_long(self.long_rope_switch, len(token_ids)))

    def adapter_stats(self) -> dict[str, AdapterStats]:
        """Per adapter: requests and tokens, where it resides (device slot, CPU tier, or only its source),
        source reads and their mean latency, copies into a device slot."""
        if self.adapters is None:
            return {}
        on_device = set(self.adapter_slots.resident())
        cached, loads = set(self.adapters.cached()), self.adapters.load_stats()
        stats = {}
        for adapter_id in set(self.adapter_usage) | cached:
            usage = self.adapter_usage.get(adapter_id, AdapterUsage())
            load = loads.get(adapter_id, LoadStats(0, 0.0))
            residence = "device" if adapter_id in on_device else "cpu" if adapter_id in cached else "source"
            stats[adapter_id] = AdapterStats(usage.requests, usage.prompt_tokens, usage.generated_tokens, residence,
                                             load.loads, load.mean_seconds,
                                             self.adapter_slots.load_counts.get(adapter_id, 0))
        return stats

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return the outputs of the tokens read back. With async scheduling
        the tokens sampled here are read back by the next call, once the next step is launched: the device runs
        one step while the host prepares the next and reads the last, and each call returns the step before's
        outputs."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        for wanted in plan.adapter_copies:
            self.executor.copy_adapter(wanted.slot, self.adapters.get(wanted.adapter_id))
        launched = self._launch(plan.scheduled)
        if self.overlap:
            outputs = self._read_back()
            self._sample(launched)
        else:
            self._sample(launched)
            outputs = self._read_back() + self._verify_drafts(launched)
        self._observe(plan.shape, time.perf_counter() - start)
        return outputs

    def _observe(self, shape: StepShape, seconds: float) -> None:
        """The step's time into the step-cost model. With async scheduling a call waits for the step before's
        tokens, so its time is that step's: it is paired with that step's work."""
        if self.overlap:
            shape, self._timed_shape = self._timed_shape, shape
        if self.step_cost is not None and shape != StepShape(0, 0):
            self.step_cost.observe(shape, seconds)

    def _launch(self, scheduled: list[ScheduledSeq]) -> LaunchedStep | None:
        """Run the model on the scheduled tokens (queued, on CUDA): a token still in flight is read on the
        device. Their K/V count as computed from now on, as the next step's scheduling must see them."""
        if not scheduled:
            return None
        pending = self._in_flight.sampled.tokens if self._in_flight is not None else None
        result = self.executor.execute(scheduled, pending)
        for scores in result.prompt_scores:
            _record_prompt_logprobs(scores)
        for s in scheduled:
            s.seq.computed(s.num_known_tokens)  # a draft's K/V counts once its tokens are accepted
        return LaunchedStep(scheduled, result)

    def _sample(self, launched: LaunchedStep | None) -> None:
        """Key the step's computed blocks (its tokens are all known by now), then sample the sequences it
        completed that are still running, leaving their tokens in flight. One that the token read back before
        finished has its row dropped: the synchronous engine never ran it."""
        if launched is None:
            return
        for s in launched.scheduled:
            if not s.seq.is_finished:
                self._settle(s.seq)
        sampling, logits = launched.result.sampling, launched.result.logits
        plain = [(s.seq, row) for s, row in zip(sampling, _first_rows(sampling))
                 if not s.seq.is_finished and not s.draft]
        if not plain:
            return
        seqs, rows = [seq for seq, _ in plain], [row for _, row in plain]
        if len(rows) < logits.shape[0]:
            logits = logits[to_device(rows, logits.device)]
        sampled = self.sampler.sample(logits, seqs, self._masks(seqs))
        for index, seq in enumerate(seqs):
            seq.reserve_token(index)
        self._in_flight = InFlight(seqs, sampled, self.runner.backend.readback(sampled))

    def _verify_drafts(self, launched: LaunchedStep | None) -> list[RequestOutput]:
        """The step's drafts against the model's argmax at each of their rows (engine/speculative/): each sequence
        takes the agreeing prefix and the model's next token, as decoding them one step at a time would."""
        if launched is None or self.speculator is None:
            return []
        sampling, logits = launched.result.sampling, launched.result.logits
        drafted = [(s, row) for s, row in zip(sampling, _first_rows(sampling)) if s.draft and not s.seq.is_finished]
        if not drafted:
            return []
        rows = [row + i for s, row in drafted for i in range(len(s.draft) + 1)]
        targets = self.sampler.ops.argmax(logits[to_device(rows, logits.device)]).tolist()
        outputs, at = [], 0
        for s, _ in drafted:
            outputs += self._accept(s, targets[at:at + len(s.draft) + 1])
            at += len(s.draft) + 1
        return outputs

    def _accept(self, s: ScheduledSeq, targets: list[int]) -> list[RequestOutput]:
        """The accepted tokens into the sequence, one output each, up to the one that finishes it."""
        seq, tokens = s.seq, self.speculator.accept(s.seq, s.draft, targets)
        detok = self.requests[seq.request_id].detokenizer
        outputs = []
        for token in tokens:
            outputs.append(self._process_token(seq, detok, token, None, []))
            if seq.is_finished:
                return outputs
        seq.computed(len(tokens) - 1)  # the accepted draft tokens' K/V, which this step wrote
        self._settle(seq)
        return outputs

    def _settle(self, seq: Sequence) -> None:
        self.block_manager.cache_computed_blocks(seq)
        if self.kv_window is not None:
            self.block_manager.release_behind(seq, self.kv_window)

    def _read_back(self) -> list[RequestOutput]:
        """The tokens in flight, into their sequences: detokenized, checked for stops, and out."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        result = in_flight.readback.result().output()
        outputs = []
        for i, seq in enumerate(in_flight.seqs):
            if seq.is_finished:  # aborted while its token was in flight
                continue
            detok = self.requests[seq.request_id].detokenizer
            top = [result.top_logprobs[i]] if result.top_logprobs[i] is not None else []
            outputs.append(self._process_token(seq, detok, result.token_ids[i], result.logprobs[i], top))
        return outputs

    def _masks(self, seqs: list[Sequence]) -> TokenMasks | None:
        """Structured-output masks of the sequences about to sample (a mask depends only on the tokens so far).
        With async scheduling they are computed while the device runs the step's forward."""
        constrained = [(seq.request_id, seq.grammar) for seq in seqs if seq.grammar is not None]
        return self.grammars.fill_masks(constrained) if constrained else None

    def _process_token(self, seq: Sequence, detok: IncrementalDetokenizer, token: int, logprob: float | None,
                       top: list[dict[int, float]]) -> RequestOutput:
        new_logprobs = [] if logprob is None else [logprob]
        seq.append_token(token, new_logprobs, top)
        if seq.adapter_id is not None:
            self.adapter_usage[seq.adapter_id].generated_tokens += 1
        stop_string_hit = detok.add_token(token)
        reason = self._finish_reason(seq, token, stop_string_hit)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
        return self._output(seq, detok, [token], new_logprobs, top)

    def _finish_reason(self, seq: Sequence, token: int, stop_string_hit: bool) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or stop_string_hit:
            return "stop"
        if seq.grammar is not None and (seq.grammar.is_stopped() or seq.grammar.is_error()):
            return "eos"  # the JSON is complete: the output's natural end
        if token in seq.eos_token_ids and not params.ignore_eos:
            return "eos"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence, detok: IncrementalDetokenizer, new_tokens: list[int], new_logprobs: list[float],
                new_top: list[dict[int, float]]) -> RequestOutput:
        finished = seq.is_finished
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time else None
        latency = seq.finish_time - seq.arrival_time if seq.finish_time else None
        # The prompt's scores go out with the first token (a stream can show them before the answer: echo) and
        # again with the finished output (an unstreamed caller reads only that one)
        prompt = _prompt_scores(seq, finished or len(new_tokens) == len(seq.output_token_ids) > 0)
        # A finished sequence is never appended to again: its lists are handed over, not copied.
        return RequestOutput(
            seq.request_id, seq.prompt, seq.prompt_token_ids, detok.text, detok.take_new_text(finished),
            token_ids=seq.output_token_ids if finished else [], new_token_ids=new_tokens, finished=finished,
            finish_reason=seq.finish_reason, logprobs=seq.logprobs if finished else [],
            top_logprobs=seq.top_logprobs if finished else [], prompt_logprobs=prompt.logprobs,
            prompt_top_logprobs=prompt.top_logprobs, prompt_ranks=prompt.ranks, ttft=ttft, latency=latency,
            num_preemptions=seq.num_preemptions, new_logprobs=new_logprobs, new_top_logprobs=new_top,
            num_cached_tokens=seq.num_cached_tokens, times=_times(seq) if finished else None)


def _first_rows(sampling: list[ScheduledSeq]) -> list[int]:
    """Each sampling sequence's first row of the step's logits: a sequence with a draft has one row per draft
    token more."""
    rows, row = [], 0
    for s in sampling:
        rows.append(row)
        row += 1 + len(s.draft)
    return rows


def _times(seq: Sequence) -> RequestTimes:
    return RequestTimes(seq.arrival_time, seq.prepared_time, seq.first_scheduled_time, seq.first_token_time,
                        seq.finish_time)


@dataclass
class _PromptScores:
    """A request's prompt logprobs, top alternatives and ranks, one entry per prompt token (complete once its first
    token is out: a preempted request recomputes its prompt but keeps these)."""
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)


def _prompt_scores(seq: Sequence, carried: bool) -> _PromptScores:
    if not carried or seq.params.prompt_logprobs is None:
        return _PromptScores()
    if not seq.prompt_logprobs:  # a 1-token prompt: its one token has nothing before it to be scored on
        return _PromptScores([None], [None], [None])
    return _PromptScores(list(seq.prompt_logprobs), list(seq.prompt_top_logprobs), list(seq.prompt_ranks))


def _record_prompt_logprobs(scores) -> None:
    """Hand a step's prompt logprobs to their sequence."""
    scores.seq.add_prompt_scores(scores.first_index, scores.logprobs, scores.top_logprobs, scores.ranks)


def _freeze_startup_objects() -> None:
    """Move every object alive after start-up (modules, the tokenizer's tables, the model's Python objects) out of
    the garbage collector's reach. Steps create many short-lived objects, and each collection of the oldest
    generation walked all of these again: the collector took a measurable share of a decode step (perf), as
    vLLM also found and fixes the same way."""
    gc.collect()
    gc.freeze()
