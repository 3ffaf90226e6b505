"""Kirchenbauer et al.'s watermark ("A Watermark for Large Language Models", 2023), as transformers'
WatermarkLogitsProcessor computes it with its default seeding (lefthash over one token), so that transformers'
WatermarkDetector finds it.

Before each new token, the token before it (the prompt's last, for the first) seeds a permutation of the vocabulary;
the permutation's first `greenlist_ratio` share is the green list, and `bias` is added to those logits. A reader
who knows the key counts how many tokens of a text are green for the token before them: far more than the ratio
means watermarked text. The permutation is drawn with torch's CPU generator whatever the device, so the green
lists (and a detector on CPU) are the same on every device; one list, a permutation of the whole vocabulary, is
drawn per watermarked request and token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a green list is drawn: SamplingParams, which holds a Watermark, is part of
    import torch  # the serving side's typed boundary, which imports no torch (engine/__init__.py)

HASHING_KEY = 15485863  # transformers' default key (a large prime)


@dataclass(frozen=True)
class Watermark:
    greenlist_ratio: float = 0.25  # transformers' default; LoRAX and TGI use 0.5
    bias: float = 2.0  # added to each green token's logit
    hashing_key: int = HASHING_KEY

    def __post_init__(self) -> None:
        if not 0.0 < self.greenlist_ratio < 1.0:
            raise ValueError(f"watermark greenlist_ratio must be in (0, 1), got {self.greenlist_ratio}")
        if not math.isfinite(self.bias) or not -100 <= self.bias <= 100:
            raise ValueError(f"watermark bias must be between -100 and 100, got {self.bias}")
        if not isinstance(self.hashing_key, int) or self.hashing_key < 1:
            raise ValueError(f"watermark hashing_key must be a positive integer, got {self.hashing_key!r}")

    def green_list(self, previous_token: int, vocab_size: int) -> torch.Tensor:
        """The token ids that are green after `previous_token`, on CPU."""
        import torch

        generator = torch.Generator().manual_seed((self.hashing_key * previous_token) % (2 ** 64 - 1))
        return torch.randperm(vocab_size, generator=generator)[: int(vocab_size * self.greenlist_ratio)]

    def add_bias(self, row: torch.Tensor, previous_token: int) -> None:
        """One request's logits row, its green tokens' logits raised by `bias` in place."""
        green = self.green_list(previous_token, row.shape[-1]).to(row.device)
        row[green] += self.bias
