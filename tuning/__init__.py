"""Ray Tune sweeps of a run's knobs on the live cluster, starting from the planner's prediction (shares first)."""
