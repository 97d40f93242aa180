"""Inference engines, one package per engine (today ``vllm/``): the code that runs inside engine
workers, the engine's name maps and live-parameter checks, and its host-side handles.

The core (layout, plan, transport, sync) never imports these packages; it reaches them through
the hooks an engine registers. Nothing here is imported by ``import fastsync``.
"""
