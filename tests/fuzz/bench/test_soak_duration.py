"""benchmarks/soak.py: the ``--duration`` it gives the campaign. ``--duration`` is per target and the targets take the
workers in turn, so each named target gets an equal share of the soak (a 2x H200 soak that gave each of twelve
targets the whole length ran only the first)."""

from __future__ import annotations

import importlib.util

from support import ROOT

SCRIPT = ROOT / "benchmarks" / "soak.py"


def _module():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_named_target_gets_its_share_of_the_soak():
    soak = _module()
    args = ["--baseline", "kvfuzz-baseline.toml", "--target", "a", "--target=b", "--target", "c"]
    assert soak.per_target(1296.0, args) == 432.0


def test_a_campaign_naming_no_target_gets_the_whole_soak():
    assert _module().per_target(600.0, ["--baseline", "kvfuzz-baseline.toml"]) == 600.0
