"""What a step costs on this engine, learned from its own steps, and how much prefill fits a step time.

A step's time is modelled as fixed + per_token * prefill tokens + per_decode * decodes. The three coefficients are
fitted by recursive least squares, with old steps forgotten at a steady rate, over the engine's own steps (the wall
time from scheduling a step to having its tokens), so they follow the device, model, adapters and load they run
under with nothing measured ahead of time: each replica learns what a prompt token costs on its own device, and
the same target gives each device the chunks it wants.

The scheduler asks how many prefill tokens fit beside a step's decodes (`prefill_budget`). Until the fit has seen
enough prefill steps it answers with `first_chunk` tokens, so a burst arriving at a cold engine is measured in a
few small steps instead of one long one; and it never answers less than `min_chunk`, so a waiting prompt advances
every step even when the decodes alone fill the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEARNED_AFTER = 4  # prefill steps observed before the fit sizes steps
FORGETTING = 0.97  # each step weighs this much less than the one after it: about the last 30 steps count


@dataclass(frozen=True)
class StepShape:
    """The work a step does, as the cost model sees it."""
    prefill_tokens: int  # prompt tokens fed (chunks of prompts, fresh or after cached tokens)
    decodes: int  # sequences feeding one generated token


class StepCost:
    """Step time = coefficients . (1, prefill tokens, decodes), fitted online by recursive least squares, and the
    step-time target it sizes prefill for."""

    def __init__(self, target_s: float, first_chunk: int = 256, min_chunk: int = 32):
        self.target_s, self.first_chunk, self.min_chunk = target_s, first_chunk, min_chunk
        self.coefficients = np.zeros(3)
        self._inverse = np.eye(3) * 1e4  # the fit's inverse information matrix: large, so the first steps move it
        self.prefill_steps = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step that did `shape`'s work in `seconds`."""
        x = _features(shape)
        gain = self._inverse @ x / (FORGETTING + x @ self._inverse @ x)
        self.coefficients = self.coefficients + gain * (seconds - x @ self.coefficients)
        self._inverse = (self._inverse - np.outer(gain, x @ self._inverse)) / FORGETTING
        self.prefill_steps += shape.prefill_tokens > 0

    def predict(self, shape: StepShape) -> float:
        return float(_features(shape) @ self.coefficients)

    @property
    def learned(self) -> bool:
        """Seen enough prefill steps, with a positive cost per prefill token."""
        return self.prefill_steps >= LEARNED_AFTER and self.coefficients[1] > 0

    def prefill_budget(self, decodes: int) -> int:
        """The prefill tokens that keep a step with `decodes` decodes within the target (at least min_chunk)."""
        if not self.learned:
            return self.first_chunk
        spare = self.target_s - self.predict(StepShape(0, decodes))
        return max(self.min_chunk, int(spare / self.coefficients[1]))

    def prefill_rate(self) -> float | None:
        """Prompt tokens a second, once learned."""
        return 1.0 / self.coefficients[1] if self.learned else None


def _features(shape: StepShape) -> np.ndarray:
    return np.array([1.0, shape.prefill_tokens, shape.decodes])
