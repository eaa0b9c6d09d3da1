"""Hardware profiles and presets for the cost model and the simulator (no torch)."""

from orbitflow.sim.profiles import (
    HardwareProfile,
    ProfileError,
    fit_link_rate,
    list_presets,
    load_preset,
    resolve_profile,
)

__all__ = ["HardwareProfile", "ProfileError", "fit_link_rate", "list_presets", "load_preset", "resolve_profile"]
