"""distserve: goodput-optimised LLM serving with disaggregated prefill and decode."""
