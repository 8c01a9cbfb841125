"""Deterministic simulation of a prefill/decode pair of real workers on virtual time."""

from kvsm_testing.sim.config import Faults, SimConfig, SimResult
from kvsm_testing.sim.harness import Simulation, run_simulation

__all__ = ["Faults", "SimConfig", "SimResult", "Simulation", "run_simulation"]
