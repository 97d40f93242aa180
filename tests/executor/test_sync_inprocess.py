"""Sender and receiver end to end in one process (threads, real NIXL agents and a real TCPStore):
bit-exact delivery, version flip only after complete delivery, a failing sender leaves the
receiver on its last complete version (in-place writes restored from the backup), reusing the
failed version is refused on both ends and the retry with the next one succeeds bit-exact,
plan-hash mismatches are refused before any byte moves, and every wait is bounded."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from fastsync.bench.model import build_bench_model, reference_tensors, trainer_buffers
from fastsync.control import TCPStoreControl
from fastsync.errors import PlanError, SyncError
from fastsync.sync.receiver import WeightReceiver
from fastsync.sync.sender import WeightSender

pytest.importorskip("nixl._api", reason="NIXL not installed (pip install nixl-cu12==1.5.1 && nixl==1.5.1 --no-deps)")

_ns = itertools.count()


@pytest.fixture(scope="module")
def store() -> TCPStoreControl:
    return TCPStoreControl.server(port=0, timeout_s=20)


@pytest.fixture(scope="module")
def model():
    return build_bench_model(trainers=2, rollouts=1, size_bytes=1 << 20)


def _tensors(model) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for n, t in model.engine.tensors[0].items()}


def _equal(tensors: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(tensors[n], want[n]) for n in want)


def _run_senders(senders, version, per_rank):
    errors: dict[int, BaseException] = {}

    def go(s: WeightSender) -> None:
        try:
            s.sync(version, **per_rank.get(s.rank, {}))
        except BaseException as e:  # collected for the test to inspect
            errors[s.rank] = e

    threads = [threading.Thread(target=go, args=(s,)) for s in senders]
    for t in threads:
        t.start()
    return threads, errors


def test_failed_sender_keeps_the_old_version_and_next_sync_succeeds(store, model) -> None:
    ctl = store.with_prefix(f"t{next(_ns)}")
    tensors = _tensors(model)
    ptrs = {n: t.data_ptr() for n, t in tensors.items()}
    rx = WeightReceiver(rank=0, plan=model.plan, tensors=tensors, control=ctl, transport="nixl", mode="inplace",
                        backup=True, verify=True, engine_hash=model.engine.fingerprint(), timeout_s=10)
    rx.setup()
    bufs = [trainer_buffers(model, r) for r in range(2)]
    senders = [WeightSender(rank=r, plan=model.plan, sources=bufs[r][1], shards=bufs[r][2], control=ctl,
                            transport="nixl", staging_bytes=64 << 10, timeout_s=10) for r in range(2)]
    for s in senders:
        s.setup()
    assert len(senders[1].program.chunks) >= 3  # small staging: several chunks, so a mid-sync failure

    def sync(version: int, per_rank: dict | None = None) -> dict[int, BaseException]:
        for flat, _, _ in bufs:
            if version % 2 != getattr(flat, "_v", 0) % 2:
                flat.neg_()
            flat._v = version
        rx.begin(version)
        threads, errors = _run_senders(senders, version, per_rank or {})
        try:
            rx.wait(time.monotonic() + 10)
            rx.finish()
        except SyncError as e:
            errors[-1] = e
        for t in threads:
            t.join(10)
        return errors

    assert sync(1) == {} and rx.version == 1
    v1 = reference_tensors(model, 0, 1)
    assert _equal(tensors, v1)

    def die(k: int) -> None:
        if k >= 1:
            raise RuntimeError("trainer lost mid-sync")

    t0 = time.monotonic()
    errors = sync(2, {1: {"on_chunk": die}})
    assert time.monotonic() - t0 < 8  # failed on the sender's report, not on the deadline
    assert isinstance(errors[1], SyncError) and "trainer lost" in str(errors[1])
    assert isinstance(errors[-1], SyncError) and "trainer rank 1" in str(errors[-1])
    assert rx.version == 1
    assert _equal(tensors, v1)  # in-place writes of version 2 rolled back from the backup
    assert store.with_prefix(ctl.prefix).get("recv/0/flipped/2", 1).startswith(b"err:")
    # version 2 is spent: its keys (begun, flipped=err, done=err) and notifications linger, so
    # reusing it is refused on both ends before anything moves; the retry takes version 3
    assert rx.versions.attempted == 2 and all(s.versions.attempted == 2 for s in senders)
    with pytest.raises(SyncError, match="version 2 was already attempted"):
        rx.begin(2)
    with pytest.raises(SyncError, match="version 2 was already attempted"):
        senders[0].sync(2, timeout_s=1)
    assert rx._open is None and _equal(tensors, v1)

    assert sync(3) == {} and rx.version == 3
    assert _equal(tensors, reference_tensors(model, 0, 3))
    assert all(t.data_ptr() == ptrs[n] for n, t in tensors.items())  # written in place, never replaced
    for s in senders:
        s.close()
    rx.close()


def test_an_engine_refusing_to_begin_fails_the_senders_at_once(store, model) -> None:
    """A restarted trainer job (fresh senders) asks for version 1 of an engine rank that holds 2:
    the rank refuses to begin it and says so under its ``begun`` key, so the trainer ranks fail
    with its reason at once, not at their 30 s deadline, and nothing is written."""
    ctl = store.with_prefix(f"t{next(_ns)}")
    tensors = _tensors(model)
    rx = WeightReceiver(rank=0, plan=model.plan, tensors=tensors, control=ctl, transport="nixl", timeout_s=10)
    rx.setup()
    bufs = [trainer_buffers(model, r) for r in range(2)]

    def senders() -> list[WeightSender]:
        out = [WeightSender(rank=r, plan=model.plan, sources=bufs[r][1], shards=bufs[r][2], control=ctl,
                            transport="nixl", timeout_s=30) for r in range(2)]
        for s in out:
            s.setup()
        return out

    first = senders()
    rx.begin(2)
    threads, errors = _run_senders(first, 2, {})
    rx.wait(time.monotonic() + 10)
    rx.finish()
    for t in threads:
        t.join(10)
    assert errors == {} and rx.version == 2
    held = {n: t.clone() for n, t in tensors.items()}
    for s in first:
        s.close()

    restarted = senders()
    with pytest.raises(SyncError, match="version 1 is not newer than held 2"):
        rx.begin(1)
    t0 = time.monotonic()
    threads, errors = _run_senders(restarted, 1, {})
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 5, "the senders waited for their deadline"
    assert set(errors) == {0, 1}, errors
    for e in errors.values():
        assert isinstance(e, SyncError) and "engine rank 0 refused to begin version 1" in str(e), e
        assert "not newer than held 2" in str(e), e
    assert rx.version == 2 and _equal(tensors, held)
    for s in restarted:
        s.close()
    rx.close()


def test_receiver_without_senders_fails_by_its_deadline_naming_ranks_and_tensors(store, model) -> None:
    ctl = store.with_prefix(f"t{next(_ns)}")
    tensors = _tensors(model)
    rx = WeightReceiver(rank=0, plan=model.plan, tensors=tensors, control=ctl, transport="nixl", timeout_s=10)
    rx.setup()
    rx.begin(1)
    t0 = time.monotonic()
    assert rx.wait(time.monotonic() + 0.5) is False
    with pytest.raises(SyncError, match=r"version 1 incomplete, keeping version 0.*trainer rank 0.*'model\."):
        rx.finish()
    assert time.monotonic() - t0 < 3
    assert rx.version == 0 and all(not t.any() for t in tensors.values())
    rx.close()


def test_sender_without_a_begun_receiver_fails_by_its_deadline(store, model) -> None:
    ctl = store.with_prefix(f"t{next(_ns)}")
    rx = WeightReceiver(rank=0, plan=model.plan, tensors=_tensors(model), control=ctl, transport="nixl")
    rx.setup()  # published, but never begins a version: a stuck or dead engine
    _, views, shards = trainer_buffers(model, 0)
    s = WeightSender(rank=0, plan=model.plan, sources=views, shards=shards, control=ctl, transport="nixl")
    s.setup()
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="engine rank 0 .begin of version 1."):
        s.sync(1, timeout_s=0.5)
    assert time.monotonic() - t0 < 3
    assert ctl.get("send/0/done/1", 1).startswith(b"err:")
    s.close()
    rx.close()


def test_plan_hash_mismatch_is_refused_before_any_byte_moves(store, model) -> None:
    ctl = store.with_prefix(f"t{next(_ns)}")
    other = build_bench_model(trainers=2, rollouts=1, size_bytes=2 << 20)
    assert other.plan.plan_hash != model.plan.plan_hash
    tensors = _tensors(model)
    rx = WeightReceiver(rank=0, plan=model.plan, tensors=tensors, control=ctl, transport="nixl")
    rx.setup()
    _, views, shards = trainer_buffers(other, 0)
    s = WeightSender(rank=0, plan=other.plan, sources=views, shards=shards, control=ctl, transport="nixl")
    with pytest.raises(PlanError, match=f"engine rank 0 holds plan {model.plan.plan_hash}"):
        s.setup()
    assert s.program is None and s.transport.agent is None  # refused before agents, registration or writes
    assert all(not t.any() for t in tensors.values())
    with pytest.raises(PlanError, match="engine layout"):
        WeightReceiver(rank=0, plan=model.plan, tensors=tensors, control=ctl, transport="nixl",
                       engine_hash=other.engine.fingerprint())
    with pytest.raises(PlanError, match="trainer layout"):
        WeightSender(rank=0, plan=model.plan, sources=views, shards=other.trainer, control=ctl, transport="nixl")
    rx.close()


class _FailingEngine:
    """An engine handle whose describe() fails as a non-fastsync error would (a dead actor,
    a driver bug): WeightSync must carry it to the other trainer ranks, not let them time out."""

    def __init__(self, message: str) -> None:
        self.message = message

    def describe(self, options: dict | None = None) -> list[dict]:
        raise RuntimeError(self.message)


def _setup_all(syncs) -> dict[int, BaseException]:
    errors: dict[int, BaseException] = {}

    def go(ws) -> None:
        try:
            ws.setup()
        except BaseException as e:  # collected for the test to inspect
            errors[ws.rank] = e

    threads = [threading.Thread(target=go, args=(ws,)) for ws in syncs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads), "set-up did not fail within its deadline"
    return errors


def test_rank0_setup_failures_reach_the_other_ranks_and_a_retry_reads_its_own_keys(store, model) -> None:
    from fastsync.errors import ConfigError, SyncError
    from fastsync.sync import WeightSync

    ctl = store.with_prefix(f"t{next(_ns)}")
    srcs = [trainer_buffers(model, r)[1] for r in range(2)]
    engine = _FailingEngine("engine actor died")
    syncs = [WeightSync(rank=r, world_size=2, control=ctl, engines=[engine] if r == 0 else [], layout=model.trainer,
                        sources=srcs[r], timeout_s=10) for r in range(2)]
    t0 = time.monotonic()
    errors = _setup_all(syncs)
    assert time.monotonic() - t0 < 5  # published by rank 0, not rank 1's 4 x timeout_s wait
    assert isinstance(errors[0], RuntimeError)
    # a foreign error crosses as SyncError naming its type (fastsync.errors' one codec)
    assert type(errors[1]) is SyncError and "RuntimeError: engine actor died" in str(errors[1])
    # the same objects set up again: rank 1 must read this attempt's outcome, not the first one's
    engine.message = "engine actor died again"
    errors = _setup_all(syncs)
    assert "died again" in str(errors[1]), errors[1]
    assert all(ws.sender is None for ws in syncs)
    # rank 0 without engine handles: a ConfigError on rank 0 and, by name, on rank 1
    bare = [WeightSync(rank=r, world_size=2, control=ctl, layout=model.trainer, sources=srcs[r], timeout_s=10,
                       name="bare") for r in range(2)]
    errors = _setup_all(bare)
    assert isinstance(errors[0], ConfigError) and isinstance(errors[1], ConfigError)
    assert "engine handles" in str(errors[1])
    with pytest.raises(ConfigError, match="control_port"):
        WeightSync(rank=0, world_size=1, control=ctl, layout=model.trainer, sources=srcs[0], control_port=0)


@pytest.mark.parametrize("mode", ["full", "sample"])
def test_verification_catches_one_flipped_byte_rolls_back_and_names_it(store, model, mode) -> None:
    """The fault: one byte of one engine tensor flipped after the writes landed, before the flip
    (first byte of a transfer: every sample covers it). Both modes refuse the version naming the
    tensor, the engine rank and the trainer rank; the engine keeps the last version; the next
    version, uncorrupted, passes. A sample digests a small share of the bytes a full check does."""
    from fastsync.executor.verify import Digests, receiver_checksums

    ctl = store.with_prefix(f"t{next(_ns)}")
    tensors = _tensors(model)
    rx = WeightReceiver(rank=0, plan=model.plan, tensors=tensors, control=ctl, transport="nixl", mode="inplace",
                        backup=True, verify=mode, engine_hash=model.engine.fingerprint(), timeout_s=10)
    rx.setup()
    bufs = [trainer_buffers(model, r) for r in range(2)]
    senders = [WeightSender(rank=r, plan=model.plan, sources=bufs[r][1], shards=bufs[r][2], control=ctl,
                            transport="nixl", timeout_s=10) for r in range(2)]
    for s in senders:
        s.setup()
    src, items = rx.program.by_origin()[-1]
    victim = max(items, key=lambda it: it.transfer.nbytes)
    name, off = victim.transfer.dst_tensor, victim.dst_runs[0][0]

    def sync(version: int, corrupt: bool) -> SyncError | None:
        for flat, _, _ in bufs:
            if version % 2 != getattr(flat, "_v", 0) % 2:
                flat.neg_()
            flat._v = version
        rx.begin(version)
        threads, errors = _run_senders(senders, version, {})
        try:
            rx.wait(time.monotonic() + 10)
            if corrupt:
                rx.landing.regions[name][off: off + 1].bitwise_not_()
            rx.finish()
            return None
        except SyncError as e:
            return e
        finally:
            for t in threads:
                t.join(10)

    assert sync(1, corrupt=False) is None and rx.version == 1
    v1 = reference_tensors(model, 0, 1)
    err = sync(2, corrupt=True)
    assert err is not None and rx.version == 1 and _equal(tensors, v1)
    msg = str(err)
    assert f"engine rank 0: version 2 failed verification ({mode})" in msg
    assert repr(name) in msg and f"trainer rank {src}" in msg and "checksum mismatch" in msg, msg
    assert "rolled back: engine rank 0 keeps version 1" in msg
    assert sync(3, corrupt=False) is None and rx.version == 3 and _equal(tensors, reference_tensors(model, 0, 3))
    assert rx.last_verify["mode"] == mode and rx.last_verify["ok"]
    full = Digests(3, lambda _i: "full")
    sample = Digests(3, lambda _i: "sample")
    for it in items:
        for o, n in it.dst_runs:
            full.feed(it.index, rx.landing.regions[it.transfer.dst_tensor][o: o + n])
            sample.feed(it.index, rx.landing.regions[it.transfer.dst_tensor][o: o + n])
    assert sample.bytes_read() < full.bytes_read() / 4, (sample.bytes_read(), full.bytes_read())
    assert receiver_checksums(rx.program, rx.landing.regions, mode, 3)  # what the check above compared
    for s in senders:
        s.close()
    rx.close()
