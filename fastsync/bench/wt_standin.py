"""A stand-in for vLLM's ``ipc`` weight-transfer backend on a CPU host, for the bench only.

vLLM's ``ipc`` backend shares each full tensor through a CUDA IPC handle and the worker loads
it with vLLM's checkpoint-format path: layerwise reload (``initialize_layerwise_reload`` at
``start_weight_update``, ``model.load_weights`` per update, ``finalize_layerwise_reload`` at
``finish_weight_update``, which re-runs the kernels' post-load steps). CUDA IPC does not exist on
CPU (the real backend fails at ``torch.cuda.get_device_properties``), so this stand-in replaces
only the handle: the trainer copies the gathered full tensors (``ModuleSource`` iteration, as the
real backend) into one shared-memory file, and the update carries the file name and offsets
instead of IPC handles. Everything else is vLLM's own ``IPCWeightTransferEngine`` (its start and
finish, its ``load_weights`` call). Difference to the real backend, named: one memcpy of every
tensor into the file on the trainer (CUDA IPC shares a contiguous tensor without a copy).

Registered by :func:`register_standin` under :data:`STANDIN`, in the bench's process and, for
an engine in its own processes, in each vLLM worker: the bench starts that engine with
``worker_extension_cls=`` :data:`REGISTRATION`, whose import (before vLLM creates the worker's
weight-transfer engine) registers the stand-in. Never through the plugin entry point.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferUpdateInfo,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

__all__ = ["STANDIN", "REGISTRATION", "register_standin", "ShmIPCTrainerInitInfo", "StandinRegistration"]

STANDIN = "ipc_shm_standin"
#: ``worker_extension_cls`` of an engine that must know the stand-in in its own worker processes
REGISTRATION = "fastsync.bench.wt_standin.StandinRegistration"


@dataclass
class ShmIPCUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    path: str
    nbytes: int


class ShmIPCWeightTransferEngine(IPCWeightTransferEngine):
    """vLLM's IPC worker engine, reading the tensors from a shared-memory file."""

    update_info_cls = ShmIPCUpdateInfo  # type: ignore[assignment]

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises without an accelerator
        self.receive_weights(self.parse_update_info(update_info))  # type: ignore[arg-type]

    def receive_weights(self, update_info: ShmIPCUpdateInfo) -> None:  # type: ignore[override]
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        buf = torch.from_file(update_info.path, shared=True, size=update_info.nbytes, dtype=torch.uint8)
        weights = []
        for name, dt, shape, off in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                        update_info.offsets):
            dtype = getattr(torch, dt)
            n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
            weights.append((name, buf[off: off + n].view(dtype).view(shape)))
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)


@dataclass
class ShmIPCTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = STANDIN


class ShmIPCTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmIPCTrainerInitInfo]):
    """The IPC trainer's unpacked path (gather each tensor, ship names/dtypes/shapes and handles
    in one update), with a shared-memory file in place of CUDA IPC handles. One trainer rank."""

    init_info_cls = ShmIPCTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        meta = source.metadata()
        self.offsets, off = [], 0
        for m in meta:
            self.offsets.append(off)
            n = int(torch.Size(m.shape).numel()) * torch.empty(0, dtype=m.dtype).element_size()
            off += -(-n // 64) * 64
        self.nbytes = max(off, 1)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="fastsync-ipc-standin-", dir=shm)
        os.close(fd)
        self.buf = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        self.buf.zero_()  # touched once, like any registered buffer

    @classmethod
    def trainer_init(cls, init_info: ShmIPCTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "ShmIPCTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("the IPC stand-in needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.client.init_weight_transfer_engine({"packed": False})
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        names, dtypes, shapes = [], [], []
        self.client.start_weight_update()
        for (name, tensor), off in zip(self.source, self.offsets):
            t = materialize_full_tensor(tensor).detach()
            n = t.numel() * t.element_size()
            self.buf[off: off + n].view(t.dtype).view(t.shape).copy_(t)
            names.append(name)
            dtypes.append(str(t.dtype).split(".")[-1])
            shapes.append(list(t.shape))
        self.client.update_weights({"names": names, "dtype_names": dtypes, "shapes": shapes,
                                    "offsets": self.offsets, "path": self.path, "nbytes": self.nbytes})
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def register_standin() -> None:
    """Register both sides in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if STANDIN not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(STANDIN, ShmIPCWeightTransferEngine)
    if STANDIN not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(STANDIN, ShmIPCTrainerWeightTransferEngine)


class StandinRegistration:
    """A worker extension with no methods: importing this module in a vLLM worker registers the
    stand-in there (see the module doc)."""


register_standin()
