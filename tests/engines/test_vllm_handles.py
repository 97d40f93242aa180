"""The host-side handles without an engine: ``serve`` answers every request (even one that
raises a non-fastsync exception) and keeps serving; the fence lock and ``wait_update`` fail by
name instead of blocking or raising a bare KeyError. No vLLM engine starts here: every request
below fails in the handle's own code before it would reach ``llm``."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.engines.vllm.handle import VllmEngine  # noqa: E402
from fastsync.engines.vllm.remote import RemoteEngine, serve  # noqa: E402
from fastsync.host.replies import error_reply, raise_worker_errors  # noqa: E402
from fastsync.errors import ConfigError, LayoutError, SyncError  # noqa: E402


def test_error_reply_keeps_fastsync_classes_and_names_other_types():
    assert error_reply(LayoutError("engine parameter 'x'")) == {"error": ["LayoutError", "engine parameter 'x'"]}
    got = error_reply(RuntimeError("collective_rpc died"))
    assert got == {"error": ["SyncError", "RuntimeError: collective_rpc died"]}
    with pytest.raises(SyncError, match="worker: RuntimeError: collective_rpc died"):
        raise_worker_errors([{"ok": 1}, got], "worker")


def test_serve_answers_failing_requests_and_keeps_serving():
    control = TCPStoreControl.server(port=0)
    engine = VllmEngine(llm=None)
    served: list = []
    th = threading.Thread(target=lambda: served.append(serve(engine, control, engine_id="e", idle_timeout_s=30.0)),
                          daemon=True)
    th.start()
    client = RemoteEngine(control, engine_id="e", timeout_s=10.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="TypeError: .*bogus"):
            client.call("version", bogus=1)  # a TypeError from the handle's own signature
        with pytest.raises(ConfigError, match="unknown engine request 'frobnicate'"):
            client.call("frobnicate")
        with pytest.raises(SyncError, match="AttributeError"):
            client.version()  # llm=None: the call itself raises AttributeError inside the engine handle
        assert time.monotonic() - t0 < 5.0, "failed requests must be answered at once, not by the client's timeout"
    finally:
        client.stop()
        th.join(10.0)
    assert not th.is_alive()
    assert served == [3]  # the loop survived all three failures and stopped on request


def test_serve_refuses_requests_not_signed_with_the_job_secret():
    """A request the store accepted but that is not signed with this job's key (forged body,
    another job's key, a signed request moved to another sequence number) is answered with an
    error and never run; the loop keeps serving signed ones."""
    import json

    from fastsync.security import mac

    control = TCPStoreControl.server(port=0, secret="66" * 32)
    engine = VllmEngine(llm=None)
    served: list = []
    th = threading.Thread(target=lambda: served.append(serve(engine, control, engine_id="e", idle_timeout_s=30.0)),
                          daemon=True)
    th.start()
    other_job = TCPStoreControl.server(port=0, secret="77" * 32)
    forger = RemoteEngine(other_job, engine_id="e")
    client = RemoteEngine(control, engine_id="e", timeout_s=10.0)
    try:
        control.add("engine/e/seq", 1)
        control.set("engine/e/cmd/1", json.dumps({"op": "stop", "args": {}}))  # the unsigned form
        with pytest.raises(SyncError, match="request 1 refused"):
            client._reply(1)
        n = control.add("engine/e/seq", 1)
        body = json.dumps({"op": "stop", "args": {}})
        control.set(f"engine/e/cmd/{n}", json.dumps({"body": body, "mac": "00" * 16}))
        with pytest.raises(SyncError, match=f"request {n} refused"):
            client._reply(n)
        n = control.add("engine/e/seq", 1)  # signed with another job's key
        control.set(f"engine/e/cmd/{n}", json.dumps({"body": body, "mac": mac(forger._key, "engine", "e", str(n),
                                                                              body).hex()}))
        with pytest.raises(SyncError, match=f"request {n} refused"):
            client._reply(n)
        n = control.add("engine/e/seq", 1)  # this job's signed request for number 1, replayed as n
        control.set(f"engine/e/cmd/{n}", json.dumps({"body": body, "mac": mac(client._key, "engine", "e", "1",
                                                                              body).hex()}))
        with pytest.raises(SyncError, match=f"request {n} refused"):
            client._reply(n)
        assert th.is_alive()  # nothing above stopped it
    finally:
        client.stop()
        th.join(10.0)
        other_job.close()
        control.close()
    assert not th.is_alive() and served == [4]


def test_fence_lock_wait_has_a_deadline():
    engine = VllmEngine(llm=None, lock_timeout_s=0.2)
    assert engine._lock.acquire(timeout=1.0)  # an update still running on its thread holds the fence
    try:
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="vLLM engine version: .*still busy"):
            engine.version()
        with pytest.raises(SyncError, match="vLLM engine update to version 3: .*still busy"):
            engine.update(3)
        assert time.monotonic() - t0 < 3.0
    finally:
        engine._lock.release()


def test_wait_update_unknown_token_is_a_sync_error():
    engine = VllmEngine(llm=None)
    with pytest.raises(SyncError, match="unknown token 7"):
        engine.wait_update(7, timeout_s=1.0)


def test_serve_in_turns_continues_the_client_numbering():
    """A host that serves in turns (verl's rollout leader: one turn per sync, ended by ``stop``)
    starts each turn at the returned number + 2 and answers the same client's next requests;
    starting again at 1 would replay the first turn's request."""

    class _Counting:
        def __init__(self) -> None:
            self.calls = 0

        def version(self) -> int:
            self.calls += 1
            return self.calls

    control = TCPStoreControl.server(port=0)
    engine = _Counting()
    client = RemoteEngine(control, engine_id="t", timeout_s=10.0)
    first = 1
    for turn in (1, 2):
        got: list = []
        th = threading.Thread(target=lambda: got.append(serve(engine, control, engine_id="t", idle_timeout_s=30.0,
                                                              first=first)), daemon=True)
        th.start()
        assert client.version() == 2 * turn - 1 and client.version() == 2 * turn
        client.stop()
        th.join(10.0)
        assert not th.is_alive() and got == [first + 1]  # the last request before stop
        first = got[0] + 2
    assert engine.calls == 4


def test_pause_modes_are_refused_by_name_before_anything_moves():
    """``keep`` / ``abort`` on an engine whose core steps only inside generate() (here: no engine
    core at all, so any call into it would raise AttributeError), an unknown mode, a handle that
    does not declare its modes, and verl's server (abort only): each a ConfigError naming the
    mode, raised before describe or connect reaches an engine."""
    from fastsync.layout.trainer import fsdp_layout
    from fastsync.layout.types import ParamSpec
    from fastsync.sync import WeightSync

    engine = VllmEngine(llm=None)
    assert engine.pause_modes == ("wait",)
    for mode in ("keep", "abort"):
        with pytest.raises(ConfigError, match=f"pause_mode='{mode}': this vLLM engine: its engine core runs in this "
                                              "process"):
            engine.connect("{}", {"pause_mode": mode, "control_port": 1})
    with pytest.raises(ConfigError, match="pause_mode must be one of \\['abort', 'wait', 'keep'\\].*'pause'"):
        WeightSync(rank=0, world_size=1, control=None, layout=None, sources=None, model=torch_module(),
                   pause_mode="pause")

    class Handle:  # records whether set-up ever reached it
        def __init__(self, modes=None):
            self.calls: list[str] = []
            if modes is not None:
                self.pause_modes = modes

        def describe(self, options=None):
            self.calls.append("describe")
            raise AssertionError("describe reached")

    import torch

    params = {"w": ParamSpec("w", (3, 5), "float32")}
    control = TCPStoreControl.server(port=0)
    for h, mode in ((Handle(), "keep"), (Handle(("abort", "wait")), "keep"), (Handle(("wait",)), "abort")):
        ws = WeightSync(rank=0, world_size=1, control=control, engines=[h], layout=fsdp_layout(params, 1),
                        sources={"w": torch.zeros(3, 5)}, name=f"pm-{id(h)}", control_port=control.port,
                        pause_mode=mode)
        with pytest.raises(ConfigError, match=f"pause_mode='{mode}': engine handle Handle"):
            ws.setup()
        assert h.calls == []


def torch_module():
    import torch

    return torch.nn.Linear(2, 2)


def test_verl_server_engine_refuses_a_pause_mode_the_rollout_was_not_given():
    """verl's server does vLLM's three modes; the trainer's ``pause_mode``/``staged`` must be what the
    rollout rank was configured with (both read ``engine_kwargs.fastsync``): refused at connect,
    naming the keys, before any call reaches the server (``server=None`` here)."""
    pytest.importorskip("fastsync_verl")
    from fastsync_verl.server import ServerEngine

    eng = ServerEngine(server=None, control=None, engine_id="0", workers=1, timeout_s=1.0)
    assert tuple(eng.pause_modes) == ("abort", "wait", "keep")
    for mode in ("wait", "keep"):
        with pytest.raises(ConfigError, match=f"asks pause_mode='{mode}'.*engine_kwargs.fastsync.pause_mode='abort'"):
            eng.connect("{}", {"pause_mode": mode})
    with pytest.raises(ConfigError, match="staged=True but this rollout rank.*staged=False"):
        eng.connect("{}", {"pause_mode": "abort", "staged": True})
    with pytest.raises(ConfigError, match="pause_mode must be one of"):
        eng.connect("{}", {"pause_mode": "drain"})
    with pytest.raises(ConfigError, match="pause_mode must be one of"):
        ServerEngine(server=None, control=None, engine_id="0", workers=1, timeout_s=1.0, pause_mode="drain")