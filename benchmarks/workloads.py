"""Deterministic prompts and the request lists of each benchmark workload."""

from __future__ import annotations

from dataclasses import dataclass

# Varied natural-language prompts, 5-40 tokens each with the SmolLM2 tokenizer; cycled to fill a workload.
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea at night.",
    "Explain in simple terms why the sky is blue during the day and red at sunset.",
    "List three healthy breakfast ideas.",
    "Translate 'good morning, how are you today?' into Spanish.",
    "Summarise the plot of Romeo and Juliet in two sentences, as if explaining it to a ten-year-old who has never "
    "read Shakespeare.",
    "Why do cats purr?",
    "Give me a recipe for a quick vegetable soup that uses carrots, potatoes, onions and whatever spices I have.",
    "What are the main differences between a virus and a bacterium?",
    "Describe a busy train station in the early morning.",
    "How does a bicycle stay upright when it is moving, and why does it fall over when it stops?",
    "Tell me a fun fact about octopuses.",
    "I am planning a weekend trip to the mountains with two friends. What should we pack, what could we do if "
    "it rains all day, and how early should we leave on Saturday morning?",
    "Write the opening line of a mystery novel.",
    "What is photosynthesis, in one paragraph?",
    "Suggest a name for a small bakery that sells bread and coffee.",
]

Request = tuple[str, int]  # (prompt, max_new_tokens)


def make_requests(num: int, new_tokens: int | list[int]) -> list[Request]:
    """`num` requests cycling through PROMPTS; `new_tokens` is one count or a pattern cycled over the requests."""
    pattern = [new_tokens] if isinstance(new_tokens, int) else new_tokens
    return [(PROMPTS[i % len(PROMPTS)], pattern[i % len(pattern)]) for i in range(num)]


@dataclass(frozen=True)
class Plan:
    """Sizes of every workload; `full()` is the real benchmark, `quick()` a smoke test."""
    uniform_requests: int  # (a) N requests x T new tokens
    uniform_tokens: int
    mixed_requests: int  # (b) every 8th request wants `mixed_long` tokens, the rest `mixed_short`
    mixed_long: int
    mixed_short: int
    static_small_batch: int  # (b) extra HF static-batching reference batch size
    batch_sizes: tuple[int, ...]  # (c) throughput / latency vs batch size
    sweep_tokens: int
    stream_tokens: int  # (d) single-stream decode
    slow_subset: int  # requests the slow course loops run on (one-at-a-time loops)

    @staticmethod
    def full() -> "Plan":
        return Plan(64, 32, 64, 100, 10, 16, (1, 2, 4, 8, 16, 32, 64), 32, 128, 16)

    @staticmethod
    def quick() -> "Plan":
        return Plan(8, 8, 16, 20, 4, 4, (1, 2, 4, 8), 8, 16, 4)

    def uniform(self) -> list[Request]:
        return make_requests(self.uniform_requests, self.uniform_tokens)

    def mixed(self) -> list[Request]:
        return make_requests(self.mixed_requests, [self.mixed_long] + [self.mixed_short] * 7)

    @property
    def max_batch(self) -> int:
        return max(self.uniform_requests, self.mixed_requests, *self.batch_sizes)


def long_prompt(tokenizer, opening: str, length: int, seed: int) -> list[int]:
    """A prompt of exactly `length` token ids: `opening` (which makes it unique), then the workload's prompts in turn
    from `seed` on, cut to length."""
    text = opening + " " + " ".join(PROMPTS[(seed + j) % len(PROMPTS)] for j in range(length // 8))
    ids = tokenizer(text).input_ids
    assert len(ids) >= length, f"long prompt has only {len(ids)} tokens"
    return ids[:length]
