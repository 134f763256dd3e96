"""Placement: which instances exist (prefill/decode/colocated), their TP/PP and nodes; and the search for the best one."""
