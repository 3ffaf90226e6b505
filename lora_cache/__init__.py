"""Adapter cache: just-in-time LoRA loading, CPU tier in the Ray object store, device slots (issue 3)."""
