"""The engine replica: LLMServer, one AsyncEngine per Serve replica and the EngineClient its routes take, and what
it runs beside the engine: a request's typed events (engine_events.py, also the in-process server's:
in_process.py), local and forwarded event streams, event pacing, its stats and metrics, its requests' OpenTelemetry
traces (tracing.py), its OpenMP runtime, and the autoscaling policy Serve's controller calls with the replicas'
reports."""
