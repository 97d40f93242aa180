"""Replica state, version-aware routing and rolling updates.

``state.py``: what each replica reports (version, serving/updating/reloading). ``router.py``:
:class:`VersionRouter`, the component host adapters plug into their own load balancing.
``rolling.py``: updates in waves. ``http.py``: an OpenAI-compatible HTTP front for
``vllm serve`` replicas (aiohttp) with ``/health`` and ``/version``.
"""
