"""The static schedule (planner) and the link-level simulator. Pure Python, no torch."""

from __future__ import annotations

from fastsync.plan.planner import build_plan
from fastsync.plan.simulate import Rank0Result, SimResult, rank0_baseline, simulate
from fastsync.plan.types import Plan, Transfer

__all__ = ["Plan", "Transfer", "build_plan", "simulate", "rank0_baseline", "SimResult", "Rank0Result"]
