"""A LoRA trainer PROCESS for ``test_vllm_lora.py``, killed by it in the middle of a version. Not
a test module.

It runs the real trainer side, ``LoraSync`` (plan, its own NIXL sender and heartbeat), against the
vLLM engine living in the test's process. Its engine handle is :class:`ParentEngine`, a stand-in
for the RPC a trainer uses to reach its engines: every ``lora_*`` call crosses the socket to the
test process, which runs it on its ``VllmLoraEngine`` and sends back the result or the exception.

Conversation (pickled tuples over the socket whose fd is ``spec["fd"]``):

* child -> parent ``("call", method, args)``; parent -> child ``("ok", result)`` or ``("err", exc)``;
* child -> parent ``("synced", version, num_chunks)`` once ``version`` is served, then waits for ``("go",)``;
* child -> parent ``("chunk", k, num_chunks)`` from ``on_chunk`` once write batch ``k >= 1`` is posted
  (batch ``k - 1`` drained: its bytes are in the engine's staging), then blocks until killed;
* child -> parent ``("crash", traceback)`` on any error.

argv: one JSON object: model dir, LoRA rank/alpha/targets, seeds, control port, name, version,
timeout, max_chunk_bytes, fd.
"""

from __future__ import annotations

import json
import socket
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any


class ParentEngine:
    """A ``LoraEngineHandle`` whose calls run in the parent process (on its ``VllmLoraEngine``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def _call(self, method: str, *args: Any) -> Any:
        self.conn.send(("call", method, args))
        kind, value = self.conn.recv()
        if kind == "err":
            raise value
        return value

    def lora_describe(self, rank: int) -> list[dict]:
        return self._call("lora_describe", rank)

    def lora_connect(self, plan_json: str, options: dict) -> list[dict]:
        return self._call("lora_connect", plan_json, options)

    def lora_begin(self, version: int, timeout_s: float) -> list[dict]:
        return self._call("lora_begin", version, timeout_s)

    def lora_finish(self, version: int, timeout_s: float) -> list[dict]:
        return self._call("lora_finish", version, timeout_s)


def new_version(pm: Any, seed: int) -> None:
    """The same adapter values as the test module's ``_new_version(pm, seed)``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def main(spec: dict) -> None:
    sock = socket.socket(fileno=spec["fd"])
    conn = Connection(sock.detach())
    try:
        import torch
        import transformers
        from peft import LoraConfig, get_peft_model

        from fastsync.control import TCPStoreControl
        from fastsync.sync.lora_sync import LoraSync

        base = transformers.AutoModelForCausalLM.from_pretrained(spec["dir"], dtype=torch.float32).eval()
        pm = get_peft_model(base, LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=spec["targets"],
                                             lora_dropout=0.0)).eval()
        control = TCPStoreControl.client(spec["port"])
        ls = LoraSync(pm, control=control, engines=[ParentEngine(conn)], name=spec["name"],
                      timeout_s=spec["timeout_s"], max_chunk_bytes=spec["max_chunk_bytes"])
        ls.setup()
        v = spec["version"]
        new_version(pm, spec["seeds"][0])
        ls.sync(v)
        num_chunks = len(ls.sender.program.chunks)
        conn.send(("synced", v, num_chunks))
        assert conn.recv() == ("go",)

        def stop(k: int) -> None:
            if k >= 1:
                conn.send(("chunk", k, num_chunks))
                conn.recv()  # never answered: the parent kills this process here

        new_version(pm, spec["seeds"][1])
        ls.sync(v + 1, on_chunk=stop)
        conn.send(("crash", f"version {v + 1} completed: the trainer was not stopped"))
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
        raise


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
