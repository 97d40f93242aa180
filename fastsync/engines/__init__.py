"""Inference-engine receivers: the code that runs inside engine workers, and its host-side handles.

* ``vllm.py``: ``FastSyncWorkerExtension`` (``worker_extension_cls``) — describe, connect,
  begin/finish/update, version, inside every vLLM worker.
* ``vllm_layout.py``: read the live vLLM model's parameters and check them against the name map.
* ``vllm_host.py``: ``VllmEngine`` (in-process ``LLM``), ``RemoteEngine`` + ``serve`` (another
  process, over the control plane) — the handles ``fastsync.sync.WeightSync`` drives.

Nothing here is imported by ``import fastsync``; vLLM is imported only inside these modules.
"""
