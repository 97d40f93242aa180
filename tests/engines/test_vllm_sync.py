"""fastsync into a REAL vLLM CPU engine: tiny Qwen3 dense at tensor_parallel_size=2 and tiny
Qwen3-MoE at tp=1, each started once for this module.

Two trainer ranks (threads of this process, each with its own NIXL agent) hold FSDP2-style row
shards of the HF model's weights (``fsdp_layout`` boxes); after a sync the engine's greedy tokens
must equal the HF model's own greedy tokens on those weights, token for token. Engines run in
float32 so that equality is not at the mercy of bf16 near-ties (the bf16 path is run by the demo).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.demo.checkpoints import build_tiny_checkpoint  # noqa: E402
from fastsync.demo.run import engine_kwargs, hf_greedy  # noqa: E402
from fastsync.errors import FastSyncError, LayoutError, PlanError, SyncError  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.trainer import fsdp_layout  # noqa: E402
from fastsync.layout.types import ParamSpec, TrainerLayout  # noqa: E402
from fastsync.sync import WeightSync  # noqa: E402
from fastsync_rigs.threads import run_ranks as _run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123], [400, 3, 77]]
MAX_TOKENS = 6
DTYPE = "float32"
TIMEOUT_S = 60.0


class Rig:
    """One live engine, the HF model that plays the trainer, and two trainer ranks."""

    def __init__(self, preset: str, tp: int, tmp: str) -> None:
        import transformers
        from vllm import LLM

        from fastsync.engines.vllm.handle import VllmEngine

        self.dir = str(build_tiny_checkpoint(preset, os.path.join(tmp, preset)))
        t0 = time.perf_counter()
        self.llm = LLM(**engine_kwargs(self.dir, tp, DTYPE))
        self.start_s = time.perf_counter() - t0
        print(f"\n{preset} tp={tp}: engine start {self.start_s:.1f} s")
        self.engine = VllmEngine(self.llm)
        self.control = TCPStoreControl.server(port=0)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.dir, dtype=getattr(torch, DTYPE)).eval()
        self.full = {n: p.data for n, p in self.hf.named_parameters()}
        self.params = {n: ParamSpec(n, tuple(t.shape), DTYPE) for n, t in self.full.items()}
        self.layout = fsdp_layout(self.params, 2)
        self.sources = [{n: self.full[n][box_slices(s.box)].clone() for n, ss in self.layout.shards_on(r).items()
                         for s in ss} for r in range(2)]
        self.ws = [self._ws(r, self.layout, self.sources[r], "main") for r in range(2)]
        run_ranks([lambda r=r: self.ws[r].setup() for r in range(2)])
        self.version = 0

    def _ws(self, rank: int, layout: TrainerLayout, sources: dict, name: str, world: int = 2) -> WeightSync:
        return WeightSync(rank=rank, world_size=world, control=self.control.with_prefix(name),
                          engines=[self.engine] if rank == 0 else [], transport="nixl", timeout_s=TIMEOUT_S,
                          layout=layout, sources=sources, name=name, control_port=self.control.port)

    def step(self, seed: int) -> None:
        """A training step's worth of change: every weight moves, shards follow."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, t in self.full.items():
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.05 * (t.std() + 1e-3))
            for r in range(2):
                for n, ss in self.layout.shards_on(r).items():
                    self.sources[r][n].copy_(self.full[n][box_slices(ss[0].box)])

    def sync(self, ranks: tuple[int, ...] = (0, 1), timeout_s: float = TIMEOUT_S) -> list:
        self.version += 1
        return run_ranks([lambda r=r: self.ws[r].sync(self.version, timeout_s=timeout_s) for r in ranks],
                         timeout_s=timeout_s + 30)

    def hf_tokens(self) -> list[list[int]]:
        return hf_greedy(self.hf, PROMPTS, MAX_TOKENS)

    def engine_tokens(self) -> list[list[int]]:
        return self.engine.generate(PROMPTS, MAX_TOKENS)

    def close(self) -> None:
        for w in self.ws:
            w.close()
        self.llm.collective_rpc("fastsync_close")
        import psutil  # a vLLM dependency

        try:
            self.llm.llm_engine.engine_core.shutdown()  # stop the engine process before the next rig starts
        except psutil.NoSuchProcess:
            pass  # vLLM's kill_process_tree raced a worker that had already exited: it is gone either way


def run_ranks(fns: list, timeout_s: float = TIMEOUT_S * 2) -> list:
    """Run each trainer rank's call on its own thread; re-raise the first failure."""
    return _run_ranks(fns, timeout_s)


@pytest.fixture(scope="module", params=[("tiny-qwen3", 2), ("tiny-qwen3-moe", 1)], ids=["dense-tp2", "moe-tp1"])
def rig(request, tmp_path_factory):
    preset, tp = request.param
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # auto-binding asserts on a single-NUMA host
    try:
        r = Rig(preset, tp, str(tmp_path_factory.mktemp("ckpt")))
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    yield r
    r.close()


def test_workers_queue_readers_spin_as_fastsync_vllm_spin_s_says(rig):
    """fastsync's ``vllm.general_plugins`` entry point ran in every worker before vLLM made its
    queues: each reader alive there spins the suite's ``FASTSYNC_VLLM_SPIN_S`` (tests/conftest.py),
    not vLLM's 1 s."""
    from fastsync.engines.vllm.spin import spin_from_env

    want = spin_from_env()
    assert want is not None and want != 1.0
    got = rig.llm.collective_rpc("fastsync_reader_spin")
    assert len(got) == rig.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size, got
    assert all(g and set(g) == {want} for g in got), got


def test_engine_core_forks_its_workers_as_fastsync_vllm_worker_start_says(rig):
    """fastsync's ``vllm.general_plugins`` entry point ran in the engine core before it made its
    workers: with the suite's ``FASTSYNC_VLLM_WORKER_START=fork`` and unbound threads
    (tests/conftest.py; ``spawn`` where the caller set it so), each worker (two at TP=2; vLLM-CPU
    runs a TP=1 model in a worker process too) started from the engine core with ``fork``, the
    method vLLM read there; all from the same parent, which is not this process (the engine core
    itself is spawned, as vLLM-CPU wants)."""
    import os

    from fastsync.engines.vllm.worker_start import worker_start_from_env

    want = "fork" if worker_start_from_env() == "fork" else "spawn"  # the suite's fork, unless the caller said spawn
    got = rig.llm.collective_rpc("fastsync_worker_start")
    tp = rig.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    assert [g["method"] for g in got] == [want] * tp, got
    parents = {g["parent"] for g in got}
    assert len(parents) == 1 and os.getpid() not in parents and len({g["pid"] for g in got}) == tp, got


def test_describe_reports_staged_prepacked_weights(rig):
    info = rig.ws[0].engine_info[0]
    assert len(info) == rig.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    staged = info[0]["staged"]
    assert any("qkv_proj" in n for n in staged) and all(":" in why for why in staged.values())
    assert "model.embed_tokens.weight" in info[0]["inplace"]


def test_sync_makes_engine_generate_like_the_trainer(rig):
    before = rig.engine_tokens()
    assert before == rig.hf_tokens(), "engine and HF disagree on the checkpoint itself"
    v0 = rig.engine.version()
    rig.step(seed=1)
    res = rig.sync()
    print(f"sync v{rig.version}: " + ", ".join(f"rank {r.rank} {r.seconds * 1e3:.1f} ms" for r in res))
    after = rig.engine_tokens()
    assert after != before
    assert after == rig.hf_tokens()
    assert rig.engine.version() == v0 + 1 == rig.version


def test_second_step_syncs_again(rig):
    rig.step(seed=2)
    rig.sync()
    assert rig.engine_tokens() == rig.hf_tokens()
    assert rig.engine.version() == rig.version


def test_sender_that_dies_leaves_last_complete_version(rig):
    served = rig.engine.version()
    before = rig.engine_tokens()
    rig.step(seed=3)
    with pytest.raises(SyncError):
        rig.sync(ranks=(0,), timeout_s=4.0)  # rank 1 never writes its shards: the engine must refuse
    assert rig.engine.version() == served
    assert rig.engine_tokens() == before
    rig.sync()  # and the next complete sync lands
    assert rig.engine_tokens() == rig.hf_tokens()
    assert rig.engine.version() == rig.version


def test_missing_trainer_parameter_fails_before_any_write(rig):
    served, before = rig.engine.version(), rig.engine_tokens()
    drop = "model.norm.weight"
    params = {n: p for n, p in rig.params.items() if n != drop}
    layout = fsdp_layout(params, 1)
    sources = {n: rig.full[n] for n in params}
    with pytest.raises((LayoutError, PlanError), match="model.norm.weight"):
        rig._ws(0, layout, sources, "missing", world=1).setup()
    assert rig.engine.version() == served and rig.engine_tokens() == before


def test_mismatched_trainer_shape_fails_before_any_write(rig):
    served, before = rig.engine.version(), rig.engine_tokens()
    bad = "model.layers.0.post_attention_layernorm.weight"
    params = dict(rig.params)
    params[bad] = ParamSpec(bad, (params[bad].shape[0] // 2,), DTYPE)
    layout = fsdp_layout(params, 1)
    sources = {n: torch.zeros(p.shape) for n, p in params.items()}
    with pytest.raises(FastSyncError, match=bad):
        rig._ws(0, layout, sources, "mismatch", world=1).setup()
    assert rig.engine.version() == served and rig.engine_tokens() == before


def test_engine_checks_live_shapes_against_the_name_map(rig):
    import json

    config = json.load(open(os.path.join(rig.dir, "config.json")))
    key = "moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size"
    config[key] *= 2
    with pytest.raises(LayoutError, match=r"engine parameter 'model\.layers\.0\.mlp\.[a-z0-9_.]+' has local shape"):
        rig.engine.describe({"config": config})


def test_architecture_without_a_name_map_is_refused_by_name(rig):
    import json

    config = json.load(open(os.path.join(rig.dir, "config.json")))
    config["architectures"] = ["FooForCausalLM"]
    # layout="hand": only the hand-written maps (the default "auto" would record this engine's
    # layout from vLLM's loaders instead; tests/engines/test_vllm_recorded.py covers that)
    with pytest.raises(FastSyncError, match="FooForCausalLM"):
        rig.engine.describe({"config": config, "layout": "hand"})
    assert rig.engine.version() == rig.version  # the engine still serves its last complete version


def test_generation_is_fenced_until_the_flip(rig):
    """A request arriving while a version is open waits, then samples only the new weights."""
    rig.step(seed=5)
    rig.version += 1
    v = rig.version
    token = rig.engine.begin_update(v, TIMEOUT_S)  # the engine opens v and waits for the writes
    time.sleep(0.5)
    got: dict = {}
    reader = threading.Thread(target=lambda: got.setdefault("tokens", rig.engine_tokens()), daemon=True)
    reader.start()
    time.sleep(1.0)
    assert reader.is_alive(), "generation ran while a weight version was open"
    run_ranks([lambda r=r: rig.ws[r].sender.sync(v, wait_receivers=True, timeout_s=TIMEOUT_S) for r in range(2)])
    rig.engine.wait_update(token, TIMEOUT_S)
    for w in rig.ws:
        w.version = v
    reader.join(TIMEOUT_S)
    assert not reader.is_alive()
    assert got["tokens"] == rig.hf_tokens()
    assert rig.engine.version() == v


def test_trace_dir_writes_each_ranks_phases_and_the_engines(rig, tmp_path):
    """WeightSync(trace_dir=...): one file per trainer rank, merged onto one clock: both trainer
    ranks' phases and every engine rank's (wait, apply with the CPU-kernel repack inside)."""
    from fastsync.sync.trace_dir import merge_trace_dir
    from fastsync.trace import chrome, enable

    ws = [WeightSync(rank=r, world_size=2, control=rig.control.with_prefix("traced"),
                     engines=[rig.engine] if r == 0 else [], transport="nixl", timeout_s=TIMEOUT_S, layout=rig.layout,
                     sources=rig.sources[r], name="traced", control_port=rig.control.port, trace_dir=str(tmp_path))
          for r in range(2)]
    try:
        run_ranks([lambda r=r: ws[r].setup() for r in range(2)])
        rig.step(seed=7)
        rig.version += 1
        res = run_ranks([lambda r=r: ws[r].sync(rig.version, timeout_s=TIMEOUT_S) for r in range(2)])
        assert rig.engine_tokens() == rig.hf_tokens()
        merged = chrome.load(merge_trace_dir(tmp_path))
    finally:
        for w in ws:
            w.close()
        enable(False)
    workers = res[0].engines[0]
    names = chrome.process_names(merged)
    assert sorted(names.values()) == sorted([f"engine rank {w['rank']}" for w in workers]
                                            + ["trainer rank 0", "trainer rank 1"])
    xs = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    tops = {names[e["pid"]]: e for e in xs if e["name"] == f"v{rig.version} nixl"}
    for r in range(2):
        assert tops[f"trainer rank {r}"]["dur"] / 1e6 == pytest.approx(res[r].metrics["seconds"], rel=0.05, abs=2e-4)
    for w in workers:
        mine = [e for e in xs if names[e["pid"]] == f"engine rank {w['rank']}"]
        phases = {e["name"]: e for e in mine}
        assert {"backup", "wait", "apply", "repack"} <= set(phases)
        apply, repack = phases["apply"], phases["repack"]
        assert apply["ts"] - 1 <= repack["ts"] and repack["ts"] + repack["dur"] <= apply["ts"] + apply["dur"] + 1
        assert repack["dur"] / 1e6 == pytest.approx(w["postprocess_s"], rel=0.05, abs=1e-4)


def test_delta_sync_into_the_live_engine_with_rollback_and_dense_resync(rig):
    """WeightSync(delta=True) into the same live engine (its receiver becomes a delta one): the
    first sync dense, then a delta of a sparse step (3% of the elements move) written into the live
    and staging tensors and repacked at the flip, generating like the trainer; a delta whose
    second trainer rank never sends leaves the engine on its last version and tokens; the next
    sync goes dense, the one after that is a delta again."""
    ws = [WeightSync(rank=r, world_size=2, control=rig.control.with_prefix("delta"),
                     engines=[rig.engine] if r == 0 else [], transport="nixl", timeout_s=TIMEOUT_S, layout=rig.layout,
                     sources=rig.sources[r], name="delta", control_port=rig.control.port, delta=True)
          for r in range(2)]

    def sparse_step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, t in rig.full.items():
                mask = torch.rand(t.shape, generator=g) < 0.03
                t[mask] += torch.randn(int(mask.sum()), generator=g, dtype=t.dtype) * 0.3 * (t.std() + 1e-3)
            for r in range(2):
                for n, ss in rig.layout.shards_on(r).items():
                    rig.sources[r][n].copy_(rig.full[n][box_slices(ss[0].box)])

    def sync(ranks=(0, 1), timeout_s=TIMEOUT_S):
        rig.version += 1
        return run_ranks([lambda r=r: ws[r].sync(rig.version, timeout_s=timeout_s) for r in ranks],
                         timeout_s=timeout_s + 30)

    try:
        run_ranks([lambda r=r: ws[r].setup() for r in range(2)])
        sparse_step(11)
        sync()
        assert ws[0].last_kind == "dense" and rig.engine_tokens() == rig.hf_tokens()
        before = rig.engine_tokens()
        sparse_step(12)
        sync()
        assert ws[0].last_kind == "delta"
        for w in ws:
            st = w.sender.last_stats
            assert st["mode"] == "delta" and 0 < st["bytes_sent"] < 0.2 * st["bytes_dense"], st
        after = rig.engine_tokens()
        assert after == rig.hf_tokens() and after != before
        assert rig.engine.version() == rig.version
        served, before = rig.engine.version(), after
        sparse_step(14)
        with pytest.raises(SyncError):
            sync(ranks=(0,), timeout_s=4.0)  # a delta version trainer rank 1 never sends: refused
        assert ws[0].last_kind == "delta"
        assert rig.engine.version() == served and rig.engine_tokens() == before
        sync()  # after a failure trainer rank 0 chooses dense
        assert ws[0].last_kind == "dense" and rig.engine_tokens() == rig.hf_tokens()
        sparse_step(15)
        sync()
        assert ws[0].last_kind == "delta" and rig.engine_tokens() == rig.hf_tokens()
        assert rig.engine.version() == rig.version
    finally:
        for w in ws:
            w.close()


def test_staged_sync_keeps_generating_and_pauses_only_for_the_flip(rig):
    """WeightSync(staged=True): the writes land in staging and shadow memory while a client keeps
    generating; every request returns the old model's or the new model's greedy tokens, never a
    mix (no forward pass sees two versions); requests finish during the sync on the old version;
    the engine holds generation back only for the flip. A staged version one trainer rank never
    sends is refused and the engine keeps serving (and kept generating) its last version."""
    ws = [WeightSync(rank=r, world_size=2, control=rig.control.with_prefix("staged"),
                     engines=[rig.engine] if r == 0 else [], transport="nixl", timeout_s=TIMEOUT_S, layout=rig.layout,
                     sources=rig.sources[r], name="staged", control_port=rig.control.port, staged=True)
          for r in range(2)]
    one = [PROMPTS[0]]
    calls: list[tuple[float, list[int], float]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            t0 = time.time()
            got = rig.engine.generate(one, MAX_TOKENS)[0]
            calls.append((t0, got, time.time()))

    def sync(ranks=(0, 1), timeout_s=TIMEOUT_S):
        rig.version += 1
        return run_ranks([lambda r=r: ws[r].sync(rig.version, timeout_s=timeout_s) for r in ranks],
                         timeout_s=timeout_s + 30)

    th = threading.Thread(target=client, daemon=True)
    try:
        run_ranks([lambda r=r: ws[r].setup() for r in range(2)])
        old = rig.engine.generate(one, MAX_TOKENS)[0]
        assert [old] == hf_greedy(rig.hf, one, MAX_TOKENS)
        rig.step(seed=21)
        new = hf_greedy(rig.hf, one, MAX_TOKENS)[0]
        assert new != old
        th.start()
        time.sleep(0.3)
        t0 = time.time()
        res = sync()
        t1 = time.time()
        time.sleep(0.3)
        stop.set()
        th.join(60)
        assert {tuple(c[1]) for c in calls} <= {tuple(old), tuple(new)}, "a request saw two versions"
        # a request in flight while the writes landed ran on the old version and was not aborted
        # (under the default pause mode, wait, the flip lets it finish first: it may return after
        # t1; on a loaded machine one request can outlast the whole sync, so overlap is what counts)
        during = [c for c in calls if c[0] <= t1 and c[2] >= t0]
        assert any(c[1] == old for c in during), (len(calls), t1 - t0)  # generation went on while the writes landed
        assert calls[-1][1] == new and rig.engine_tokens() == rig.hf_tokens()
        reply = res[0].engines[0][0]
        assert reply["stall_s"] < res[0].seconds and reply["received_s"] > 0, reply
        # a staged version trainer rank 1 never sends: refused, the last version kept
        before = rig.engine_tokens()
        rig.step(seed=22)
        with pytest.raises(SyncError):
            sync(ranks=(0,), timeout_s=4.0)
        assert rig.engine.version() == rig.version - 1 and rig.engine_tokens() == before
        sync()
        assert rig.engine_tokens() == rig.hf_tokens()
    finally:
        stop.set()
        for w in ws:
            w.close()


def test_staging_memory_is_checked_at_set_up_naming_the_option(monkeypatch):
    """Staged receive needs a shadow and a flip snapshot of every in-place parameter: refused at
    set-up with the bytes needed and available, naming the option that lowers it."""
    import types

    import psutil

    from fastsync.sync.engine_landing import check_staging_memory
    from fastsync.errors import ConfigError

    dest = {"model.embed_tokens.weight": torch.zeros(1000, 64)}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1000))
    with pytest.raises(ConfigError, match=r"staged=True needs 512000 bytes .* 1000 bytes are available; use staged=False"):
        check_staging_memory(0, dest, list(dest))


def test_failed_connect_leaves_no_half_set_up_receiver(rig):
    """Runs last: it drops the rig's receiver. A connect that fails after the old receiver was
    closed must leave the worker unconnected (a clear SyncError), not holding a dead receiver."""
    served = rig.engine.version()
    with pytest.raises(FastSyncError):
        rig.engine.connect("not a plan", {"control_port": rig.control.port})
    with pytest.raises(SyncError, match=r"fastsync_connect\(\) has not run"):
        rig.engine.update(rig.version + 1, 1.0)
    assert rig.engine.version() == served
