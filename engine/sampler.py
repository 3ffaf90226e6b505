"""Sampler: logits -> one token per sequence, with its log-probability.

Order of processing follows transformers: structured-output masks first, then min_tokens' ban on
EOS and stop tokens, logit bias, repetition
penalty (then OpenAI's presence and frequency penalties, over the output only, as vLLM applies them),
temperature, top-k, top-p. Greedy
rows take the argmax. Seeded rows draw from their own generator, so a seed gives the same text
whatever else is in the batch; unseeded rows share one engine generator, drawn in one call.
Log-probabilities, computed only for requests that ask, are those of the model's raw distribution,
as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.grammar import TokenMasks, mask_penalty
from engine.sequence import Sequence

BANNED_LOGIT = -1e30


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # None where the request asked for no logprobs
    top_logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks | None = None) -> SamplerOutput:
        raw_logits = logits
        if masks is not None:
            logits = self._apply_masks(logits, seqs, masks)
        logits = self._ban_early_stops(logits, seqs)
        logits = self._apply_logit_bias(logits, seqs)
        logits = self._apply_repetition_penalty(logits, seqs)
        logits = self._apply_output_penalties(logits, seqs)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = self._filtered_probs(logits[rows], [seqs[i] for i in sampled_rows])
            tokens[rows] = self._draw(probs, [seqs[i] for i in sampled_rows])
        return SamplerOutput(tokens.tolist(), *self._logprobs(raw_logits, tokens, seqs))

    def _logprobs(self, raw_logits: torch.Tensor, tokens: torch.Tensor,
                  seqs: list[Sequence]) -> tuple[list[float | None], list[dict[int, float] | None]]:
        """Only for rows that asked (params.logprobs not None): raw logprob = logit - logsumexp."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        chosen: list[float | None] = [None] * len(seqs)
        top: list[dict[int, float] | None] = [None] * len(seqs)
        if not rows:
            return chosen, top
        index = torch.tensor(rows, device=raw_logits.device)
        logits = raw_logits[index]
        normalizer = logits.logsumexp(dim=-1)
        picked = (logits.gather(1, tokens[index][:, None]).squeeze(1) - normalizer).tolist()
        k = max(seqs[i].params.logprobs for i in rows)
        values, ids = logits.topk(k, dim=-1) if k else (None, None)
        for j, i in enumerate(rows):
            chosen[i] = picked[j]
            want = seqs[i].params.logprobs
            if want:
                top[i] = dict(zip(ids[j, :want].tolist(), (values[j, :want] - normalizer[j]).tolist()))
        return chosen, top

    @staticmethod
    def _apply_masks(logits: torch.Tensor, seqs: list[Sequence], masks: TokenMasks) -> torch.Tensor:
        row_of = {seq.request_id: i for i, seq in enumerate(seqs)}
        rows = torch.tensor([row_of[request_id] for request_id in masks.request_ids], device=logits.device)
        penalty = mask_penalty(masks.bitmask, logits.shape[1]).to(logits.device, non_blocking=True)
        return logits.index_add(0, rows, penalty)

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        penalised = [i for i, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
        if not penalised:
            return logits
        logits = logits.clone()
        for i in penalised:
            penalty = seqs[i].params.repetition_penalty
            seen = torch.tensor(sorted(set(seqs[i].token_ids)), device=logits.device)
            scores = logits[i, seen]
            logits[i, seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
        return logits

    @staticmethod
    def _ban_early_stops(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """min_tokens: EOS and stop tokens get the masks' penalty (finite, so a fully masked row stays a
        distribution) until the output is long enough."""
        early = [i for i, seq in enumerate(seqs) if len(seq.output_token_ids) < seq.params.min_tokens]
        if not early:
            return logits
        logits = logits.clone()
        for i in early:
            stops = torch.tensor(sorted(seqs[i].eos_token_ids | set(seqs[i].params.stop_token_ids)),
                                 device=logits.device)
            logits[i, stops] = BANNED_LOGIT
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        biased = [i for i, seq in enumerate(seqs) if seq.params.logit_bias]
        if not biased:
            return logits
        logits = logits.clone()
        for i in biased:
            bias = seqs[i].params.logit_bias
            ids = torch.tensor(list(bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
        return logits

    @staticmethod
    def _apply_output_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logit -= frequency_penalty * (times the output holds the token) + presence_penalty * (it holds it)."""
        penalised = [i for i, seq in enumerate(seqs) if seq.output_token_ids
                     and (seq.params.presence_penalty or seq.params.frequency_penalty)]
        if not penalised:
            return logits
        logits = logits.clone()
        for i in penalised:
            params = seqs[i].params
            ids, counts = torch.tensor(seqs[i].output_token_ids, device=logits.device).unique(return_counts=True)
            logits[i, ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
        return logits

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperature = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        logits = logits / temperature[:, None]
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        return logits.softmax(dim=-1)

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Exponential race (argmax of p / Exp(1)), equivalent to multinomial sampling."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=probs.device).manual_seed(seq.params.seed)
                noise[i].exponential_(generator=seq.generator)
        return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf (per-row k and p)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before > p[:, None], float("-inf"))  # keeps the top token
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def token_logprobs(logits: torch.Tensor, targets: list[int],
                   k: int) -> tuple[list[float], list[dict[int, float] | None]]:
    """Raw log-probabilities of `targets` under float32 `logits` [n, vocab], and each row's k most likely
    tokens (None when k is 0): prompt scoring."""
    logprobs = logits.log_softmax(dim=-1)
    picked = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None]).squeeze(1).tolist()
    if not k:
        return picked, [None] * len(targets)
    values, ids = logprobs.topk(k, dim=-1)
    return picked, [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
