"""The trace-driven simulator (Pollux-style): recorded workload traces, a cluster model, the gymnasium environment
and the goodput oracle. Nothing here is imported by ``import batchpilot``; gymnasium is needed only by
:mod:`batchpilot.sim.env`."""
