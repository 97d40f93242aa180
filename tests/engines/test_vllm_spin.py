"""``FASTSYNC_VLLM_SPIN_S`` (``fastsync/engines/vllm/spin.py``) on vLLM's real ``SpinCondition``, in
this process: readers made after the plugin ran spin the window it names (and ``reader_spins`` finds them alive),
writers are left alone,
unset leaves vLLM's own 1 s, and anything but seconds from 0 to 60 is refused naming the variable.
That the plugin runs in every worker of a live engine: ``tests/engines/test_vllm_sync.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")

from fastsync.engines.vllm.spin import SPIN_ENV, reader_spins, spin_from_env, tune_reader_spin  # noqa: E402
from fastsync.errors import ConfigError  # noqa: E402


@pytest.fixture
def spin(monkeypatch):
    """vLLM's SpinCondition as this test found it, restored afterwards (the suite's own setting
    may already have wrapped it in this process)."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)
    if hasattr(SpinCondition, "_fastsync_spin_s"):
        monkeypatch.setattr(SpinCondition, "_fastsync_spin_s", SpinCondition._fastsync_spin_s)
    else:  # removed again afterwards
        monkeypatch.setattr(SpinCondition, "_fastsync_spin_s", None, raising=False)
    ctx = zmq.Context()
    made = []

    def new(is_reader: bool):
        """A reader (with its writer bound first, as vLLM pairs them) or a writer, on a fresh address."""
        addr = f"inproc://fs-spin-{len(made)}"
        made.append(SpinCondition(False, ctx, addr))
        if is_reader:
            made.append(SpinCondition(True, ctx, addr))
        return made[-1]

    yield SpinCondition, new
    for c in reversed(made):  # readers first, each socket closed before the context ends
        for sock in (c.local_notify_socket, c.read_cancel_socket, c.write_cancel_socket):
            if sock is not None:
                sock.close(linger=0)
    ctx.term()


def test_readers_made_after_it_spin_the_window_it_names_writers_untouched(spin, monkeypatch):
    cls, new = spin
    monkeypatch.setenv(SPIN_ENV, "0.25")
    assert tune_reader_spin() == 0.25
    assert new(True).busy_loop_s == 0.25 and new(False).busy_loop_s == 0
    assert 0.25 in reader_spins()  # the live reader, as the worker extension's fastsync_reader_spin reports it
    monkeypatch.setenv(SPIN_ENV, "0")  # loaded again (another plugin load): the new window, one wrapper
    wrapper = cls.__init__
    assert tune_reader_spin() == 0.0 and cls.__init__ is wrapper
    assert new(True).busy_loop_s == 0.0


def test_reader_spins_passes_over_weak_proxies_whose_object_is_gone(spin, monkeypatch):
    """The collector holds weak proxies too (vLLM's queues keep some); ``isinstance`` on one whose
    object is gone raises ReferenceError, which broke ``fastsync_reader_spin`` in a live TP=2
    worker. A dead proxy alive in this process is passed over."""
    import gc
    import weakref

    class Gone:
        pass

    monkeypatch.setenv(SPIN_ENV, "0.25")
    tune_reader_spin()
    reader = spin[1](True)
    obj = Gone()
    proxy = weakref.proxy(obj)
    del obj
    gc.collect()
    assert any(o is proxy for o in gc.get_objects())  # the collector holds it, as the scan meets it
    with pytest.raises(ReferenceError):
        isinstance(proxy, spin[0])  # what the scan did
    assert 0.25 in reader_spins() and reader.busy_loop_s == 0.25


def test_unset_leaves_vllms_own_second(spin, monkeypatch):
    cls, new = spin
    monkeypatch.setattr(cls, "__init__", getattr(cls.__init__, "__wrapped__", cls.__init__))  # vLLM's own
    for unset in (None, "", "  "):
        if unset is None:
            monkeypatch.delenv(SPIN_ENV, raising=False)
        else:
            monkeypatch.setenv(SPIN_ENV, unset)
        assert spin_from_env() is None and tune_reader_spin() is None
    assert not getattr(cls.__init__, "_fastsync", False) and new(True).busy_loop_s == 1


@pytest.mark.parametrize("bad", ["fast", "-0.5", "61", "nan", "1e400"])
def test_anything_but_seconds_is_refused_naming_the_variable(bad, monkeypatch):
    monkeypatch.setenv(SPIN_ENV, bad)
    with pytest.raises(ConfigError, match=rf"{SPIN_ENV}='{bad}': expected seconds from 0 to 60"):
        tune_reader_spin()


@pytest.mark.slow
def test_a_bad_value_stops_the_engine_before_any_engine_process_starts(tmp_path):
    """vLLM loads its general plugins while it builds the engine's arguments, in the caller's
    process: ``LLM(...)`` raises fastsync's ConfigError there (a fresh process: plugins load once)."""
    import os
    import subprocess
    import sys

    code = ("from vllm import LLM\n"
            "try:\n"
            f"    LLM(model={str(tmp_path)!r}, skip_tokenizer_init=True, enforce_eager=True)\n"
            "except Exception as e:\n"
            "    print('RAISED', type(e).__name__, e)\n")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, SPIN_ENV: "fast"}, capture_output=True,
                       text=True, timeout=300)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RAISED")]
    assert line and line[0].startswith(f"RAISED ConfigError {SPIN_ENV}='fast': expected seconds"), (p.stdout[-2000:],
                                                                                                  p.stderr[-2000:])
    assert "EngineCore" not in p.stdout + p.stderr  # no engine process was started
