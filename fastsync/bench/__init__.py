"""Benchmark harnesses: weight sync across processes (harness, model, workers), layout and plan
building (layout), MoE layers (moe). Used by ``fastsync bench`` / ``fastsync moe-bench``."""
