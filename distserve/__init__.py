"""distserve: goodput-optimised LLM serving with disaggregated prefill and decode."""

from distserve.compiled import activate as _activate_compiled

_activate_compiled()  # the simulator's hot modules as mypyc built them, if built from these sources
