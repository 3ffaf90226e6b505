"""The engine replica: LLMServer, one AsyncEngine per Serve replica behind the routes, and what it runs beside the
engine: local and forwarded event streams, event pacing, its stats and metrics, its OpenMP runtime, and the
autoscaling policy Serve's controller calls with the replicas' reports."""
