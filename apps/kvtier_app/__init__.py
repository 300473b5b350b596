"""kvtier's front-ends: the `kvtier` command (breakeven, crd, contract, simulate, demo),
the simulator's report plots, and the numpy reference transformer the local demo serves.
They sit on top of the core, the sidecar and the operator, and import nothing of the
test environment: every front-end works from the installed package."""
