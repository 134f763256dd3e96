"""Decode phase: the decode scheduler and the decode instance (admits migrated KV, continuous batching)."""
