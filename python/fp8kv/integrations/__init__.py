"""Integrations of fp8kv's paged FP8 KV cache into model libraries (`fp8kv.integrations.transformers`)."""
