"""Peer reload: a joining engine is filled from live holders of the current version.

``source.py`` turns holders' engine tensors into a source layout the planner reads,
``plans.py`` caches plans per (source layout, target layout), ``holders.py`` holds the
trainer-side holder, ``coordinator.py`` picks holders, checks versions, runs the reload and
falls back to another holder or to the checkpoint when a holder dies.
"""
