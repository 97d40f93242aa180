"""The trainer side of vLLM's weight-transfer API around a flip, without an engine: the order of
vLLM's calls and of the pause (``ClientEngine``), with a client and a pauser that record what they
are asked, over fastsync's real control store. The same flows against a real ``vllm serve`` are in
test_vllm_weight_transfer_serve.py; these pin the cases that must never pause or must resume.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("vllm")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.engines.vllm.wt_keys import connect_key, error_text, staged_key, version_key  # noqa: E402
from fastsync.engines.vllm.wt_client import ClientEngine  # noqa: E402
from fastsync.engines.vllm.wt_pause import check_pauser, pauser_for  # noqa: E402
from fastsync.errors import ConfigError, SyncError  # noqa: E402


class Calls:
    """A weight-sync client and a pauser in one, recording every call in order; a worker stand-in
    (``on_start``/``on_update``) publishes what the real workers would under the control keys."""

    def __init__(self, control, *, paused=False, pause_error=None) -> None:
        self.control = control
        self.calls: list[str] = []
        self.paused = paused
        self.pause_error = pause_error
        self.on_start = lambda: None
        self.on_update = lambda: None

    def start_weight_update(self):
        self.calls.append("start")
        self.on_start()

    def update_weights(self, info):
        self.calls.append(f"update:{info['version']}")
        self.on_update()

    def finish_weight_update(self, weight_version=None):
        self.calls.append(f"finish:{weight_version}")

    def pause(self, mode, timeout_s):
        self.calls.append(f"pause:{mode}")
        if self.pause_error is not None:
            raise self.pause_error

    def resume(self, timeout_s):
        self.calls.append("resume")

    def is_paused(self, timeout_s):
        return self.paused


@pytest.fixture
def control(monkeypatch):
    monkeypatch.setenv("FASTSYNC_JOB_SECRET", "ab" * 32)
    store = TCPStoreControl.server(port=0)
    yield store.with_prefix("t")
    store.close()


def _engine(control, calls, mode="keep", staged=True):
    eng = ClientEngine(calls, control, {}, 5.0, pause_mode=mode, pauser=calls)
    eng.num_ranks, eng.staged, eng.label = 1, staged, "step-7"
    return eng


def _flip_ok(control):
    control.set(version_key(0, 7), json.dumps({"rank": 0, "flip_s": 0.01}))


def test_staged_pauses_only_for_the_flip_and_labels_inside_the_pause(control):
    calls = Calls(control)
    calls.on_start = lambda: threading.Timer(0.3, lambda: control.set(staged_key(0, 7), "{}")).start()
    calls.on_update = lambda: _flip_ok(control)
    eng = _engine(control, calls)
    got = eng.wait_update(eng.begin_update(7, 5.0), 5.0)
    # the workers' deadline comes first, so the trainers report their reason, not a timeout
    assert json.loads(control.get("wt/open", 1.0)) == {"version": 7, "timeout_s": 4.0}
    assert calls.calls == ["start", "pause:keep", "update:7", "finish:step-7", "resume"]
    rec = eng.history[-1]
    assert rec["paused_by"] == "fastsync" and rec["transfer_s"] >= 0.25  # the pause came after the writes landed
    assert 0 <= rec["stall_s"] < rec["transfer_s"] and got[0]["stall_s"] == rec["stall_s"]


def test_dense_pauses_for_the_whole_update(control):
    calls = Calls(control)
    calls.on_update = lambda: _flip_ok(control)
    eng = _engine(control, calls, mode="wait", staged=False)
    eng.wait_update(eng.begin_update(7, 5.0), 5.0)
    assert calls.calls == ["pause:wait", "start", "update:7", "finish:step-7", "resume"]


def test_a_failed_staged_receive_never_pauses_and_ends_vllms_session(control):
    calls = Calls(control)
    why = error_text(SyncError("engine rank 0: the writes of version 7 did not all land"))
    calls.on_start = lambda: control.set(staged_key(0, 7), why)
    calls.on_update = lambda: control.set(version_key(0, 7), error_text(SyncError("version 7 incomplete, keeping "
                                                                                  "version 6: trainer rank 1")))
    eng = _engine(control, calls)
    with pytest.raises(SyncError, match="version 7 incomplete, keeping version 6: trainer rank 1"):
        eng.wait_update(eng.begin_update(7, 5.0), 5.0)
    # no pause, no resume; update_weights refused, finish_weight_update (no label) ends every session
    assert calls.calls == ["start", "update:7", "finish:None"]
    assert eng.history[-1]["paused_by"] is None and eng.history[-1]["stall_s"] == 0.0


def test_a_slow_start_on_a_loaded_host_still_reports_the_workers_reason(control):
    """vLLM's start call took most of the update's deadline (a loaded host): the workers opened the
    version inside it and their own deadline (4 s of 5) runs from there, so their refusal comes
    after trainer rank 0's deadline counted from before the call. Rank 0 waits for it from the
    call's return and raises the workers' reason (which trainer rank is missing), not a timeout."""
    calls = Calls(control)
    why = error_text(SyncError("engine rank 0: version 7 incomplete, keeping version 6: trainer rank 1 sent nothing"))

    def slow_start():
        time.sleep(3.0)  # the workers' clock starts at the end of the call
        threading.Timer(4.0 + 0.5, lambda: control.set(staged_key(0, 7), why)).start()
    calls.on_start = slow_start
    # the worker's flip refuses with its staged verdict, or, called while it still receives, says so
    calls.on_update = lambda: control.set(version_key(0, 7), control.try_get(staged_key(0, 7)) or error_text(
        SyncError("engine rank 0: version 7 is still being received")))
    eng = _engine(control, calls)
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="trainer rank 1 sent nothing"):
        eng.wait_update(eng.begin_update(7, 5.0), 5.0)
    assert calls.calls == ["start", "update:7", "finish:None"]


def test_a_failed_pause_resumes_and_gives_the_landed_version_up(control):
    calls = Calls(control, pause_error=SyncError("HTTP 500 wait timed out"))
    calls.on_start = lambda: control.set(staged_key(0, 7), "{}")
    eng = _engine(control, calls, mode="wait")
    with pytest.raises(SyncError, match=r"pause_mode='wait': the engine did not pause: HTTP 500"):
        eng.wait_update(eng.begin_update(7, 5.0), 5.0)
    # resumed, and finish_weight_update without a flip: the workers abandon the version
    assert calls.calls == ["start", "pause:wait", "resume", "finish:None"]


def test_a_refusal_by_a_worker_that_did_not_raise_gets_no_label(control):
    """Only the engine's last worker raises out of update_weights (vLLM's executor would mix up
    the later replies otherwise): a refusal published by another worker still ends the update
    without vLLM's label, and finish_weight_update closes the sessions left open."""
    calls = Calls(control)
    calls.on_update = lambda: control.set(version_key(0, 7), error_text(SyncError("engine rank 0: post-processing "
                                                                                  "failed; every layer keeps version 6")))
    eng = _engine(control, calls, mode="abort", staged=False)
    with pytest.raises(SyncError, match="engine rank 0: post-processing failed"):
        eng.wait_update(eng.begin_update(7, 5.0), 5.0)
    assert calls.calls == ["pause:abort", "start", "update:7", "finish:None", "resume"]


def test_a_host_that_paused_keeps_its_pause(control):
    calls = Calls(control, paused=True)
    calls.on_start = lambda: control.set(staged_key(0, 7), "{}")
    calls.on_update = lambda: _flip_ok(control)
    eng = _engine(control, calls)
    eng.wait_update(eng.begin_update(7, 5.0), 5.0)
    assert calls.calls == ["start", "update:7", "finish:step-7"]  # no second pause, no resume
    assert eng.history[-1]["paused_by"] == "host"


def test_a_mode_the_engine_cannot_honour_is_refused_by_name_before_the_plan(control):
    calls = Calls(control)
    eng = _engine(control, calls)
    eng._init = object()  # describe() ran: the workers said what they can do
    eng.described = [{"pause_modes": ["wait"], "pause_modes_why": "its engine core runs in the caller's process"}]
    with pytest.raises(ConfigError, match=r"pause_mode='keep': the vLLM engine: its engine core runs in the "
                                          r"caller's process cannot pause that way \(it can: \['wait'\]\)"):
        eng.connect("{}", {"staged": True})
    assert control.try_get(connect_key()) is None  # no plan went out: nothing registered, nothing moved


def test_a_client_that_cannot_pause_is_refused_naming_the_option():
    class Bare:  # vLLM's client protocol and nothing else
        def init_weight_transfer_engine(self, init_info): ...

    with pytest.raises(ConfigError, match=r"FastSyncTrainerInitInfo.pause_mode='keep': the client Bare has no way"):
        check_pauser(Bare(), "keep")
    assert check_pauser(Bare(), None) is None  # the host pauses (or nobody)
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    assert type(pauser_for(HTTPVLLMWeightSyncClient("http://127.0.0.1:1/"))).__name__ == "HttpPauser"


def test_trainer_init_info_checks_the_new_fields():
    from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo

    assert FastSyncTrainerInitInfo(rank=0).pause_mode == "wait" and not FastSyncTrainerInitInfo(rank=0).staged
    with pytest.raises(ConfigError, match=r"pause_mode must be one of \['abort', 'wait', 'keep'\].*got 'pause'"):
        FastSyncTrainerInitInfo(rank=0, pause_mode="pause").validate()
    with pytest.raises(ConfigError, match="FastSyncTrainerInitInfo.staged must be True or False"):
        FastSyncTrainerInitInfo(rank=0, staged="yes").validate()
    FastSyncTrainerInitInfo(rank=0, pause_mode=None, staged=True).validate()
