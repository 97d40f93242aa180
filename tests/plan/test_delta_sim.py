"""``fastsync plan --delta-fraction``: the predicted delta bytes follow the real encoder's sizes,
and the CLI prices the delta plan with the same simulator."""

from __future__ import annotations

import json

import pytest
import torch

from fastsync.cli import main
from fastsync.errors import ConfigError
from fastsync.executor.delta import HEADER_BYTES, encode_transfer, encode_chunk, block_ids
from fastsync.plan.delta_sim import delta_plan, delta_transfer_bytes
from fastsync.plan.types import Plan, Transfer


def _t(n_rows: int, n_cols: int, transform: str = "copy", size: int = 2) -> Transfer:
    box = ((0, n_rows), (0, n_cols))
    return Transfer(0, 0, "w", box, "p", box, transform, n_rows * n_cols * size)


@pytest.mark.parametrize("fraction", [0.001, 0.03, 0.2, 0.9])
def test_predicted_bytes_track_the_encoder(fraction: float) -> None:
    t = _t(301, 1777)  # 534,877 bf16 elements: 9 chunks, the last partial
    n = 301 * 1777
    g = torch.Generator().manual_seed(5)
    old = torch.randint(-30000, 30000, (n,), generator=g, dtype=torch.int16)
    new = old.clone()
    mask = torch.rand(n, generator=g) < fraction
    new[mask] += 1
    buf = torch.zeros(2 * n + 64 * 20, dtype=torch.uint8)
    pos, _, _ = encode_transfer(buf, 0, 0, new, old, 1 << 16)
    predicted = delta_transfer_bytes(t, fraction)
    assert abs(predicted - pos) <= 0.03 * pos + 2 * HEADER_BYTES, (predicted, pos)


def test_fp8_block_prediction_reads_the_fraction_as_blocks() -> None:
    t = _t(256, 384, "fp8_block", size=1)  # 6 blocks
    w_old = torch.zeros(256 * 384, dtype=torch.uint8)
    w_new = w_old.clone()
    w_new[5] = 1  # one element: its whole block (1 of 6) is sent
    buf = torch.zeros(256 * 384 + 256, dtype=torch.uint8)
    pos, _ = encode_chunk(buf, 0, 0, 0, w_new, w_old, blocks=block_ids((256, 384)))
    assert abs(delta_transfer_bytes(t, 1 / 6) - pos) <= 16


def test_delta_plan_keeps_endpoints_and_refuses_bad_fractions() -> None:
    plan = Plan([_t(100, 70), _t(3, 5)], {}, "a", "b", 1, 1)
    d = delta_plan(plan, 0.0)
    assert [t.dst_box for t in d.transfers] == [t.dst_box for t in plan.transfers]
    assert d.bytes_total == HEADER_BYTES  # nothing changed: one stream header
    assert delta_plan(plan, 1.0).bytes_total >= plan.bytes_total
    with pytest.raises(ConfigError, match="delta fraction"):
        delta_plan(plan, 1.5)


def test_plan_cli_reports_the_delta_sync(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "qwen3-30b-a3b", "--trainer", "fsdp:8", "--rollout", "vllm:tp4,replicas2",
            "--nic-gbps", "400", "--delta-fraction", "0.03", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    d = r["delta"]
    assert d["fraction"] == 0.03 and 0 < d["bytes_total"] < 0.1 * r["bytes_total"]
    assert 0 < d["predicted_seconds"] < r["predicted_seconds"]
    assert main(args[:-3] + ["--delta-fraction", "2"]) == 2
