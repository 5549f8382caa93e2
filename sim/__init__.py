"""specfleet.sim: a discrete-event simulator of one InferenceService's fleet, and a capacity planner.

Each simulated engine runs the engine's own `Scheduler` and `BlockManager` (engine/scheduler.py,
engine/block_manager.py) with a model runner whose step time comes from a `Profile` and whose tokens come
from the workload; the fleet router's policy (`specfleet.router`, least-loaded) and the tuner's `Policy` run as real code
over simulated time. See docs/simulator.md.
"""
