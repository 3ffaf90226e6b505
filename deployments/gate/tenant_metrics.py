"""Per-API-key Prometheus series, exported through Ray (ray.serve.metrics), and the bounded labels every series of
the app uses.

Series are bounded by `TopLabels`: the `top_n` most counted names keep their own label and every other name is
reported as "other", so a server with thousands of adapters or keys exports a fixed number of series. Per-key
series are labelled by the key's name (never the key): requests by outcome (admitted, rate_limited, unauthorized)
and tokens by kind.
"""

from __future__ import annotations

from collections import Counter as Tally

from ray.serve import metrics

OTHER, UNAUTHENTICATED = "other", "unauthenticated"


class TopLabels:
    """Name -> metric label: its own for the top_n most counted so far, "other" for the rest, `none` for None."""

    def __init__(self, top_n: int, none: str):
        self.top_n = top_n
        self.none = none
        self.counts: Tally[str] = Tally()

    def label(self, name: str | None, count: bool = True) -> str:
        if name is None:
            return self.none
        self.counts[name] += count
        top = {a for a, _ in self.counts.most_common(self.top_n)}
        return name if name in top else OTHER


class TenantMetrics:
    """Per-API-key usage: requests by outcome, prompt and generated tokens."""

    def __init__(self, top_tenants: int = 20):
        self.labels = TopLabels(top_tenants, UNAUTHENTICATED)
        self.requests = metrics.Counter("lora_serve_tenant_requests", "Requests by API key and outcome.",
                                        ("tenant", "outcome"))
        self.token_counts = metrics.Counter("lora_serve_tenant_tokens", "Tokens by API key and kind.",
                                            ("tenant", "kind"))

    def request(self, tenant: str | None, outcome: str) -> None:
        self.requests.inc(1, {"tenant": self.labels.label(tenant), "outcome": outcome})

    def tokens(self, tenant: str, prompt_tokens: int, generated_tokens: int) -> None:
        label = self.labels.label(tenant, count=False)
        for kind, count in (("prompt", prompt_tokens), ("generated", generated_tokens)):
            if count:  # Ray counters refuse 0
                self.token_counts.inc(count, {"tenant": label, "kind": kind})
