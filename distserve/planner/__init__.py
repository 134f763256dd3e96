"""The placement planner: searches placements against the simulator and reports the chosen plan."""
