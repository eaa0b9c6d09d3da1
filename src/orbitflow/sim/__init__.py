"""The simulator: trace replay on the simulated executor (runner) and sweeps over policies and settings."""
