"""benchmarks/soak.py: the ``--duration`` it gives the campaign. ``--duration`` is per target and the targets take the
workers in turn, so each named target gets an equal share of the soak (a 2x H200 soak that gave each of twelve
targets the whole length ran only the first)."""

from __future__ import annotations

from support import benchmark_script


def _module():
    return benchmark_script("soak")


def test_each_named_target_gets_its_share_of_the_soak():
    soak = _module()
    args = ["--baseline", "kvfuzz-baseline.toml", "--target", "a", "--target=b", "--target", "c"]
    assert soak.per_target(1296.0, args) == 432.0


def test_a_campaign_naming_no_target_gets_the_whole_soak():
    assert _module().per_target(600.0, ["--baseline", "kvfuzz-baseline.toml"]) == 600.0
