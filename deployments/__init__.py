"""The Ray Serve side of lora-serve: the app that `serve run serve_config.yaml` builds, split by concern.

- `app.py`: build_app, the config's import_path target; it binds the engine deployment, its router and its gate.
- `api/`: what each HTTP API's clients send and read: the request schemas and response renderers of the OpenAI,
  Responses and LoRAX/TGI APIs, chat templates and tools, the error shapes, and the typed events a replica's engine
  emits for the renderers.
- `gate/`: who may call and how much: API keys and their scopes, per-key limits, per-key metrics.
- `routes/`: the HTTP routes of every API, their choice streams and their error answers.
- `routing/`: which replica serves a request: the policy, Serve's request router, HAProxy's ingress router, a
  replica's view of its peers, direct ingress and the HAProxy launcher.
- `replica/`: the engine replica (LLMServer) and what it runs beside the engine: event streams, pacing, stats,
  metrics, its OpenMP runtime and the autoscaling policy.

Arrows point one way: app -> replica -> routes -> gate -> api, and replica -> routing; routing imports none of the
others, so Serve's proxy loads no torch and no HTTP routes.
"""
