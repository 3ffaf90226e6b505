"""What each HTTP API's clients send and read: request schemas (pydantic, validated once here, at the edge), the
renderers that turn the engine's typed events into each API's JSON and stream, and the error shapes each API's
clients parse. Imports nothing else of deployments/."""
