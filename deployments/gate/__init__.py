"""Who may call and how much: API keys (kept as hashes) and the adapters each reaches, per-key request and token
limits, and per-key metrics, applied by an ASGI middleware before a body is parsed. Imports only api/."""
