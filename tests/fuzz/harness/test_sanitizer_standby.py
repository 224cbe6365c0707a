"""fuzz/harness/sanitizer_standby.py: a hit of the long-lived sanitized child is confirmed in a standby child
started beside it, which has run no example (a child carrying a prior example's state would report it too), and a
new standby starts after it; a standby that died, hung or whose warm-up was not clean is counted, ended, replaced,
and a fresh child confirms instead; after MAX_LOST in a row the worker gives up on standbys; with
KVFUZZ_SANITIZE_STANDBY=0 every confirmation is a fresh child, as before. Through real children under the planted
compute-sanitizer of tests/support/planted_memcheck.py, on CPU."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

import pytest
from hypothesis.database import InMemoryExampleDatabase
from support import SUPPORT

from kvfuzz.contracts.checks.failures import MemorySafetyError
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness import sanitizer, sanitizer_standby
from kvfuzz.fuzz.harness.sanitizer import SanitizedChild
from kvfuzz.fuzz.harness.sanitizer_standby import MAX_LOST, Standby, StandbyConfirmer
from kvfuzz.fuzz.targets.registry import get_target, spec_of


def _sanitizer(tmp: Path, text_name: str = "FAKE_SANITIZER") -> str:
    """A planted compute-sanitizer of tests/support/planted_memcheck.py (it runs its program, a real child)."""
    from support import planted_memcheck

    exe = tmp / "compute-sanitizer"
    exe.write_text(getattr(planted_memcheck, text_name).format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def _planted(name: str):
    return get_target(f"{SUPPORT / 'planted_memcheck.py'}:{name}")


def _example(seq_len: int) -> Example:
    """One decode after ``seq_len - 1`` cached tokens: the planted overrun reads past its table at an even seq_len."""
    return Example(small_batch([1], [seq_len - 1], head_size=32, block_size=16), Poison.NAN)


def test_a_hit_is_confirmed_in_the_pre_started_standby_that_has_run_no_example(tmp_path):
    """The standby starts with the long-lived child. The long-lived child's hit carries a stale access of its earlier
    example (planted CarriesState); the standby's report has only the hit's own, its ERROR SUMMARY counts 1, and the
    example ran under the standby's process. A new standby starts after it; the next stale report of the long-lived
    child is overruled by the new standby's clean run."""
    exe, target = _sanitizer(tmp_path), _planted("CarriesState")
    confirmer = StandbyConfirmer(spec_of(target), exe, timeout=120)
    child = SanitizedChild(spec_of(target), exe, timeout=120, confirmer=confirmer)
    try:
        child.check(target, _example(3))  # the long-lived child's first example: clean; the standby started with it
        standby = confirmer.standby
        assert standby is not None and standby.running and child.last.get("confirm") is None
        pid = standby._proc.pid  # the planted compute-sanitizer that runs it
        with pytest.raises(MemorySafetyError) as info:
            child.check(target, _example(4))
        report = info.value.details["report"]
        assert child.last["confirm"] == "standby" and f"planted: run under {pid}" in report
        assert "half_tile.py:7" in info.value.message and "stale.py" not in report
        assert info.value.details["error_count"] == 1 and "ERROR SUMMARY: 1 error" in report
        assert not standby.running and confirmer.standby is not standby and confirmer.standby.running
        child.check(target, _example(5))  # the long-lived child reports its stale access: the new standby clears it
        assert child.last["confirm"] == "standby" and confirmer.lost == 0
    finally:
        child.close()
        confirmer.close()
    assert confirmer.standby is None and not standby.running


@pytest.mark.parametrize("fault", ["died", "hung"])
def test_a_standby_that_died_or_hung_is_replaced_and_a_fresh_child_confirms(tmp_path, fault):
    """A standby killed before use (died) or stuck in its start (hung: no ready marker within start_timeout) is
    counted, ended and replaced; the hit is still confirmed, by a fresh child's whole report. After MAX_LOST lost
    in a row no standby starts and confirmations are fresh ("given up")."""
    exe = _sanitizer(tmp_path, "FAKE_SANITIZER" if fault == "died" else "HANGING_STANDBY")
    target = _planted("HalfTileOverrun")
    confirmer = StandbyConfirmer(spec_of(target), exe, timeout=120, start_timeout=120 if fault == "died" else 1)
    child = SanitizedChild(spec_of(target), exe, timeout=120, confirmer=confirmer)
    try:
        child.check(target, _example(3))
        lost = confirmer.standby
        if fault == "died":
            lost._proc.kill()
            lost._proc.wait()
        with pytest.raises(MemorySafetyError) as info:
            child.check(target, _example(4))
        assert child.last["confirm"] == f"fresh: standby {fault}" and confirmer.lost == 1
        assert "half_tile.py:7" in info.value.message and "ERROR SUMMARY: 1 error" in info.value.details["report"]
        assert not lost.running and confirmer.standby is not lost and confirmer.standby.running  # replaced
        confirmer.lost = MAX_LOST - 1
        confirmer.standby.close(kill=True)  # the last one allowed: lost too (died)
        with pytest.raises(MemorySafetyError):
            child.check(target, _example(6))
        assert child.last["confirm"] == "fresh: standby died" and confirmer.standby is None  # none started
        with pytest.raises(MemorySafetyError):
            child.check(target, _example(8))
        assert child.last["confirm"] == "fresh: standby given up" and confirmer.standby is None
    finally:
        child.close()
        confirmer.close()


def test_a_standby_that_cannot_be_started_is_one_lost_and_the_long_lived_child_goes_on(tmp_path):
    """No process to be had for the standby (here: its compute-sanitizer is missing): counted as lost, none kept,
    the long-lived child it starts beside still serves, and a hit is confirmed in a fresh child ("not started")."""
    exe, target = _sanitizer(tmp_path), _planted("HalfTileOverrun")
    confirmer = StandbyConfirmer(spec_of(target), str(tmp_path / "no-such-compute-sanitizer"))
    child = SanitizedChild(spec_of(target), exe, timeout=120, confirmer=confirmer)
    try:
        child.check(target, _example(3))
        # tried with the long-lived child's start and again once it was ready: two lost, none kept
        assert confirmer.standby is None and confirmer.lost == 2 and child.running
        confirmer.exe = exe  # the fresh child's compute-sanitizer (the same as the long-lived child's in a campaign)
        with pytest.raises(MemorySafetyError):
            child.check(target, _example(4))
        assert child.last["confirm"] == "fresh: standby not started" and confirmer.standby.running  # started now
    finally:
        child.close()
        confirmer.close()


def test_with_after_ready_the_standby_starts_once_the_long_lived_child_is_ready(tmp_path):
    """KVFUZZ_SANITIZE_STANDBY=ready: no standby while the long-lived child starts (their starts do not share the
    host), one as soon as its ready marker is read; a hit is then confirmed in it."""
    exe, target = _sanitizer(tmp_path), _planted("HalfTileOverrun")
    confirmer = StandbyConfirmer(spec_of(target), exe, timeout=120, after_ready=True)
    child = SanitizedChild(spec_of(target), exe, timeout=120, confirmer=confirmer)
    try:
        assert not child.ready() and child.running and confirmer.standby is None
        while not child.ready():
            assert child.running and confirmer.standby is None
            time.sleep(0.05)
        assert confirmer.standby is not None and confirmer.standby.running
        with pytest.raises(MemorySafetyError):
            child.check(target, _example(4))
        assert child.last["confirm"] == "standby"
    finally:
        child.close()
        confirmer.close()


def test_a_standby_whose_warm_up_reported_an_error_is_not_used(tmp_path, monkeypatch):
    """Its ERROR SUMMARY would count the warm-up's errors: a standby that printed an invalid access before its
    ready marker (planted WarmUpWatch, KVFUZZ_PLANTED_WARM=access) is "not clean"; one whose warm-up was clean
    decides a clean example (None)."""
    exe, target = _sanitizer(tmp_path), _planted("WarmUpWatch")
    example = Example(small_batch([1], [3], head_size=64, block_size=16), Poison.NAN)  # not the warm-up's head size
    assert target.capabilities.head_sizes[0] != 64
    clean = Standby(spec_of(target), exe, timeout=120)
    clean.start()
    assert clean.run_once(example, 120) is None and not clean.running
    monkeypatch.setenv("KVFUZZ_PLANTED_WARM", "access")
    dirty = Standby(spec_of(target), exe, timeout=120)
    dirty.start()
    assert dirty.run_once(example, 120) == "not clean" and not dirty.running


@pytest.mark.parametrize("standby", ["1", "0"])
def test_a_campaign_confirms_in_the_standby_and_with_it_off_in_a_fresh_child(tmp_path, monkeypatch, standby):
    """The same planted overrun is found and shrunk either way; summary.json's time.sanitize says where its hit was
    confirmed: the standby, or (KVFUZZ_SANITIZE_STANDBY=0, the behaviour before it) a fresh child."""
    monkeypatch.setenv(sanitizer.ENV, _sanitizer(tmp_path))
    monkeypatch.setenv(sanitizer_standby.ENV, standby)
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)  # the stand-in runs on CPU
    assert (sanitizer_standby.screen("x").confirmer is None) == (standby == "0")
    monkeypatch.delenv(sanitizer_standby.ENV)
    assert not sanitizer_standby.screen("x").confirmer.after_ready  # on by default since measured on a GPU
    monkeypatch.setenv(sanitizer_standby.ENV, "yes")
    with pytest.raises(ValueError, match="KVFUZZ_SANITIZE_STANDBY='yes'"):
        sanitizer_standby.screen("x")
    monkeypatch.setenv(sanitizer_standby.ENV, "ready")
    assert sanitizer_standby.screen("x").confirmer.after_ready
    monkeypatch.setenv(sanitizer_standby.ENV, standby)
    config = CampaignConfig(out=tmp_path / "out", max_examples=30, duration=300, seed=0,
                            database=InMemoryExampleDatabase(), stop_at_first_failure=True, sanitize=1.0)
    stats = fuzz_target(_planted("HalfTileOverrun"), config)
    (rec,) = stats.failures.values()
    assert rec.kind == "memory safety" and "half_tile.py:7" in rec.message
    assert Example.from_dict(rec.example).batch.seq_lens == (2,)  # shrunk to the smallest even seq_len
    assert stats.stages.sanitize.to_dict()["confirms"] == {"standby" if standby == "1" else "fresh": 1}
