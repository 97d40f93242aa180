"""The sync matrix through ``WeightSync`` with live vLLM engines: two real vLLM CPU engines of one
awkward tiny Qwen3 (vocab 500 padded to 512, hidden 96, 3 query heads over 1 KV head), started
once for the module, two FSDP-sharded trainer ranks (threads, NIXL). Each cell ends with every
engine tensor's bytes equal to the trainer's (SHA-256 of the plain copy) and both engines'
greedy tokens equal to the HF trainer model's. Cells: see ``matrix_support``."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engines"))
from matrix_support import FANOUT, assert_digest, cell_id, cell_params, first_version, reference_digest, sparse_step  # noqa: E402
from wt_support import build_awkward_qwen3  # noqa: E402

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.demo.run import engine_kwargs, hf_greedy  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.trainer import fsdp_layout  # noqa: E402
from fastsync.layout.types import ParamSpec  # noqa: E402
from fastsync.sync import WeightSync  # noqa: E402
from fastsync_rigs.threads import run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.own_process]  # engines in-process, in a child pytest (tests/support/own_process.py)

PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    import transformers
    from vllm import LLM

    from fastsync.engines.vllm.handle import VllmEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # two engines on one host: no shared pinning
        d = build_awkward_qwen3(tmp_path_factory.mktemp("ckpt") / "awkward-qwen3")
        llms = [LLM(**engine_kwargs(d, 1, "float32")) for _ in range(2)]
    engines = [VllmEngine(x) for x in llms]
    described = engines[0].describe()[0]["tensors"]  # the replicas are identical: one layout serves both
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    yield {"llms": llms, "engines": engines, "hf": hf, "described": described,
           "control": TCPStoreControl.server(port=0)}
    for x in llms:
        x.collective_rpc("fastsync_close")
        x.llm_engine.engine_core.shutdown()


def _check_engines(two, full, version: int, what: str) -> None:
    from fastsync.host.replies import raise_worker_errors

    want_bytes = reference_digest(full, two["described"])
    want_tokens = hf_greedy(two["hf"], PROMPTS, 6)
    for i, (llm, e) in enumerate(zip(two["llms"], two["engines"])):
        got = raise_worker_errors(llm.collective_rpc("fastsync_digest"), "digest")[0]
        assert got["version"] == version, (what, i, got["version"])
        assert_digest(got["tensors"], want_bytes, f"{what}, engine {i}")
        assert e.generate(PROMPTS, 6) == want_tokens, f"{what}, engine {i}: tokens differ from the trainer's"


class _Trainers:
    """Two FSDP-sharded trainer ranks (threads) of the HF model with one ``WeightSync`` each, set up
    against the module's two live engines."""

    def __init__(self, two: dict, name: str, **options) -> None:
        self.full = {n: p.data for n, p in two["hf"].named_parameters()}
        self.layout = fsdp_layout({n: ParamSpec(n, tuple(t.shape), "float32") for n, t in self.full.items()}, 2)
        self.sources = self._shards()
        control = two["control"]
        self.ws = [WeightSync(rank=r, world_size=2, control=control.with_prefix(name),
                              engines=two["engines"] if r == 0 else [], transport="nixl", timeout_s=60,
                              layout=self.layout, sources=self.sources[r], name=name, control_port=control.port,
                              **options) for r in range(2)]
        try:
            run_ranks([lambda r=r: self.ws[r].setup() for r in range(2)], 300)
        except BaseException:
            self.close()
            raise

    def _shards(self) -> list[dict]:
        return [{n: self.full[n][box_slices(ss[0].box)].clone() for n, ss in self.layout.shards_on(r).items()}
                for r in range(2)]

    def sync(self, version: int, frac: float) -> None:
        """Change ``frac`` of the weights, sync ``version`` from both ranks."""
        sparse_step(self.full, version, frac)
        for r, fresh in enumerate(self._shards()):
            for n, t in fresh.items():
                self.sources[r][n].copy_(t)
        run_ranks([lambda r=r: self.ws[r].sync(version) for r in range(2)], 120)

    def close(self) -> None:
        for w in self.ws:
            w.close()


@pytest.mark.parametrize("cell", cell_params())
def test_weight_sync_matrix(two, cell):
    payload, route = cell
    name = cell_id(cell)
    tr = None
    try:
        tr = _Trainers(two, name, fanout=FANOUT[route], delta=payload == "delta")
        ws = tr.ws
        plan = ws[0].plan
        assert plan.fanout is not None and plan.fanout.replicas == 2 and plan.num_receivers == 2
        assert plan.has_relays == (route == "relayed")
        version = first_version(cell)
        steps = [(version, 0.5)] + ([(version + 1, 0.03)] if payload == "delta" else [])
        for v, frac in steps:
            tr.sync(v, frac)
            kind = "delta" if payload == "delta" and v > version else "dense"
            if payload == "delta":  # trainer rank 0's choice: dense first, then a delta
                assert ws[0].last_kind == kind
            _check_engines(two, tr.full, v, f"{name} version {v} ({kind})")
        links = ws[0].sender.last_metrics.bytes_per_link
        if route == "relayed":  # the trainer ranks wrote the first replica only; a relay fed the second
            assert set(links) == {"t0->r0"}, links
        else:
            assert set(links) >= {"t0->r0", "t0->r1"}, links
        if payload == "delta":
            st = ws[0].sender.last_stats
            assert st["mode"] == "delta" and 0 < st["bytes_sent"] < 0.2 * st["bytes_dense"], st
    finally:
        if tr is not None:
            tr.close()


def test_auto_fanout_with_delta_plans_once_and_writes_every_replica_direct(two):
    """``WeightSync(delta=True, fanout="auto")`` into the same two live engines, after the cells:
    ``auto`` plans copies direct when each trainer rank can feed both one-rank replicas (relayed
    deltas are the cells above); the first sync dense, then a sparse step as a delta stream to each
    replica's rank, both engines' bytes and tokens the trainer's after each."""
    tr = None
    try:
        tr = _Trainers(two, "auto", fanout="auto", delta=True)
        ws = tr.ws
        plan = ws[0].plan
        assert plan.fanout is not None and plan.fanout.replicas == 2 and not plan.has_relays
        version = 10 * (len(cell_params()) + 1)  # above every cell's block
        for v, frac, kind in ((version, 0.5, "dense"), (version + 1, 0.03, "delta")):
            tr.sync(v, frac)
            assert ws[0].last_kind == kind
            _check_engines(two, tr.full, v, f"auto version {v} ({kind})")
        for w in ws:
            st = w.sender.last_stats
            assert st["mode"] == "delta" and 0 < st["bytes_sent"] < 0.2 * st["bytes_dense"], st
            links = w.sender.last_metrics.bytes_per_link
            assert set(links) >= {f"t{w.rank}->r0", f"t{w.rank}->r1"}, links  # both replicas, direct
    finally:
        if tr is not None:
            tr.close()
