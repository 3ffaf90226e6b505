"""Sampler: logits -> one token per sequence, with its log-probability.

Order of processing follows transformers: structured-output masks first, then the per-request row
processors (min_tokens' ban on EOS and stop tokens, vLLM's allowed_token_ids and bad_words, logit bias, repetition
penalty, OpenAI's presence and frequency penalties over the output only, as vLLM applies them), temperature, top-k,
top-p, min-p, typical-p.
Greedy rows take the argmax (of the logits in the model's dtype, read in place, when every row of a step is
plain greedy: widening a bf16 step's logits to float32 first is work a greedy step does not need). Sampled rows
draw by inverse CDF, one uniform a row (engine/sampling_filters.py cuts top-k, top-p, min-p and typical-p first):
a sampler call on a batch of random logits took a fraction of the time that an exponential drawn per token and
whole rows sorted took, at temperature 1 as with top-p or top-k. Seeded rows draw from
their own generator, so a seed gives the same text whatever else is in the batch; unseeded rows share one engine
generator, drawn in one call.
Log-probabilities, computed only for requests that ask, are those of the model's raw distribution,
as vLLM reports them: a logit minus its row's logsumexp, read from the logits in the model's dtype, so a greedy
step that reports them stays on the unwidened path. Through a float32 log_softmax of every row, greedy rows that
reported logprobs cost a noticeable share of a closed loop's tokens/s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.grammar import TokenMasks, mask_penalty
from engine.penalty_tokens import PenaltyTokens
from engine.sampler_ops import TorchSamplerOps
from engine.sampling_filters import filter_logits
from engine.sequence import Sequence
from engine.transfer import to_device

BANNED_LOGIT = -1e30


@dataclass
class TokenScores:
    """Tokens' raw log-probabilities, one per row, and each row's likeliest alternatives (id -> logprob, best
    first; None where none were asked for)."""
    logprobs: list[float | None]
    top: list[dict[int, float] | None]


@dataclass
class ScoresOnDevice:
    """token_logprobs' results as tensors, not yet read: one token's raw log-probability per row, and each row's k
    likeliest tokens and theirs, best first (None when k is 0)."""
    picked: torch.Tensor  # [n] float32
    top_ids: torch.Tensor | None  # [n, k]
    top_values: torch.Tensor | None  # [n, k] float32

    def lists(self) -> TokenScores:
        picked = self.picked.tolist()
        if self.top_ids is None:
            return TokenScores(picked, [None] * len(picked))
        return TokenScores(picked, [dict(zip(i, v)) for i, v in zip(self.top_ids.tolist(), self.top_values.tolist())])


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # None where the request asked for no logprobs
    top_logprobs: list[dict[int, float] | None]


@dataclass
class SampledTokens:
    """One token per row, as the sampler leaves them on the device: `tokens` can feed the next step before the host
    reads them (engine/readback.py reads them, a step later on CUDA)."""
    tokens: torch.Tensor  # [n] int64
    asked: list[int | None]  # each row's params.logprobs: None for no logprobs, else how many alternatives
    scored_rows: list[int]  # the rows that asked, in order: the rows of `scores`
    scores: ScoresOnDevice | None

    def output(self) -> SamplerOutput:
        """The tokens and scores as lists (read on the host)."""
        n = len(self.asked)
        logprobs: list[float | None] = [None] * n
        top: list[dict[int, float] | None] = [None] * n
        if self.scores is not None:
            scored = self.scores.lists()
            for j, i in enumerate(self.scored_rows):
                logprobs[i] = scored.logprobs[j]
                if self.asked[i]:  # its top k' of the batch's k
                    top[i] = dict(itertools.islice(scored.top[j].items(), self.asked[i]))
        return SamplerOutput(self.tokens.tolist(), logprobs, top)


class Sampler:
    def __init__(self, device: torch.device, seed: int, ops: TorchSamplerOps):
        """ops: the row operations of the engine's step backend (engine/sampler_ops.py)."""
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.ops = ops

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks | None = None) -> SamplerOutput:
        """sample(), read at once."""
        return self.sample(logits, seqs, masks).output()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks | None = None) -> SampledTokens:
        """`logits` [len(seqs), vocab] in the model's dtype. A step whose every row is plain greedy (no mask, no
        processor) takes the argmax of the logits as they are; any other widens them to float32 first. Logprobs
        are read from the logits as they are, either way. Nothing here waits for the device."""
        if masks is None and all(plain_greedy(seq) for seq in seqs):
            tokens = self.ops.argmax(logits)
            return self._logprobs(logits, tokens, seqs)
        model_logits = logits
        logits = self.ops.widened(logits)
        if masks is not None:
            logits = self._apply_masks(logits, seqs, masks)
        logits = _process_rows(logits, seqs)
        tokens = self.ops.argmax(logits)
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled_rows:
            rows = to_device(sampled_rows, logits.device)
            sampled = logits if len(sampled_rows) == len(seqs) else logits[rows]  # a 12 MB copy at 64 rows
            probs = self._filtered_probs(sampled, [seqs[i] for i in sampled_rows])
            tokens[rows] = self._draw(probs, [seqs[i] for i in sampled_rows])
        return self._logprobs(model_logits, tokens, seqs)

    def _logprobs(self, raw_logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        """The tokens, with scores only for rows that asked (params.logprobs not None): the raw distribution's."""
        asked = [s.params.logprobs for s in seqs]
        rows = [i for i, k in enumerate(asked) if k is not None]
        if not rows:
            return SampledTokens(tokens, asked, rows, None)
        raw, picked = raw_logits, tokens
        if len(rows) < len(seqs):
            index = to_device(rows, raw_logits.device)
            raw, picked = raw_logits[index], tokens[index]
        k = max(asked[i] for i in rows)
        return SampledTokens(tokens, asked, rows, scores_on_device(raw, picked, k, self.ops))

    @staticmethod
    def _apply_masks(logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks) -> torch.Tensor:
        row_of = {seq.request_id: i for i, seq in enumerate(seqs)}
        rows = to_device([row_of[request_id] for request_id in masks.request_ids], logits.device)
        penalty = mask_penalty(masks.bitmask, logits.shape[1]).to(logits.device, non_blocking=True)
        return logits.index_add(0, rows, penalty)

    def _filtered_probs(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperature = to_device([s.params.temperature for s in seqs], logits.device)
        logits = logits / temperature[:, None]
        return filter_logits(logits, [s.params for s in seqs], self.ops.rank).softmax(dim=-1)

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Inverse-CDF sampling: each row's token is the first whose cumulative probability passes one uniform
        draw, summed in float64 so that rounding shifts no token's share (a token of zero probability is never
        drawn). One uniform a row, where an exponential race drew one number per token, which cost far more of a
        [64, 49,152] batch's step than the cumulative sum and the search."""
        uniform = torch.empty(len(seqs), 1, device=probs.device, dtype=torch.float64)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), 1, device=probs.device, dtype=torch.float64,
                                           generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                uniform[i] = torch.rand(1, device=probs.device, dtype=torch.float64,
                                        generator=seq.seeded_generator(probs.device))
        cumulative = probs.cumsum(dim=-1, dtype=torch.float64)
        return inverse_cdf(cumulative, uniform * cumulative[:, -1:])


def inverse_cdf(cumulative: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's first token whose cumulative probability exceeds the row's target (so a token of zero probability
    never is); a target at the row's total (u * total rounded up) takes its last token of nonzero probability."""
    # A target just below the total selects the first token whose cumulative sum reaches the total: the last of
    # nonzero probability. Clamped so, not tested on the host, nothing here waits for the device.
    total = cumulative[:, -1:]
    targets = torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, targets, right=True).squeeze(1)


def _ban_early_stops(row: torch.Tensor, seq: Sequence) -> None:
    """min_tokens: EOS and stop tokens get the masks' penalty (finite, so a fully masked row stays a
    distribution) until the output is long enough."""
    stops = sorted(seq.eos_token_ids | set(seq.params.stop_token_ids))
    row[to_device(stops, row.device)] = BANNED_LOGIT


def _allow_only(row: torch.Tensor, seq: Sequence) -> None:
    """allowed_token_ids: every other token gets the masks' penalty."""
    allowed = to_device(seq.params.allowed_token_ids, row.device)
    kept = row[allowed]
    row.fill_(BANNED_LOGIT)
    row[allowed] = kept


def _ban_bad_words(row: torch.Tensor, seq: Sequence) -> None:
    """bad_words: a word's last token is banned where the output ends with the tokens before it (always, for a
    word of one token), so the output never spells the word in those tokens."""
    out = seq.output_token_ids
    banned = [ids[-1] for ids in seq.bad_words_ids
              if len(ids) <= len(out) + 1 and tuple(out[len(out) - len(ids) + 1:]) == ids[:-1]]
    if banned:
        row[to_device(banned, row.device)] = BANNED_LOGIT


def _add_logit_bias(row: torch.Tensor, seq: Sequence) -> None:
    bias = seq.params.logit_bias
    row[to_device(list(bias), row.device)] += to_device(list(bias.values()), row.device, row.dtype)


def _penalty_tokens(row: torch.Tensor, seq: Sequence) -> PenaltyTokens:
    """The sequence's tallies, made on first use and brought up to date with its new outputs."""
    tokens = seq.penalties(row.device)
    tokens.absorb(seq.output_token_ids)
    return tokens


def _penalise_repetition(row: torch.Tensor, seq: Sequence) -> None:
    _penalty_tokens(row, seq).penalise_repetition(row, seq.params.repetition_penalty)


def _penalise_output(row: torch.Tensor, seq: Sequence) -> None:
    params = seq.params
    _penalty_tokens(row, seq).penalise_output(row, params.presence_penalty, params.frequency_penalty)


def _add_watermark(row: torch.Tensor, seq: Sequence) -> None:
    """The watermark's green tokens after the sequence's last token raised, last of the edits, as transformers
    applies its watermark after its other processors."""
    watermark = seq.params.watermark
    watermark.add_bias(row, seq.last_token_id)


# Per-request logit processors, in the order they apply: (does the request use it, edit its row in place).
ROW_PROCESSORS = (
    (lambda seq: len(seq.output_token_ids) < seq.params.min_tokens, _ban_early_stops),
    (lambda seq: seq.params.allowed_token_ids is not None, _allow_only),
    (lambda seq: bool(seq.bad_words_ids), _ban_bad_words),
    (lambda seq: bool(seq.params.logit_bias), _add_logit_bias),
    (lambda seq: seq.params.repetition_penalty != 1.0, _penalise_repetition),
    (lambda seq: bool(seq.output_token_ids) and bool(seq.params.presence_penalty or seq.params.frequency_penalty),
     _penalise_output),
    (lambda seq: seq.params.watermark is not None, _add_watermark),
)


def _row_edits(seq: Sequence) -> list:
    """The processors that apply to `seq`'s row this step, in ROW_PROCESSORS' order."""
    return [edit for uses, edit in ROW_PROCESSORS if uses(seq)]


def plain_greedy(seq: Sequence) -> bool:
    """A row whose token is the argmax of the raw logits."""
    return seq.params.greedy and not _row_edits(seq)


def _process_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each request's processors on its own row; the logits are copied once, and only when some row needs it."""
    edits = [(i, _row_edits(seq)) for i, seq in enumerate(seqs)]
    edits = [(i, row_edits) for i, row_edits in edits if row_edits]
    if not edits:
        return logits
    logits = logits.clone()
    for i, row_edits in edits:
        for edit in row_edits:
            edit(logits[i], seqs[i])
    return logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor | list[int], k: int,
                   ops: TorchSamplerOps | None = None) -> TokenScores:
    """scores_on_device(), read at once."""
    return scores_on_device(logits, targets, k, ops).lists()


def scores_on_device(logits: torch.Tensor, targets: torch.Tensor | list[int], k: int,
                     ops: TorchSamplerOps | None = None) -> ScoresOnDevice:
    """Raw log-probabilities of `targets` under `logits` [n, vocab] (any float dtype, computed in float32), and each
    row's k most likely tokens, best first (none when k is 0): sampled tokens and prompt scoring alike. A logprob is
    the logit minus its row's logsumexp, so no [n, vocab] log_softmax is written; ops: the step backend's row
    operations (on CPU the C++ operators reduce the rows as they are)."""
    normalizers = (ops or TorchSamplerOps()).log_normalizers(logits)
    targets = torch.as_tensor(targets, device=logits.device)
    picked = logits.gather(1, targets[:, None]).squeeze(1).float() - normalizers
    if not k:
        return ScoresOnDevice(picked, None, None)
    values, ids = logits.topk(k, dim=-1)
    return ScoresOnDevice(picked, ids, values.float() - normalizers[:, None])


def token_ranks(logits: torch.Tensor, targets: torch.Tensor | list[int]) -> list[int]:
    """Each target's rank in its row, 1 for the most likely token: how many tokens score at least its logit (vLLM's
    count, so a tie ranks as the later place), compared in the logits' own dtype: no float32 copy of the rows."""
    targets = torch.as_tensor(targets, device=logits.device)
    return (logits >= logits.gather(1, targets[:, None])).sum(dim=-1).tolist()
