"""The vocabulary-parallel embedding and LM head: each rank holds ceil(vocab / N) rows of the vocabulary
(engine/distributed/shards.py: the last rank's padded with zeros).

The embedding looks up the ids in the rank's range, zeros the rows of the others and sums the ranks' rows in one
all-reduce: every rank then holds the full embeddings. The LM head computes the rank's slice of the logits; one
all-gather puts the slices side by side on every rank, and the padding's columns are cut off, so every rank holds
the full [tokens, vocab] logits (the rank that samples reads them; gathering to it alone would move fewer bytes).
A tied LM head shares the embedding's shard (the same rows of the same weight).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.linears import linear_of
from engine.distributed.parallel import TensorParallel
from engine.distributed.shards import vocab_rows, vocab_share
from engine.layers.embedding import Embedding


class VocabParallelEmbedding(nn.Module):
    def __init__(self, embedding: nn.Embedding, parallel: TensorParallel):
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.start, rows = vocab_share(self.num_embeddings, parallel)
        with torch.no_grad():
            shard = vocab_rows(embedding.weight, parallel)
        self.rows = Embedding(rows, embedding.embedding_dim, _weight=shard)  # takes the fused row gather
        self.parallel = parallel

    @property
    def weight(self) -> nn.Parameter:
        return self.rows.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        elsewhere = (local < 0) | (local >= self.rows.num_embeddings)
        h = self.rows(local.masked_fill(elsewhere, 0))
        return self.parallel.all_reduce(h.masked_fill_(elsewhere.unsqueeze(-1), 0))


class VocabParallelHead(nn.Module):
    """logits = all_gather(hidden W_r^T)[:, :vocab]; `tied`: the embedding shard's weight, shared."""

    def __init__(self, lm_head: nn.Linear, parallel: TensorParallel, tied: nn.Parameter | None = None):
        super().__init__()
        if lm_head.bias is not None:
            raise ValueError("a vocabulary-parallel LM head with a bias is not supported")
        self.vocab = lm_head.out_features
        with torch.no_grad():
            weight = tied if tied is not None else nn.Parameter(vocab_rows(lm_head.weight, parallel))
        self.linear = linear_of(weight, None)
        self.parallel = parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.parallel.all_gather(self.linear(hidden))
        return logits if logits.shape[-1] == self.vocab else logits[..., :self.vocab].contiguous()
