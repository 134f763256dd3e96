"""Prefill phase: the prefill scheduler and the prefill instance (fills KV, samples the first token)."""
