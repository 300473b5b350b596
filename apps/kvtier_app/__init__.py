"""kvtier's front-ends: the `kvtier` command (breakeven, crd, simulate, demo), the
simulator's report plots and the demo. They sit on top of the core, the sidecar, the
operator and (for the demo's fleet and cluster modes) the test environment."""
