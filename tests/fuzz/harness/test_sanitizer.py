"""The memory-safety oracle (kvfuzz.fuzz.harness.sanitizer, `kvfuzz fuzz --sanitize`): compute-sanitizer's report
parsed into accesses (kernel, file:line, size, offset from the nearest allocation), a planted sanitizer that reports
an invalid read (a "memory safety" failure, found and shrunk by a campaign) and one that reports none (no failure),
the exact-size block table, and the option's bad values. CPU only: the planted sanitizer stands in for CUDA's."""

import json
import os
import stat
import sys
import tempfile
import time
from pathlib import Path

import attrs
import pytest
from hypothesis.database import InMemoryExampleDatabase
from support import SUPPORT, kvfuzz

from kvfuzz.contracts.checks.failures import FailureKind, HarnessError, MemorySafetyError
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import PagedTorch, small_batch
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness import sanitizer
from kvfuzz.fuzz.targets.registry import spec_of

#: vllm#56862 as compute-sanitizer 2025.x prints it on an H100 (issue 39), with a line of the program's own output
REPORT = """========= COMPUTE-SANITIZER
some output of the program
========= Invalid __global__ read of size 4 bytes
=========     at kernel_unified_attention+0x1b70 in /venv/vllm/v1/attention/ops/triton_unified_attention.py:432
=========     by thread (3,0,0) in block (0,0,0)
=========     Address 0x7f5e2a000204 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f5e2a000200 of size 4 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2d2ae5] in libcuda.so.1
=========
========= ERROR SUMMARY: 1 error
"""
CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"


def _fake(tmp: Path, text: str, name: str = "compute-sanitizer") -> str:
    """A planted compute-sanitizer: prints ``text`` whatever its arguments (the child is not run)."""
    (tmp / "report.txt").write_text(text)
    exe = tmp / name
    exe.write_text(f"#!/bin/sh\ncat '{tmp / 'report.txt'}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def test_the_report_is_parsed_into_the_access():
    r = sanitizer.parse_memcheck(REPORT)
    assert r.error_count == 1 and not r.clean
    (a,) = r.accesses
    assert (a.access, a.space, a.size, a.kernel, a.line) == ("read", "global", 4, "kernel_unified_attention", 432)
    assert a.file.endswith("triton_unified_attention.py") and a.address == "0x7f5e2a000204"
    assert (a.offset, a.side, a.allocation_size) == (1, "after", 4)
    assert a.describe() == ("invalid global read of 4 bytes in kernel_unified_attention at "
                            "triton_unified_attention.py:432, 1 bytes after the nearest allocation of 4 bytes")
    assert sanitizer.parse_memcheck(CLEAN).clean
    assert sanitizer.parse_memcheck("no report at all").error_count is None


def test_a_planted_report_is_a_memory_safety_failure_and_a_clean_one_passes(tmp_path):
    ex = Example(small_batch([4], [12], head_size=32, block_size=16), Poison.NAN)
    with pytest.raises(MemorySafetyError) as info:
        sanitizer.sanitize(PagedTorch(), ex, "paged.torch", sanitizer=_fake(tmp_path, REPORT))
    f = info.value
    assert f.kind is FailureKind.MEMORY_SAFETY and f.kind.blame == "kernel" and f.check == sanitizer.CHECK
    assert "triton_unified_attention.py:432" in f.message and f.details["accesses"][0]["offset"] == 1
    sanitizer.sanitize(PagedTorch(), ex, "paged.torch", sanitizer=_fake(tmp_path, CLEAN))
    with pytest.raises(HarnessError, match="no report"):
        sanitizer.sanitize(PagedTorch(), ex, "paged.torch", sanitizer=_fake(tmp_path, "Segmentation fault\n"))


@pytest.mark.parametrize("report, fails", [(REPORT, True), (CLEAN, False)])
def test_a_campaign_with_sanitize_finds_and_shrinks_a_planted_access_and_passes_a_clean_one(
        tmp_path, monkeypatch, report, fails):
    monkeypatch.setenv(sanitizer.ENV, _fake(tmp_path, report))
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)  # the planted sanitizer stands in for CUDA
    config = CampaignConfig(out=Path(tempfile.mkdtemp()), max_examples=12, duration=120, seed=0,
                            database=InMemoryExampleDatabase(), stop_at_first_failure=True, sanitize=1.0,
                            structural_shrink=0)
    stats = fuzz_target(PagedTorch(), config)
    if not fails:
        assert not stats.failures and stats.examples >= 12
        return
    (rec,) = stats.failures.values()
    assert rec.kind == "memory safety" and rec.blame == "kernel" and rec.check == sanitizer.CHECK
    b = Example.from_dict(rec.example).batch
    assert b.num_seqs == 1 and b.num_tokens == 1  # every example fails: shrunk to the smallest


def test_a_share_picks_the_same_examples_every_time():
    exs = [Example(small_batch([1], [c], head_size=32, block_size=16), Poison.NAN) for c in range(60)]
    picked = [sanitizer.selected(e, 0.25) for e in exs]
    assert picked == [sanitizer.selected(e, 0.25) for e in exs] and 3 <= sum(picked) <= 30
    assert all(sanitizer.selected(e, 1.0) for e in exs) and not any(sanitizer.selected(e, 0.0) for e in exs)


def test_the_exact_batch_has_no_spare_block_table_column():
    b = small_batch([4, 1], [12, 40], head_size=32, block_size=16, table=[[0, 5, 6], [1, 2, 3]], num_blocks=7)
    spare = attrs.evolve(b, block_table=[[0, 5, 6, 4], [1, 2, 3, 4]])
    assert sanitizer.exact_batch(spare).block_table == b.block_table and sanitizer.exact_batch(b) is b


def test_a_bad_share_exits_2_naming_the_option():
    r = kvfuzz("fuzz", "--sanitize", "most", "--target", "vllm.cpu_attention")
    assert r.returncode == 2 and "--sanitize" in r.stderr and "all" in r.stderr
    r = kvfuzz("fuzz", "--sanitize", "auto:2", "--target", "vllm.cpu_attention")
    assert r.returncode == 2 and "auto:SHARE" in r.stderr


def test_auto_with_a_share_sets_the_time_share():
    from kvfuzz.fuzz.cli.fuzz import _sanitize_config, _sanitize_share

    assert _sanitize_config(_sanitize_share(None, None, "auto:0.05")) == {"sanitize": 0.0,
                                                                           "sanitize_time_share": 0.05}
    assert _sanitize_config(_sanitize_share(None, None, "auto")) == {"sanitize": 0.0,
                                                                      "sanitize_time_share": sanitizer.AUTO_TIME_SHARE}
    assert _sanitize_config(_sanitize_share(None, None, "0.1")) == {"sanitize": 0.1, "sanitize_time_share": 0.0}


def _running_sanitizer(tmp: Path) -> str:
    """tests/support/planted_memcheck.py's FAKE_SANITIZER: runs its program (a real kvfuzz child), passes its
    output through and ends with an ERROR SUMMARY."""
    from support.planted_memcheck import FAKE_SANITIZER

    exe = tmp / "compute-sanitizer"
    exe.write_text(FAKE_SANITIZER.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def _planted(name: str):
    """A target of tests/support/planted_memcheck.py, loaded by file as a user's adapter is."""
    from kvfuzz.fuzz.targets.registry import get_target

    return get_target(f"{SUPPORT / 'planted_memcheck.py'}:{name}")


def _overrun_target():
    return _planted("HalfTileOverrun")


def test_the_long_lived_child_runs_many_examples_and_a_hit_is_confirmed_in_a_fresh_one(tmp_path):
    """One child process serves clean examples one after another (the ~15 s start of a fresh child is paid once);
    an invalid access between two markers is confirmed by a fresh child's whole report (or, in a shrink, taken
    from the segment); a child that still answers is kept, one that died is replaced."""
    from kvfuzz.fuzz.targets.registry import spec_of

    target = _overrun_target()
    child = sanitizer.SanitizedChild(spec_of(target), sanitizer=_running_sanitizer(tmp_path), timeout=120)
    try:
        odd = [Example(small_batch([1], [c], head_size=32, block_size=16), Poison.NAN) for c in (0, 2, 4)]
        child.check(target, odd[0])
        pid = child._proc.pid
        for ex in odd[1:]:
            child.check(target, ex)
        assert child._proc.pid == pid  # the same process answered all three
        with pytest.raises(MemorySafetyError) as info:
            child.check(target, Example(small_batch([1], [1], head_size=32, block_size=16), Poison.NAN))
        assert "half_tile.py:7" in info.value.message and info.value.details["error_count"] == 1
        assert "ERROR SUMMARY: 1 error" in info.value.details["report"]  # the fresh child's whole report
        with pytest.raises(MemorySafetyError):  # a shrink's candidate: the segment decides, no fresh child
            child.check(target, Example(small_batch([1], [3], head_size=32, block_size=16), Poison.NAN),
                        confirm=False)
        child.check(target, odd[0])
        assert child._proc.pid == pid  # it answered after the invalid accesses ("done"): kept
        child._proc.kill()
        child._proc.wait()
        child.check(target, odd[1])  # a child that died is replaced
        assert child._proc.pid != pid
        folder = Path(child._dir)
    finally:
        child.close()
    assert not folder.exists() and not child.running  # its example files go with it


def test_a_campaign_finds_the_planted_overrun_through_the_long_lived_child_and_shrinks_it(tmp_path, monkeypatch):
    monkeypatch.setenv(sanitizer.ENV, _running_sanitizer(tmp_path))
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)  # the stand-in runs on CPU
    # the structural shrink runs outside Hypothesis's test, where event() raises InvalidArgument: a worker died of
    # it in a sanitized campaign on an H200 (a harness error beside the finding)
    config = CampaignConfig(out=tmp_path / "out", max_examples=30, duration=300, seed=0,
                            database=InMemoryExampleDatabase(), stop_at_first_failure=True, sanitize=1.0,
                            structural_shrink=30)
    stats = fuzz_target(_overrun_target(), config)
    (rec,) = stats.failures.values()
    assert rec.kind == "memory safety" and "half_tile.py:7" in rec.message
    b = Example.from_dict(rec.example).batch
    assert b.num_seqs == 1 and b.seq_lens[0] == 2  # the smallest even seq_len
    assert stats.coverage.counts["sanitize"]["memcheck"] >= 1
    # the sanitize stage by phase: its groups but the shrink's add up to it; the first hit was confirmed in a fresh
    # child, and the shrink's sanitized runs are a group of their own (their seconds are the shrink stage's)
    phases = stats.stages.sanitize.to_dict()
    stage = sum(row["seconds"].get("sanitize", 0.0) for row in stats.stages.to_dict().values())
    assert abs(phases["seconds"] - stage) <= 1e-3 and phases["phases"]["confirm"]["count"] >= 1
    assert phases["groups"]["shrink"]["examples"] >= 1 and phases["groups"]["first example"]["examples"] == 1


def test_the_time_share_sanitizes_only_while_under_its_budget(monkeypatch):
    """``--sanitize auto``: an example is due while the seconds spent on sanitized runs stay within the share of
    the time since the first example; a big-cache example never is; a memory-safety failure makes every one due."""
    from kvfuzz.fuzz.campaign import engine, runner
    from kvfuzz.fuzz.campaign.records import Quiet

    clock = [100.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)
    config = CampaignConfig(out=Path(tempfile.mkdtemp()), max_examples=1, sanitize_time_share=0.1,
                            database=InMemoryExampleDatabase())
    class Declared(PagedTorch):
        name = "planted.sanitize_declared"
        sanitize_by_default = True  # as the Triton targets declare it

    assert not engine.Campaign(PagedTorch(), config, Quiet()).runner.sanitizer.due(
        Example(small_batch([1], [3], head_size=32, block_size=16), Poison.NAN))  # a target that does not declare it
    s = engine.Campaign(Declared(), config, Quiet()).runner.sanitizer
    ex = Example(small_batch([1], [3], head_size=32, block_size=16), Poison.NAN)
    assert s.due(ex)  # the first: nothing spent yet
    s.spent = 2.0  # a 2 s run
    clock[0] = 110.0
    assert not s.due(ex)  # 2 s of 10 s: over 10%
    clock[0] = 120.0
    assert s.due(ex)  # 2 s of 20 s
    long = Example(small_batch([1], [sanitizer.TIME_SHARE_MAX_TOKENS], head_size=32, block_size=16), Poison.NAN)
    assert not s.due(long)  # over the time share's tokens: the share goes to small batches
    assert engine.Campaign(Declared(), attrs.evolve(config, sanitize=1.0), Quiet()).runner.sanitizer.due(long)
    big = attrs.evolve(ex, batch=attrs.evolve(ex.batch, num_blocks=1 << 22, block_table=[[(1 << 22) - 1]]))
    assert not s.due(big)  # a > 1 GiB cache: never by time share
    s.every_example = True
    assert s.due(big)
    s.every_example = False
    # no child running: starting one would overrun --duration
    assert not s.due(ex, deadline=clock[0] + sanitizer.START_SECONDS - 1)
    off = engine.Campaign(Declared(), attrs.evolve(config, sanitize_time_share=0.0), Quiet()).runner.sanitizer
    assert not off.due(ex)
    monkeypatch.setattr(sanitizer, "applies", lambda target: False)  # off CUDA: never
    assert not s.due(ex)


def test_a_starting_child_is_waited_for_by_a_hash_share_and_skipped_uncharged_by_the_time_share(
        tmp_path, monkeypatch):
    """The child starts in the background: ready() is False until it prints its marker, then True. An example the
    time share picked while it starts is checked without the sanitizer, holding no GPU slot and charging nothing;
    one a hash share picked waits for it and is sanitized (here: the planted overrun is found)."""
    from kvfuzz.fuzz.campaign import engine
    from kvfuzz.fuzz.campaign.records import Quiet
    from kvfuzz.fuzz.targets.registry import spec_of

    exe = _running_sanitizer(tmp_path)
    target = _overrun_target()
    child = sanitizer.SanitizedChild(spec_of(target), sanitizer=exe, timeout=120)
    try:
        assert not child.ready() and child.running  # started, not waited for
        deadline = time.monotonic() + 120
        while not child.ready():
            assert time.monotonic() < deadline and child.running
            time.sleep(0.05)
        child.check(target, Example(small_batch([1], [2], head_size=32, block_size=16), Poison.NAN))
    finally:
        child.close()

    monkeypatch.setenv(sanitizer.ENV, exe)
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)
    hit = Example(small_batch([1], [1], head_size=32, block_size=16), Poison.NAN)  # an odd seq_len overruns
    shared = CampaignConfig(out=tmp_path, max_examples=1, sanitize_time_share=1.0, database=InMemoryExampleDatabase())
    monkeypatch.setattr(type(target), "sanitize_by_default", True, raising=False)
    c = engine.Campaign(target, shared, Quiet())
    slots = []
    real_slot = sanitizer.gpu_slot
    monkeypatch.setattr(sanitizer, "gpu_slot", lambda *a, **k: slots.append(a) or real_slot(*a, **k))
    try:
        s = c.runner.sanitizer
        assert c.runner.check(hit) is None  # its child is starting: not sanitized
        assert not slots and not s.last and s.spent == 0.0 and s._child.running
    finally:
        c.close()
    c = engine.Campaign(target, attrs.evolve(shared, sanitize=1.0, sanitize_time_share=0.0), Quiet())
    try:
        with pytest.raises(MemorySafetyError):  # a hash share waits for the start
            c.runner.check(hit)
        assert slots
    finally:
        c.close()


def test_the_exact_batch_puts_a_longest_sequence_last():
    """An overrun of the last row is past the table's allocation; of another row, inside the next one: the
    sanitized run (which checks no output) moves a sequence needing every column to the end."""
    b = small_batch([1, 4, 1], [40, 12, 3], head_size=32, block_size=16, table=[[0, 5, 6], [1, 2, 0], [3, 0, 0]],
                    num_blocks=7)
    e = sanitizer.exact_batch(b)
    assert e.query_lens == (4, 1, 1) and e.ctx_lens == (12, 3, 40) and e.block_table[-1] == (0, 5, 6)
    assert sanitizer.exact_batch(e) == e  # already last: unchanged
    # CUDA-graph pads (a state that appends rows) come last whatever the real rows' order: the order is kept
    padded = small_batch([1, 1, 1], [40, 12, 3], head_size=32, block_size=16,
                         table=[[0, 5, 6], [1, 2, 0], [3, 0, 0]], num_blocks=7, num_pad_seqs=2)
    assert sanitizer.exact_batch(padded) is padded


def test_a_hung_long_lived_child_is_replaced_and_the_fresh_one_decides(tmp_path):
    """A child that answers nothing within the timeout is killed; the fresh child decides (here it hangs too: a
    harness error, not a finding and not a pass)."""
    exe = tmp_path / "compute-sanitizer"
    exe.write_text("#!/bin/sh\nsleep 30\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    child = sanitizer.SanitizedChild("paged.torch", sanitizer=str(exe), timeout=1)
    ex = Example(small_batch([1], [3], head_size=32, block_size=16), Poison.NAN)
    with pytest.raises(HarnessError, match="timed out"):
        child.check(PagedTorch(), ex)
    assert not child.running


def test_one_sanitized_run_at_a_time_per_gpu(tmp_path, monkeypatch):
    """gpu_slot: a second worker asking for the same GPU's slot while it is held is told no at once (its example
    is not sanitized); another GPU's slot is its own; a released slot is free again; no campaign folder: yes."""
    monkeypatch.setenv("KVFUZZ_DEVICE", "3")
    with sanitizer.gpu_slot(tmp_path) as first:
        with sanitizer.gpu_slot(tmp_path) as second:
            assert first and not second
        monkeypatch.setenv("KVFUZZ_DEVICE", "2")
        with sanitizer.gpu_slot(tmp_path) as other_gpu:
            assert other_gpu
        monkeypatch.setenv("KVFUZZ_DEVICE", "3")
    with sanitizer.gpu_slot(tmp_path) as again:
        assert again
    with sanitizer.gpu_slot(None) as no_folder:
        assert no_folder
    with sanitizer.gpu_slot(tmp_path / "not-made") as no_lock_file:
        assert no_lock_file


def test_a_busy_gpu_slot_skips_the_sanitized_run_uncharged(tmp_path, monkeypatch):
    """An example that finds its GPU's slot held is checked without the sanitizer and costs no time share."""
    from kvfuzz.fuzz.campaign import engine
    from kvfuzz.fuzz.campaign.records import Quiet

    monkeypatch.setenv(sanitizer.ENV, _running_sanitizer(tmp_path))
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)
    config = CampaignConfig(out=tmp_path, max_examples=1, sanitize=1.0, database=InMemoryExampleDatabase())
    c = engine.Campaign(_overrun_target(), config, Quiet())
    hit = Example(small_batch([1], [1], head_size=32, block_size=16), Poison.NAN)  # an odd seq_len overruns
    try:
        with sanitizer.gpu_slot(tmp_path):  # another worker's sanitized run holds this GPU
            s = c.runner.sanitizer
            assert c.runner.check(hit) is None and not s.last and s.spent == 0.0
        with pytest.raises(MemorySafetyError):
            c.runner.check(hit)
    finally:
        c.close()


def test_after_recording_a_memory_safety_failure_the_campaign_returns_to_its_share(tmp_path, monkeypatch):
    """While a new memory-safety failure is shrunk every example is sanitized; once it is recorded the campaign
    samples again (sanitizing everything for the rest of a campaign cost 76% of its examples/s on an H200), and a
    later hit of the recorded failure does not switch it back."""
    from kvfuzz.fuzz.campaign import engine
    from kvfuzz.fuzz.campaign.records import Quiet

    monkeypatch.setenv(sanitizer.ENV, _running_sanitizer(tmp_path))
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)
    config = CampaignConfig(out=tmp_path / "out", max_examples=30, seed=0, database=InMemoryExampleDatabase(),
                            sanitize=1.0, structural_shrink=30)
    config.out.mkdir()
    c = engine.Campaign(_overrun_target(), config, Quiet())
    seen = []
    real_check = sanitizer.SanitizedChild.check

    def check(self, target, example, confirm=True):
        seen.append(c.runner.sanitizer.every_example)
        return real_check(self, target, example, confirm=confirm)

    monkeypatch.setattr(sanitizer.SanitizedChild, "check", check)
    try:
        (rec,) = c.run_chunk(0, 30)
        assert rec.kind == "memory safety" and True in seen  # the shrink sanitized with the failure pending
        assert not c.runner.sanitizer.every_example
        with pytest.raises(MemorySafetyError):
            c.runner.check(Example(small_batch([1], [1], head_size=32, block_size=16), Poison.NAN))
        assert not c.runner.sanitizer.every_example  # a hit of the recorded failure
    finally:
        c.close()


#: what memcheck printed on an H200 that other processes had filled (the sanitized child could not make its context)
DEVICE_FULL = ("""========= COMPUTE-SANITIZER
========= Program hit cudaErrorMemoryAllocation (error 2) due to "out of memory" on CUDA API call to """
               """cudaDeviceGetStreamPriorityRange.
=========     Saved host backtrace up to driver entry point at error
=========
========= Program hit cudaErrorMemoryAllocation (error 2) due to "out of memory" on CUDA API call to cudaMalloc.
=========
========= ERROR SUMMARY: 2 errors
""")


def test_a_sanitized_run_that_found_the_device_full_is_not_a_finding(tmp_path, monkeypatch):
    """Failed allocations alone say nothing about the kernel's accesses: DeviceFull, and a campaign counts the
    example as not sanitized (label "skipped: device full"), with no failure. An invalid access beside a failed
    allocation, or another API error, stays a memory-safety failure."""
    r = sanitizer.parse_memcheck(DEVICE_FULL)
    assert r.out_of_memory and not r.clean and r.error_count == 2
    assert not sanitizer.parse_memcheck(REPORT).out_of_memory and not sanitizer.parse_memcheck(CLEAN).out_of_memory
    both = DEVICE_FULL.replace("========= ERROR SUMMARY: 2 errors\n", "") + REPORT.split("\n", 1)[1]
    assert not sanitizer.parse_memcheck(both).out_of_memory
    launch = DEVICE_FULL.replace('cudaErrorMemoryAllocation (error 2) due to "out of memory"',
                                 "cudaErrorLaunchFailure (error 719) due to \"unspecified launch failure\"", 1)
    assert not sanitizer.parse_memcheck(launch).out_of_memory
    ex = Example(small_batch([4], [12], head_size=32, block_size=16), Poison.NAN)
    with pytest.raises(sanitizer.DeviceFull):
        sanitizer.sanitize(PagedTorch(), ex, "paged.torch", sanitizer=_fake(tmp_path, DEVICE_FULL))
    (tmp_path / "launch").mkdir()
    with pytest.raises(MemorySafetyError):
        sanitizer.sanitize(PagedTorch(), ex, "paged.torch", sanitizer=_fake(tmp_path / "launch", launch))
    monkeypatch.setenv(sanitizer.ENV, _fake(tmp_path, DEVICE_FULL))
    monkeypatch.setattr(sanitizer, "applies", lambda target: True)
    stats = fuzz_target(PagedTorch(), CampaignConfig(out=tmp_path / "out", max_examples=4, seed=0, sanitize=1.0,
                                                     database=InMemoryExampleDatabase()))
    assert not stats.failures and stats.examples == 4
    assert stats.coverage.counts["sanitize"] == {"skipped: device full": 4}


def test_a_sanitized_example_reports_its_phases_and_whether_its_kernel_configuration_was_new(tmp_path):
    """Each check says where its seconds went (SanitizedChild.last): the worker's phases (the start it waited for,
    the example shipped, the rest of the wait, the verdict) and the child's (load, generate, materialize, compile,
    kernel: sent with its marker), together within the check's own time; and what the child said of the example:
    its first, a kernel configuration (here a block_size) new to the child (its compile), or one it ran before. A
    check of a ready child waits for no start; the start is reported apart (spawn to ready, and the child's part)."""
    target = _planted("CompilesPerConfig")
    child = sanitizer.SanitizedChild(spec_of(target), sanitizer=_running_sanitizer(tmp_path), timeout=120)
    seen = []
    try:
        for block_size in (16, 16, 32):
            began = time.perf_counter()
            child.check(target, Example(small_batch([1], [3], head_size=32, block_size=block_size), Poison.NAN))
            seen.append((child.last, time.perf_counter() - began))
    finally:
        child.close()
    assert [last["child"] for last, _ in seen] == ["first", "seen", "new"]
    for last, lasted in seen:
        assert {"ship", "load", "generate", "materialize", "kernel", "readback", "verdict"} <= set(last["seconds"])
        assert set(last["seconds"]) <= set(sanitizer.PHASES) - {"slot", "other"}
        assert 0 < sum(last["seconds"].values()) <= lasted  # measured inside the check, each second once
    (first, _), (same, _), (new, _) = seen
    assert first["seconds"]["start"] > 0 and "start" not in same["seconds"] and "start" not in new["seconds"]
    planted = 0.05  # KVFUZZ_PLANTED_COMPILE_S's default: the child's first call of each block_size
    assert first["seconds"]["compile"] >= planted and new["seconds"]["compile"] >= planted
    assert "compile" not in same["seconds"]
    assert child.started["seconds"] >= child.started["target"] > 0 and "cuda" in child.started


def test_a_campaign_splits_its_sanitize_stage_by_phase_in_the_summary_and_the_report(tmp_path):
    """Through the kvfuzz command (a worker, its pipe, the supervisor): summary.json's time.sanitize holds the
    sanitize stage by phase, its seconds the stage's, every sanitized example's child phases counted, the phases
    measured holding nearly all of it (``other`` is the rest); its groups tell the child's first example, the first
    call of a new block_size and the calls of one it ran; report.md shows the table."""
    env = dict(os.environ, KVFUZZ_COMPUTE_SANITIZER=_running_sanitizer(tmp_path), KVFUZZ_PLANTED_SANITIZE_ON_CPU="1")
    r = kvfuzz("fuzz", "--target", f"{SUPPORT / 'planted_memcheck.py'}:CompilesPerConfig", "--sanitize", "all",
               "--max-examples", "12", "--workers", "1", "--seed", "0", "--steer", "off", "--out", tmp_path / "out",
               env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (phases,) = summary["time"]["sanitize"]
    target = summary["targets"][0]
    stage = sum(row["seconds"].get("sanitize", 0.0) for row in target["stages"].values())
    assert phases["target"] == "planted.compiles_per_config" and abs(phases["seconds"] - stage) <= 1e-3
    assert phases["examples"] == target["examples"] + target["shrink_runs"] >= 12  # each one sanitized
    for phase in ("ship", "load", "generate", "materialize", "kernel", "readback", "verdict"):
        # an example that met the child's start may have no readback left: its relay is in `start`
        first = phase == "readback" and "start" in phases["phases"]
        assert phases["examples"] - first <= phases["phases"][phase]["count"] <= phases["examples"], phase
    assert phases["phases"].get("other", {"seconds": 0.0})["seconds"] < 0.5 * phases["seconds"]
    groups = phases["groups"]
    assert groups["first example"]["examples"] == 1 and set(groups) <= {"first example", "new config", "seen config"}
    assert groups["seen config"]["examples"] >= 1 and "compile" not in groups["seen config"]["phases"]
    assert phases["starts"]["count"] == 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| planted.compiles_per_config | all |" in report
    assert "| planted.compiles_per_config | seen config |" in report
