"""Attention kernels over a paged KV cache (torch CPU implementation; GPU backends when available)."""
