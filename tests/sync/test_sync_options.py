"""One check of the sync options for every entry point (``fastsync.sync.sync_options``), each
refusal in the spelling of the entry point's users."""

from __future__ import annotations

import pytest

from fastsync.errors import ConfigError
from fastsync.sync.sync_options import PYTHON, Spelling, check_sync_options

VERL = Spelling(prefix="engine_kwargs.fastsync.", true="true", false="false")
CLI = Spelling(prefix="--fastsync.", cli=True)


@pytest.mark.parametrize("spell, kw, message", [
    (PYTHON, dict(delta="yes"), "delta must be True or False, got 'yes'"),
    (VERL, dict(delta="yes"), "engine_kwargs.fastsync.delta must be true or false, got 'yes'"),
    (VERL, dict(staged=1), "engine_kwargs.fastsync.staged must be true or false, got 1"),
    (PYTHON, dict(timeout_s=0), "timeout_s must be above 0, got 0"),
    (CLI, dict(timeout_s=True), "--fastsync.timeout_s must be a number, got True"),
    (CLI, dict(timeout_s=float("inf")), "--fastsync.timeout_s must be a finite number, got inf"),
    (PYTHON, dict(timeout_s=86401), "timeout_s = 86401 is over the limit 86400"),
    (CLI, dict(fanout="ring"), "--fastsync.fanout must be one of off, auto, chain, direct, got 'ring'"),
    (PYTHON, dict(delta=True, transport="torch"), "delta=True writes over NIXL; transport='torch' does not support"),
    (CLI, dict(delta=True, transport="torch"), "--fastsync.delta writes over NIXL; --fastsync.transport torch does"),
    (PYTHON, dict(fanout="chain", transport="torch"),
     "fanout='chain' may relay between engine ranks, which only transport 'nixl' does; transport='torch'"),
    (VERL, dict(staged=True, delta=True),
     "engine_kwargs.fastsync.staged=true with engine_kwargs.fastsync.delta=true: a delta patches the live weights"),
])
def test_each_refusal_names_the_option_as_its_users_write_it(spell: Spelling, kw: dict, message: str) -> None:
    args = dict(transport="nixl", timeout_s=60.0, **{k: v for k, v in kw.items() if k not in ("transport", "timeout_s")})
    args.update({k: kw[k] for k in ("transport", "timeout_s") if k in kw})
    with pytest.raises(ConfigError) as e:
        check_sync_options(spell, **args)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("kw", [dict(), dict(delta=True, fanout="chain"), dict(delta=True, fanout="auto"),
                                dict(staged=True, fanout="direct"), dict(transport="torch", fanout="direct")])
def test_what_goes_together_passes(kw: dict) -> None:
    check_sync_options(PYTHON, **{"transport": "nixl", "timeout_s": 1, **kw})


def test_weight_sync_refuses_relays_without_nixl_before_anything_starts() -> None:
    """``WeightSync`` runs the same check at construction: no control plane is touched."""
    torch = pytest.importorskip("torch")
    from fastsync.sync import WeightSync

    with pytest.raises(ConfigError, match="fanout='chain' may relay between engine ranks, which only transport 'nixl'"):
        WeightSync(torch.nn.Linear(2, 2), rank=0, world_size=1, control=object(), transport="torch",  # type: ignore[arg-type]
                   fanout="chain")
