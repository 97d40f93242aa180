"""The vLLM worker's LoRA verbs (``fastsync/engines/vllm/lora.py``) around a failed receive, on CPU
without vLLM: the receiver is a stand-in (the real one runs in ``test_vllm_lora.py``'s engine)."""

from __future__ import annotations

import pytest

from fastsync.engines.vllm.lora import LoraState, LoraWorkerMixin
from fastsync.errors import SyncError
from fastsync.host.replies import raise_worker_errors


class StandInReceiver:
    """What ``fastsync_lora_begin``/``finish`` call on a ``WeightReceiver``; ``wait`` fails the way
    a real one does when its trainer died (it has rolled the version back: nothing is open)."""

    def __init__(self) -> None:
        self.open: int | None = None
        self.aborted: list[str] = []

    def begin(self, version: int) -> None:
        self.open = version

    def wait(self, deadline: float) -> bool:
        version, self.open = self.open, None
        raise SyncError(f"engine rank 0: version {version} failed, keeping version 1: trainer rank 0 died")

    def expire(self) -> None:
        pass

    def finish(self) -> int:
        if self.open is None:
            raise SyncError("engine rank 0: finish() with no version open")
        return self.open

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)


def test_finish_raises_the_reason_its_background_receive_failed():
    worker = LoraWorkerMixin()
    worker._fastsync_lora = LoraState(0, {}, [], 8, receiver=StandInReceiver())
    assert raise_worker_errors([worker.fastsync_lora_begin(2, 5.0)], "begin")[0]["version"] == 2
    with pytest.raises(SyncError, match="version 2 failed, keeping version 1: trainer rank 0 died"):
        raise_worker_errors([worker.fastsync_lora_finish(2, 5.0)], "finish")
    st = worker._fastsync_lora
    assert st.open is None and st.error is None and st.serving is None  # nothing flipped; the next version may begin
    assert raise_worker_errors([worker.fastsync_lora_begin(3, 5.0)], "begin")[0]["version"] == 3
