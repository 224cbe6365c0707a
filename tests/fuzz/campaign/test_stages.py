"""Where a campaign's time goes (kvfuzz.fuzz.campaign.stages, the runner's accounting, the supervisor's workers'
wall time): summary.json's ``time`` table has every stage and every tier the campaign ran, its seconds add up to
the workers' wall time, and a compile during the kernel call is a compile, not kernel time."""

import json
import os
import tempfile
import time
from pathlib import Path

from support import SUPPORT, kvfuzz
from support.planted_targets import DecodeMissesOwnToken

from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.campaign.stages import STAGES, WORKER_STAGES, StageTable, time_line, time_table
from kvfuzz.fuzz.campaign.store.report import time_section

#: How far the table's rows may be from the workers' wall time: its figures are rounded to the millisecond.
TOLERANCE_S = 0.05


def test_a_campaign_accounts_for_every_worker_second_and_tells_a_compile_from_the_kernel(tmp_path):
    """Two workers, the small and wide tiers, a kernel whose first call in each process sleeps 2 s inside Triton's
    JIT hooks: the table lists every stage, a row per tier with its examples and mean milliseconds, rows that add up
    to the workers' wall time, and the sleeps as compile, not kernel (neither the table's kernel nor the target's
    kernel_s holds them)."""
    log = tmp_path / "compiles.log"
    env = dict(os.environ, KVFUZZ_PLANTED_LOG=str(log), KVFUZZ_PLANTED_COMPILE_S="2")
    began = time.monotonic()
    # the fixed split (--steer off) runs a wide chunk second; a steered one may aim both chunks at small-tier bins
    r = kvfuzz("fuzz", "--target", f"{SUPPORT / 'planted_targets.py'}:CompilesOnFirstCall", "--tier", "small",
               "--tier", "wide", "--steer", "off", "--max-examples", "40", "--workers", "2", "--out", tmp_path / "out",
               env=env)
    lasted = time.monotonic() - began
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    table = summary["time"]
    assert table["stages"] == list(STAGES + WORKER_STAGES) and table["workers"] == 2
    rows = {row["tier"]: row for row in table["rows"]}
    assert set(rows) == {"small", "wide"} and sum(row["examples"] for row in rows.values()) == 40
    for row in rows.values():
        assert row["examples"] > 0 and {"draw", "kernel", "reference"} <= set(row["ms"]) <= set(STAGES)
        assert abs(sum(row["ms"].values()) * row["examples"] / 1000 - row["seconds"]) <= TOLERANCE_S
    # every second of the workers' wall time in one row: the targets' rows, start-up and idle
    wall, seconds = table["wall_s"], table["seconds"]
    assert 0 < wall <= 2 * lasted
    assert abs(sum(seconds.values()) - wall) <= TOLERANCE_S
    assert sum(row["seconds"] for row in rows.values()) + seconds["startup"] <= wall + TOLERANCE_S  # none twice
    # the planted compiles: compile seconds, not kernel seconds
    planted = sum(float(line.split()[1]) for line in log.read_text().splitlines())
    assert planted >= 2 and seconds["compile"] >= planted - TOLERANCE_S, (seconds, planted)
    assert seconds["kernel"] < planted and summary["targets"][0]["kernel_s"] < planted, seconds
    # the same seconds in the target's own table, per tier
    stages = summary["targets"][0]["stages"]
    assert {tier: s["examples"] for tier, s in stages.items()} == {t: row["examples"] for t, row in rows.items()}
    # the report has the section; the command's last lines say it in one
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Where the time went" in report and "| planted.compiles_on_first_call | wide |" in report
    assert "time: 2 worker(s)" in r.stdout


def test_a_shrink_is_shrink_time_and_every_second_of_the_campaign_is_accounted():
    """In one process (fuzz_target): a planted kernel bug is found and Hypothesis shrinks it; the shrink phase's
    seconds are shrink, the examples drawn before it carry their own stages, and the table holds the campaign's
    time, never more."""
    config = CampaignConfig(out=Path(tempfile.mkdtemp()), max_examples=200, seed=3, poisons=(Poison.ZEROS,),
                            stop_at_first_failure=True, structural_shrink=0)
    began = time.perf_counter()
    stats = fuzz_target(DecodeMissesOwnToken(), config)
    lasted = time.perf_counter() - began
    assert stats.failures, "the planted bug was not found"
    (row,) = stats.stages.to_dict().values()
    seconds = row["seconds"]
    assert seconds["shrink"] > 0 and {"draw", "generate", "kernel", "reference", "hypothesis"} <= set(seconds)
    assert set(seconds) <= set(STAGES)
    assert 0.5 * lasted <= stats.stages.total() <= lasted


def test_the_table_adds_idle_time_and_shares_from_the_wall_time():
    """time_table: a row per target and tier, each stage's mean milliseconds per example, its share of the wall
    time; start-up as given and idle the wall time no row holds; time_line says the largest shares."""
    table = StageTable()
    table.add("small", {"kernel": 2.0, "reference": 1.0}, examples=4)
    table.add("small", {"hypothesis": 1.0})
    table.add("wide", {"kernel": 4.0}, examples=2)
    t = time_table([("t", table)], wall=20.0, startup=2.0, workers=2)
    small, wide = t["rows"]
    assert (small["tier"], small["examples"], small["seconds"], small["share"]) == ("small", 4, 4.0, 0.2)
    assert small["ms"] == {"kernel": 500.0, "reference": 250.0, "hypothesis": 250.0}
    assert wide["ms"] == {"kernel": 2000.0} and wide["share"] == 0.2
    assert t["seconds"] == {"kernel": 6.0, "reference": 1.0, "hypothesis": 1.0, "startup": 2.0, "idle": 10.0}
    assert sum(t["seconds"].values()) == t["wall_s"] == 20.0
    assert time_line(t) == ("time: 2 worker(s), 20 s of worker time: idle 50%, kernel 30%, startup 10%, "
                            "reference 5%, hypothesis 5%")
    section = "\n".join(time_section({"time": t}))
    assert "| t | small | 20.0% | 4 | 500.00 | 250.00 | 250.00 |" in section and "idle 50.0%" in section
    assert time_section({}) == [] and time_line({}) == "time: no worker time measured"


def test_the_sanitize_stage_by_phase_adds_up_per_group_and_keeps_a_shrink_apart():
    """StageTable's sanitize breakdown (summary.json's time.sanitize): the groups but the shrink's add up to the
    sanitize stage, each phase with its seconds and the examples it occurred in; a shrink's sanitized runs (their
    seconds the shrink stage's) are a group apart; the children's starts are summed, and the confirmations counted
    by where they ran; the report shows a row per group and one for them all; a campaign with no sanitized run has
    none."""
    table = StageTable()
    table.add("small", {"sanitize": 3.0}, examples=1, sanitize={
        "group": "first example", "seconds": {"start": 2.0, "kernel": 0.5, "readback": 0.5},
        "start": {"seconds": 2.5, "target": 1.0, "cuda": 0.5, "warm": 0.75, "warm_errors": 2}})
    table.add("wide", {"sanitize": 0.25}, examples=1,
              sanitize={"group": "seen config", "seconds": {"kernel": 0.2, "other": 0.05}, "confirm": "standby"})
    table.add("small", {"shrink": 1.0}, sanitize={"group": "shrink", "seconds": {"kernel": 0.75}, "confirm": None})
    t = time_table([("t", table)], wall=10.0, startup=0.0, workers=1)
    (s,) = t["sanitize"]
    assert s["target"] == "t" and s["examples"] == 2 and s["seconds"] == t["seconds"]["sanitize"] == 3.25
    assert s["phases"] == {"start": {"seconds": 2.0, "count": 1}, "kernel": {"seconds": 0.7, "count": 2},
                           "readback": {"seconds": 0.5, "count": 1}, "other": {"seconds": 0.05, "count": 1}}
    assert list(s["groups"]) == ["first example", "seen config", "shrink"]
    assert s["groups"]["shrink"] == {"examples": 1, "seconds": 0.75, "phases": {"kernel": {"seconds": 0.75,
                                                                                         "count": 1}}}
    assert s["starts"] == {"count": 1, "seconds": 2.5, "target": 1.0, "cuda": 0.5, "warm": 0.75, "warm_errors": 2}
    assert s["confirms"] == {"standby": 1}  # where each hit was confirmed (sanitizer_standby.CONFIRMS)
    section = "\n".join(time_section({"time": t}))
    assert "t: hits confirmed in standby: 1." in section
    assert "| t | all | 2 | 3.25 | 2.00 (1) | 0.70 (2) | 0.50 (1) | 0.05 (1) |" in section
    assert "| t | shrink | 1 | 0.75 | - | 0.75 (1) | - | - |" in section and "2.5 s from spawn to ready" in section
    assert "the warm-up 0.8 s with 2 example(s) refused" in section
    assert time_table([("t", StageTable())], wall=1.0, startup=0.0, workers=1)["sanitize"] == []
