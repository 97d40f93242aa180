"""WeightSync(fanout=...) into two live vLLM engines of one model (identical replicas): planned
once, the second fed by relays between the engines' ranks (``chain``) or straight from the trainer
ranks (``direct``); after each sync both engines generate like the trainer. Two real vLLM CPU
engines, started once for the module."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.demo.checkpoints import build_tiny_checkpoint  # noqa: E402
from fastsync.demo.run import engine_kwargs, hf_greedy  # noqa: E402
from fastsync.errors import ConfigError  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.trainer import fsdp_layout  # noqa: E402
from fastsync.layout.types import ParamSpec  # noqa: E402
from fastsync.sync import WeightSync  # noqa: E402
from fastsync_rigs.threads import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    import transformers
    from vllm import LLM

    from fastsync.engines.vllm.host import VllmEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # two engines on one host: no shared pinning
        d = str(build_tiny_checkpoint("tiny-qwen3", tmp_path_factory.mktemp("ckpt") / "tiny-qwen3"))
        llms = [LLM(**engine_kwargs(d, 1, "float32")) for _ in range(2)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    yield {"llms": llms, "engines": [VllmEngine(x) for x in llms], "hf": hf, "control": TCPStoreControl.server(port=0)}
    for x in llms:
        x.collective_rpc("fastsync_close")
        x.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("fanout", ["chain", "direct"])
def test_replicas_planned_once_and_fed_as_asked(two, fanout):
    hf, control = two["hf"], two["control"]
    full = {n: p.data for n, p in hf.named_parameters()}
    params = {n: ParamSpec(n, tuple(t.shape), "float32") for n, t in full.items()}
    layout = fsdp_layout(params, 2)
    g = torch.Generator().manual_seed(len(fanout))
    with torch.no_grad():
        for t in full.values():
            t.add_(torch.randn(t.shape, generator=g) * 0.05 * (t.std() + 1e-3))
    sources = [{n: full[n][box_slices(s.box)].clone() for n, ss in layout.shards_on(r).items() for s in ss}
               for r in range(2)]
    ws = [WeightSync(rank=r, world_size=2, control=control.with_prefix(fanout), engines=two["engines"] if r == 0 else [],
                     transport="nixl", timeout_s=60, layout=layout, sources=sources[r], name=fanout,
                     control_port=control.port, fanout=fanout) for r in range(2)]
    try:
        run_ranks([lambda r=r: ws[r].setup() for r in range(2)], 300)
        plan = ws[0].plan
        assert plan.fanout is not None and plan.fanout.replicas == 2 and plan.num_receivers == 2
        assert plan.has_relays == (fanout == "chain")
        version = 1 + (fanout == "direct") * 10
        run_ranks([lambda r=r: ws[r].sync(version) for r in range(2)], 120)
        want = hf_greedy(hf, PROMPTS, 6)
        for e in two["engines"]:
            assert e.generate(PROMPTS, 6) == want and e.version() == version
        if fanout == "chain":  # the trainer ranks wrote the first engine only
            links = ws[0].sender.last_metrics.bytes_per_link
            assert set(links) == {"t0->r0"}, links
    finally:
        for w in ws:
            w.close()


def test_relays_need_nixl():
    with pytest.raises(ConfigError, match="fanout='chain' may relay between engine ranks, which only transport 'nixl'"):
        WeightSync(torch.nn.Linear(2, 2), rank=0, world_size=1, control=object(), transport="torch",  # type: ignore[arg-type]
                   fanout="chain")


def test_delta_reaches_every_replica_direct(two):
    """WeightSync(delta=True, fanout="auto") into the two live engines: planned once, copies direct
    (auto's choice when each trainer rank can feed both one-rank replicas; deltas down a relay chain
    are the matrix's delta-chain cells); the first sync dense, then a sparse step sent as a delta stream to
    each replica's rank, both engines generating like the trainer after each."""
    hf, control = two["hf"], two["control"]
    full = {n: p.data for n, p in hf.named_parameters()}
    params = {n: ParamSpec(n, tuple(t.shape), "float32") for n, t in full.items()}
    layout = fsdp_layout(params, 2)
    sources = [{n: full[n][box_slices(s.box)].clone() for n, ss in layout.shards_on(r).items() for s in ss}
               for r in range(2)]

    def step(seed: int, frac: float) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, t in full.items():
                mask = torch.rand(t.shape, generator=g) < frac
                t[mask] += torch.randn(int(mask.sum()), generator=g, dtype=t.dtype) * 0.3 * (t.std() + 1e-3)
            for r in range(2):
                for n, ss in layout.shards_on(r).items():
                    sources[r][n].copy_(full[n][box_slices(ss[0].box)])

    ws = [WeightSync(rank=r, world_size=2, control=control.with_prefix("delta-fanout"),
                     engines=two["engines"] if r == 0 else [], transport="nixl", timeout_s=60, layout=layout,
                     sources=sources[r], name="delta-fanout", control_port=control.port, fanout="auto", delta=True)
          for r in range(2)]
    try:
        run_ranks([lambda r=r: ws[r].setup() for r in range(2)], 300)
        plan = ws[0].plan
        assert plan.fanout is not None and plan.fanout.replicas == 2 and not plan.has_relays
        for version, kind in ((21, "dense"), (22, "delta")):
            step(version, 0.5 if kind == "dense" else 0.03)
            run_ranks([lambda r=r: ws[r].sync(version) for r in range(2)], 120)
            assert ws[0].last_kind == kind
            want = hf_greedy(hf, PROMPTS, 6)
            for e in two["engines"]:
                assert e.generate(PROMPTS, 6) == want and e.version() == version
        for w in ws:
            st = w.sender.last_stats
            assert st["mode"] == "delta" and 0 < st["bytes_sent"] < 0.2 * st["bytes_dense"], st
            links = w.sender.last_metrics.bytes_per_link
            assert {d for d in links} >= {f"t{w.rank}->r0", f"t{w.rank}->r1"}, links  # both replicas, direct
    finally:
        for w in ws:
            w.close()
