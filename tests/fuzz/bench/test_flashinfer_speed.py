"""benchmarks/flashinfer_speed.py (the FlashInfer cold/warm benchmark of a lent GPU) on this CPU machine: its
pure parts (JIT module names and caches, time shares, phase records, the table) and, end to end, its
orchestration with a CPU target standing in for FlashInfer's; and kvfuzz.fuzz.bench.curve.run_campaign's wall
(SIGTERM, then the whole process group killed)."""

import json
import os
from pathlib import Path

from support import benchmark_script

from kvfuzz.fuzz.bench.curve import run_campaign

fs = benchmark_script("flashinfer_speed")

DECODE = ("batch_decode_with_kv_cache_dtype_q_f16_dtype_kv_e4m3_dtype_o_f16_dtype_idx_i32_head_dim_qk_128_head_dim_vo_"
          "128_posenc_0_use_swa_True_use_logits_cap_True")
PREFILL_FA3 = ("batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_64_"
               "head_dim_vo_64_posenc_0_use_swa_False_use_logits_cap_True_f16qk_False_sm90")


def test_module_names_give_their_compile_keys():
    assert fs.parse_module(DECODE) == {"kind": "batch_decode", "q": "f16", "kv": "e4m3", "o": "f16", "idx": "i32",
                                       "head_dim": 128, "window": True, "softcap": True}
    p = fs.parse_module(PREFILL_FA3)
    assert (p["kind"], p["backend"], p["q"], p["head_dim"], p["window"], p["softcap"]) == (
        "batch_prefill", "fa3", "bf16", 64, False, True)
    assert fs.parse_module(PREFILL_FA3.removesuffix("_sm90"))["backend"] == "fa2"
    assert fs.parse_module("page") == {"kind": "page"}


def _module(cache: Path, name: str, ninja_at: float | None, so_at: float | None) -> None:
    d = cache / ".cache" / "flashinfer" / "0.7.2.post1" / "90a" / "cached_ops" / name
    d.mkdir(parents=True)
    for f, t in (("build.ninja", ninja_at), (f"{name}.so", so_at)):
        if t is not None:
            (d / f).write_text("x")
            os.utime(d / f, (t, t))


def test_the_jit_cache_scan_times_each_module_by_its_files(tmp_path):
    _module(tmp_path, DECODE, 1000.0, 1021.5)
    _module(tmp_path, "page", 1100.0, 1119.0)
    _module(tmp_path, PREFILL_FA3, 1200.0, None)  # cut mid-build: no .so
    mods = {m["name"]: m for m in fs.jit_modules(tmp_path)}
    assert mods[DECODE]["compile_s"] == 21.5 and mods[DECODE]["built"] and mods[DECODE]["head_dim"] == 128
    assert mods["page"]["compile_s"] == 19.0 and mods["page"]["kind"] == "page"
    assert not mods[PREFILL_FA3]["built"] and mods[PREFILL_FA3]["compile_s"] is None
    assert fs.count_modules(tmp_path) == 2 and fs.count_modules(tmp_path / "absent") == 0


def test_time_is_shared_in_proportion_to_the_plan_and_phases_have_room_to_stop():
    plan = {"a": (40, 20, 1, 1), "b": (120, 20, 1, 1)}
    phases = [("a", "cold"), ("a", "warm"), ("b", "cold"), ("b", "warm")]
    assert fs.share(plan, 200, phases) == 40 and fs.share(plan, 200, phases[2:]) == 200 * 120 / 140
    assert fs.share(plan, 100, []) == 0
    assert fs.campaign_limits("cold", 80) == (50, 80) and fs.campaign_limits("warm", 25) == (10, 25)
    assert fs.campaign_limits("cold", 20)[0] == 5


def test_a_phase_record_lists_the_modules_it_built_and_when_it_first_counted():
    run = {"target": "t", "examples": 40, "elapsed_s": 20.0, "examples_per_s": None, "seconds": 30.0,
           "coverage": {"gqa": {"mqa": 3, "7": 2}}, "samples": [{"t": 2, "examples": None}, {"t": 4, "examples": 0},
                                                               {"t": 6, "examples": 5}]}
    old = {"name": "page", "built": True, "built_at": 10.0, "compile_s": 19.0}
    new = {"name": DECODE, "built": True, "built_at": 130.0, "compile_s": 21.0}
    cut = {"name": PREFILL_FA3, "built": False, "built_at": None, "compile_s": None}
    rec = fs.phase_record(run, [old], [old, new, cut], started=100.0)
    assert [m["name"] for m in rec["modules_built"]] == [DECODE] and rec["modules_built"][0]["built_s"] == 30.0
    assert rec["first_example_s"] == 6 and rec["group_sizes"] == ["7", "mqa"]
    assert rec["examples_per_s"] == 2.0 and rec["examples_per_wall_s"] == 1.33
    assert rec["incomplete_modules"] == [PREFILL_FA3] and "samples" not in rec


def test_the_table_reads_a_partial_document(tmp_path):
    cold = {"workers": 8, "examples": 120, "examples_per_s": 3.5,
            "modules_built": [{"compile_s": 20.0}, {"compile_s": 30.0}],
            "first_example_s": 28.0, "group_sizes": ["1", "16"],
            "declared_never_drawn": ["block_size 3"],
            "failures": [("kernel crash", "raised RuntimeError", 2)]}
    doc = {"settings": {"budget_s": 400, "seed": 1, "cpus": 16, "device": "H100", "flashinfer": "0.7.2.post1"},
           "targets": {"flashinfer.batch_decode": {"cold": cold},
                       "flashinfer.batch_prefill": {"skipped": "out of time (12 s left for it)"}},
           "finished": False, "elapsed_s": 100.0}
    md = fs.markdown(doc)
    assert "| flashinfer.batch_decode | 8 | 120, 3.50 | 2 (25, 30) | 28.00 s |" in md
    assert "block_size 3" in md and "kernel crash (raised RuntimeError)" in md and "1, 16" in md
    assert "skipped: out of time" in md and "Finished: False" in md
    fs.write(doc, tmp_path)
    assert json.loads((tmp_path / "flashinfer-speed.json").read_text())["targets"]["flashinfer.batch_prefill"]
    assert (tmp_path / "flashinfer-speed.md").read_text() == md and not list(tmp_path.glob(".*tmp"))


def test_without_time_for_a_phase_it_says_so_and_still_writes_everything(tmp_path):
    assert fs.main(["--out", str(tmp_path / "out"), "--root", str(tmp_path / "root"), "--budget", "20",
                    "--target", "mutant.base", "--no-replay"]) == 0
    doc = json.loads((tmp_path / "out" / "flashinfer-speed.json").read_text())
    t = doc["targets"]["mutant.base"]
    assert doc["finished"] and t["skipped"].startswith("out of time") and t["warm_skipped"] == "no cold phase"


def test_end_to_end_on_a_cpu_target_cold_then_warm(tmp_path):
    """The whole benchmark with a CPU mutant for a target (no JIT cache to fill): a cold and a warm campaign,
    both recorded with their declared tables, and the replay of the FlashInfer case, which cannot run here."""
    assert fs.main(["--out", str(tmp_path / "out"), "--root", str(tmp_path / "root"), "--budget", "110",
                    "--target", "mutant.base", "--workers", "1", "--interval", "1"]) == 0
    doc = json.loads((tmp_path / "out" / "flashinfer-speed.json").read_text())
    t = doc["targets"]["mutant.base"]
    assert t["cold"]["examples"] and t["warm"]["examples"] and t["cold"]["declared"]["dtype"]
    assert t["warm"]["modules_built"] == [] and t["cold"]["group_sizes"]
    assert doc["replay"]["exit_status"] == 3 and "cannot replay here" in doc["replay"]["output"]
    assert "mutant.base" in (tmp_path / "out" / "flashinfer-speed.md").read_text()


def test_a_campaign_past_its_wall_is_stopped_with_its_counts_and_nothing_left_running(tmp_path):
    r = run_campaign("mutant.base", 600, 1, tmp_path / "cache", tmp_path / "c", interval=1.0,
                     extra=("--max-examples", "100000"), wall=8.0)
    assert r["stopped_at_wall"] and r["examples"] is not None
    assert r["exit_status"] in (3, -15) and (r["summary"] or r["examples"] == 0)
    assert _alive_in_group(r["pid"]) == []


def _alive_in_group(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (an orphan's zombie waits for a PID 1 that may never reap
    it, here: it runs nothing)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive
