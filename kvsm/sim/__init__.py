"""Deterministic simulation of a prefill/decode pair on virtual time."""

from kvsm.sim.harness import Faults, SimConfig, SimResult, Simulation, run_simulation

__all__ = ["Faults", "SimConfig", "SimResult", "Simulation", "run_simulation"]
