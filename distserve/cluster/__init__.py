"""Policies every deployment shares (the Ray runtime, the in-process engines and the simulator), with no Ray and no I/O."""
