"""Adapter cache: just-in-time LoRA loading from local folders, the Hugging Face Hub and S3; tiers: device slots,
the CPU copy (in serving, the Ray object store), the disk tier of downloads, the source. It implements the engine's
adapter provider protocol (engine/lora/provider.py): local_cache.py offline, actor.py (the only module that imports Ray)
in serving; it imports nothing of deployments (tests/test_layout.py checks both).

The package imports nothing itself, so that the routing side (replica_report.py, read by the request router in
Serve's proxy and by the ingress request router's replica) loads without torch, which adapter.py needs: with torch,
`serve run serve_config.yaml` held far more memory in Serve's fallback proxy and in the router's replica, and
importing torch was most of the router's import, in a process that starts beside the engine replica."""
