"""docs/reference/configuration.md is what scripts/gen_config_ref.py makes of the option classes
today (issue 41): a new option of any door, or a new FASTSYNC_* variable, fails here until the
generator knows its meaning and the page is regenerated."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_ref", ROOT / "scripts" / "gen_config_ref.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


GEN = _gen()


def test_committed_page_is_what_the_code_generates() -> None:
    page = GEN.OUT.read_text()
    assert page == GEN.render(), "docs/reference/configuration.md is stale: run python scripts/gen_config_ref.py"


def test_every_door_is_on_the_page() -> None:
    page = GEN.OUT.read_text()
    for must in ("`delta`", "`engine_kwargs.fastsync.inplace`", "`--fastsync.fanout`", "`pause_mode`",
                 "`control_port`", "`FASTSYNC_NET_DEVICES`", "`FASTSYNC_JOB_SECRET`"):
        assert must in page, must


def test_an_option_without_a_meaning_stops_the_generator() -> None:
    with pytest.raises(SystemExit, match="new_option"):
        GEN._rows("WeightSync", [("delta", "bool", "False"), ("new_option", "int", "0")], {"delta": "d"})
    with pytest.raises(SystemExit, match="gone"):
        GEN._rows("WeightSync", [("delta", "bool", "False")], {"delta": "d", "gone": "g"})


def test_every_environment_variable_the_code_reads_has_an_entry() -> None:
    assert GEN.env_names() <= set(GEN.ENV)
