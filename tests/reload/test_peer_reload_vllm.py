"""Peer reload into REAL vLLM CPU engines started with ``load_format="dummy"`` (no checkpoint).

Mid-run: holder H1 is filled by two trainer ranks (threads with their own NIXL agents) through
WeightSync, twice (version 2 is current). H2 joins and is filled from H1 over NIXL; J joins with
H1 and H2 as holders while H2's engine process is killed before it sends: the attempt fails,
J switches to H1 and says so. A holder on another version is refused. With every holder gone, J
falls back to the checkpoint of the current version. Bit-identity: per-tensor SHA-256 of every
engine tensor's plain bytes, and greedy tokens.
"""

from __future__ import annotations

import os
import signal

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.demo.checkpoints import build_tiny_checkpoint  # noqa: E402
from fastsync.demo.run import engine_kwargs  # noqa: E402
from fastsync.errors import ConfigError, SyncError  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.trainer import fsdp_layout  # noqa: E402
from fastsync.layout.types import ParamSpec  # noqa: E402
from fastsync.reload.coordinator import PeerReload  # noqa: E402
from fastsync.sync import WeightSync  # noqa: E402
from fastsync_rigs.threads import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]
DTYPE = "bfloat16"
TIMEOUT_S = 30.0


def _llm(model_dir: str):
    from vllm import LLM

    return LLM(**engine_kwargs(model_dir, 1, DTYPE), load_format="dummy")


def _stop(llm) -> None:
    import psutil

    try:
        llm.llm_engine.engine_core.shutdown()
    except (psutil.NoSuchProcess, Exception):
        pass


def _run(fns):
    """Each trainer rank's call on its own thread; the first failure re-raised."""
    return run_ranks(fns, 120)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    import transformers

    from fastsync.engines.vllm.reload_host import VllmReloadEngine

    tmp = tmp_path_factory.mktemp("reload")
    ckpt = str(build_tiny_checkpoint("tiny-qwen3", tmp / "ckpt"))
    control = TCPStoreControl.server(port=0)
    engines = {}
    try:
        for name in ("H1", "H2", "J"):
            engines[name] = VllmReloadEngine(_llm(ckpt), name=name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
        full = {n: p.data for n, p in hf.named_parameters()}
        params = {n: ParamSpec(n, tuple(t.shape), DTYPE) for n, t in full.items()}
        layout = fsdp_layout(params, 2)
        sources = [{n: full[n][box_slices(s.box)].clone() for n, ss in layout.shards_on(r).items() for s in ss}
                   for r in range(2)]
        ws = [WeightSync(rank=r, world_size=2, control=control.with_prefix("train"), engines=[engines["H1"]] if r == 0 else [],
                         transport="nixl", timeout_s=TIMEOUT_S, layout=layout, sources=sources[r], name="train",
                         control_port=control.port) for r in range(2)]
        _run([lambda r=r: ws[r].setup() for r in range(2)])
        for version in (1, 2):  # two training steps: every weight moves
            g = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for n, t in full.items():
                    t.add_((torch.randn(t.shape, generator=g) * 0.02).to(t.dtype))
                for r in range(2):
                    for n, ss in layout.shards_on(r).items():
                        sources[r][n].copy_(full[n][box_slices(ss[0].box)])
            _run([lambda r=r, v=version: ws[r].sync(v) for r in range(2)])
        for w in ws:
            w.close()
        v2 = tmp / "v2"
        hf.save_pretrained(v2)  # the checkpoint of the current version (the fallback)
        from fastsync.reload.holders import TrainerHolder

        trainer = TrainerHolder("trainer", layout, sources, version=2)
        yield {"engines": engines, "control": control, "ckpt": ckpt, "ckpt_v2": str(v2), "trainer": trainer,
               "coord": PeerReload(control, timeout_s=TIMEOUT_S)}
    finally:
        for e in engines.values():
            _stop(e.llm)


def _digest(engine) -> dict:
    (d,) = engine.digest()
    return d["tensors"]


def test_describe_prepares_the_transport_once_per_worker(rig):
    """A joining engine pays NIXL/UCX's first initialisation and its staging arena's touch when it
    is described (engine start), once per worker process, not inside its first transfer."""
    j = rig["engines"]["J"]
    (first,) = j.describe()
    (again,) = j.describe()
    assert first["transport_warm_s"] > 0 and first["prepare_s"] >= first["transport_warm_s"], first
    assert again["transport_warm_s"] == 0.0, again  # already initialised in this worker


def test_joins_mid_run_from_a_live_peer_bit_identical(rig):
    e, coord = rig["engines"], rig["coord"]
    assert e["H1"].version() == 2
    rep = coord.reload(e["H2"], [e["H1"]], 2)
    assert rep.source == "peer" and rep.holders == ["H1"], rep.to_json()
    assert e["H2"].version() == 2
    assert _digest(e["H2"]) == _digest(e["H1"])
    assert e["H2"].generate(PROMPTS, 6) == e["H1"].generate(PROMPTS, 6)
    reg = rep.registration["joiner"][0]
    # staged weights in one arena + the in-place tensors (embedding, norms), not one per parameter
    assert 0 < reg["regions"] < 20 and reg["seconds"] >= 0, reg
    # H2's first describe (inside this reload) initialised NIXL: the receiver's agent was a warm one
    assert 0 <= reg["agent_seconds"] < rep.weights_s, reg
    # the same layouts again: the plan comes from the cache
    rep2 = coord.reload(e["J"], [e["H1"]], 2)
    assert rep2.plan_cached and rep2.source == "peer"
    assert _digest(e["J"]) == _digest(e["H1"])


def test_holder_on_another_version_is_refused(rig):
    e, coord = rig["engines"], rig["coord"]
    with pytest.raises(SyncError, match="no checkpoint"):
        coord.reload(e["J"], [e["H1"]], 1)
    assert e["J"].version() == 2  # untouched


def test_engines_joining_together_are_filled_through_a_chain(rig):
    """``reload_group``: H2 and J join at once from H1 alone as one chain: H1 writes H2, which
    forwards each write batch to J as it lands. Both end bit-identical to H1, and H1 sent one
    copy of the weights, not one per joining engine."""
    e, coord = rig["engines"], rig["coord"]
    with pytest.raises(ConfigError, match="fanout"):
        coord.reload_group([e["H2"], e["J"]], [e["H1"]], 2, fanout="ring")
    for name in ("H2", "J"):  # the checkpoint's weights (version 0): the reload must move every byte
        e[name].load_checkpoint(rig["ckpt"], 0)
        assert _digest(e[name]) != _digest(e["H1"])
    rep = coord.reload_group([e["H2"], e["J"]], [e["H1"]], 2, fanout="chain", max_transfer_bytes=256 << 10)
    assert rep.source == "peer" and rep.holders == ["H1"], rep.to_json()
    assert rep.fanout == {"mode": "chain", "replicas": 2, "roots": 1, "depth": 1, "relayed": True}, rep.fanout
    for name in ("H2", "J"):
        assert e[name].version() == 2 and _digest(e[name]) == _digest(e["H1"]), name
    assert e["J"].generate(PROMPTS, 6) == e["H1"].generate(PROMPTS, 6)
    (w,) = rep.attempts[-1]["workers_of"]["J"]
    one_copy = w["staged_bytes"] + w["inplace_bytes"]
    assert one_copy * 0.9 < rep.attempts[-1]["sent_bytes"]["H1"] < one_copy * 1.1, (rep.attempts[-1], one_copy)


def test_peer_killed_mid_reload_switches_holder_then_checkpoint(rig):
    from fastsync.engines.vllm.reload_host import engine_pids

    e, coord = rig["engines"], rig["coord"]
    if e["H2"].version() != 2:  # run alone: H2 becomes a holder first
        coord.reload(e["H2"], [e["H1"]], 2)
    killed = []

    def kill_h2(attempt, chosen):
        if attempt == 1 and any(h.name == "H2" for h in chosen):
            for pid in engine_pids(e["H2"].llm):
                os.kill(pid, signal.SIGKILL)
            killed.append(attempt)

    rep = coord.reload(e["J"], [e["H1"], e["H2"]], 2, on_attempt=kill_h2)
    assert killed == [1]
    assert rep.source == "peer" and rep.holders == ["H1"], rep.to_json()
    assert not rep.attempts[0]["ok"] and "H2" in rep.attempts[0]["holder_errors"], rep.attempts[0]
    assert rep.attempts[-1]["ok"]
    assert _digest(e["J"]) == _digest(e["H1"])
    # every holder gone (H2 dead, H1 on another version than asked): the checkpoint of the version
    rep = coord.reload(e["J"], [e["H2"]], 2, checkpoint=rig["ckpt_v2"])
    assert rep.source == "checkpoint" and "H2" in rep.refused, rep.to_json()
    assert _digest(e["J"]) == _digest(e["H1"])
    assert e["J"].generate(PROMPTS, 6) == e["H1"].generate(PROMPTS, 6)


def test_trainer_ranks_as_holders(rig):
    e, coord = rig["engines"], rig["coord"]
    rep = coord.reload(e["J"], [rig["trainer"]], 2)
    assert rep.source == "peer" and rep.holders == ["trainer"], rep.to_json()
    assert _digest(e["J"]) == _digest(e["H1"])  # the trainer's shards, as the synced holder holds them
