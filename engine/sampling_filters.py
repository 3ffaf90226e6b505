"""The filters that cut a sampled row's distribution before the draw: top-k, top-p (nucleus), min-p and typical-p,
in transformers' order, each keeping the set its warper keeps (TopK with ties at the k-th logit, TopP with the
token that crosses the mass, MinP with the tokens at its floor, Typical with ties at the cut). min-p needs no
ranking: one softmax and a row maximum.

Why candidates: top-p and typical-p rank a row's tokens, and only as far as the mass they keep. torch's CPU sort of
a [64, 49,152] batch (SmolLM2's vocabulary) takes longer than the decode step it follows; its topk of a few
thousand is far cheaper. So a row ranks its top TIERS[0] tokens, then its top TIERS[1] if those hold no more than
its mass, and is sorted whole only past that (a flat distribution, as a random model's). The set kept is the same
either way: a token outside a row's candidates comes after all of them. On SmolLM2 at temperature 1 few rows needed
more than TIERS[0] tokens for a top-p of 0.9 and none more than TIERS[1], but so many batches held such a row that
sorting a whole batch whenever one of its rows did would sort most steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.sampling import SamplingParams

TIERS = (1024, 8192)  # candidates a row ranks before a full sort
Rows = slice | torch.Tensor  # all rows, or the index of some
# (keys, probs, mass, cut) -> the rows cut in the keys' descending order: rank_in_tiers or rank_whole
Ranking = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Callable], torch.Tensor]


def rank_whole(keys: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor, cut: Callable) -> torch.Tensor:
    """cut(rows, values, order) on every row's keys sorted whole, descending: on a GPU, where the tiers' tests
    would wait for the device (async scheduling)."""
    values, order = keys.sort(dim=-1, descending=True)
    return cut(slice(None), values, order)


def rank_in_tiers(keys: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor, cut: Callable) -> torch.Tensor:
    """cut(rows, values, order) on each row's keys in descending order, as far as the row needs: its top
    TIERS[0] where those hold more than its mass of probs, else its top TIERS[1], else the whole row sorted;
    the rows' results put back in order. A batch whose rows all stop at the first tier is cut without a copy."""
    vocab = keys.shape[1]
    out, pending = None, torch.arange(keys.shape[0], device=keys.device)
    for count in [c for c in TIERS if c < vocab] + [vocab]:
        first = out is None
        rows = slice(None) if first else pending
        if count < vocab:
            values, order = keys[rows].topk(count, dim=-1)
            covered = probs[rows].gather(1, order).sum(dim=-1) > mass[rows].squeeze(1)
        else:
            values, order = keys[rows].sort(dim=-1, descending=True)
            covered = torch.ones(len(order), dtype=torch.bool, device=keys.device)
        if first and bool(covered.all()):
            return cut(rows, values, order)
        out = torch.empty_like(keys) if first else out
        done = pending[covered]
        out[done] = cut(done, values[covered], order[covered])
        pending = pending[~covered]
        if not len(pending):
            return out
    return out


def filter_logits(logits: torch.Tensor, params: list[SamplingParams], rank: Ranking = rank_in_tiers) -> torch.Tensor:
    """Each row's logits with the tokens its request's top_k, top_p, min_p and typical_p leave out at -inf; rank:
    how top-p and typical-p rank a row (the sampler ops' `rank`)."""
    logits = _on_rows(logits, [p.top_k for p in params], lambda k: k > 0, top_k)
    logits = _on_rows(logits, [p.top_p for p in params], lambda p: p < 1.0, functools.partial(top_p, rank=rank))
    logits = _on_rows(logits, [p.min_p for p in params], lambda p: p > 0.0, min_p)
    return _on_rows(logits, [p.typical_p for p in params], lambda p: p < 1.0, functools.partial(typical_p, rank=rank))


def _on_rows(logits: torch.Tensor, values: list, active: Callable, apply: Callable) -> torch.Tensor:
    """`apply` on the rows whose value is active (with their values), the other rows as they are."""
    rows = [i for i, value in enumerate(values) if active(value)]
    if len(rows) == len(values):
        return apply(logits, values)
    if not rows:
        return logits
    index = to_device(rows, logits.device)
    return logits.index_copy(0, index, apply(logits[index], [values[i] for i in rows]))


def top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Each row keeps the tokens at or above its k-th largest logit (k >= 1)."""
    k = to_device([min(k, logits.shape[1]) for k in ks], logits.device)
    kth = logits.topk(max(min(k, logits.shape[1]) for k in ks), dim=-1).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits: torch.Tensor, ps: list[float], rank: Ranking = rank_in_tiers) -> torch.Tensor:
    """Each row keeps its most likely tokens, most likely first, until they hold p of its mass: a token is kept
    when the mass before it is at most p, so the top token always is."""
    probs = logits.softmax(dim=-1)
    mass = to_device(ps, logits.device, logits.dtype)[:, None]

    def cut(rows: Rows, values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        ranked_probs = probs[rows].gather(1, order)
        kept = values.masked_fill(ranked_probs.cumsum(dim=-1) - ranked_probs > mass[rows], float("-inf"))
        return torch.full_like(logits[rows], float("-inf")).scatter(1, order, kept)

    return rank(logits, probs, mass, cut)


def min_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Each row keeps the tokens whose probability is at least p times its most likely token's (which always is)."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * to_device(ps, logits.device, probs.dtype)[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def typical_p(logits: torch.Tensor, ps: list[float], rank: Ranking = rank_in_tiers) -> torch.Tensor:
    """Locally typical sampling: each row keeps the tokens whose surprisal (-log p) lies closest to the row's
    entropy, closest first, until they hold p of its mass (ties at the cut kept)."""
    logprobs = logits.log_softmax(dim=-1)
    probs = logprobs.exp()
    entropy = -(probs * logprobs).nan_to_num().sum(dim=-1, keepdim=True)  # a masked token's 0 * -inf is NaN
    distance = (logprobs + entropy).abs()  # |surprisal - entropy|; infinite for masked tokens
    mass = to_device(ps, logits.device, logits.dtype)[:, None]

    def cut(rows: Rows, closeness: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        held = probs[rows].gather(1, order).cumsum(dim=-1)
        first = (held < mass[rows]).sum(dim=-1, keepdim=True).clamp(max=order.shape[1] - 1)  # reaches the mass
        return logits[rows].masked_fill(distance[rows] > -closeness.gather(1, first), float("-inf"))

    return rank(-distance, probs, mass, cut)
