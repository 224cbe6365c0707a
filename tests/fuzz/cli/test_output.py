"""The everyday output of the kvfuzz command, as the tools teams already use it (issue 48, 9): -q/-v and --version on
the group, one libFuzzer-style stats line per tick when the output is not a terminal, a time left under --duration,
coverage lines capped, and project defaults from [tool.kvfuzz] in pyproject.toml (found upward; the command line
wins; a bad key or value exits 2 naming the file and the key)."""

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from support import SUPPORT, kvfuzz

from kvfuzz.fuzz.cli import main

PLANTED = SUPPORT / "planted_endings.py"


def _stats(target, examples, rate, failures=0):
    return SimpleNamespace(target=target, examples=examples, examples_per_second=rate,
                           failures={i: None for i in range(failures)})


# ---- the group: -q/-v, --version ----------------------------------------------------------------------------------
@pytest.mark.cli_text
def test_version_is_on_the_group():
    import importlib.metadata

    for flag in ("--version", "-V"):
        r = CliRunner().invoke(main, [flag])
        assert r.exit_code == 0 and r.output == f"kvfuzz {importlib.metadata.version('kvfuzz')}\n", r.output


@pytest.mark.cli_text
def test_quiet_and_verbose_levels(tmp_path):
    """-q: no start-up, progress or coverage lines; -qq: no table either; -v: one coverage line per dimension."""
    args = ("fuzz", "--target", f"{PLANTED}:Correct", "--max-examples", "3", "--workers", "1")
    plain = kvfuzz(*args, "--out", tmp_path / "a", cwd=tmp_path)
    quiet = kvfuzz("-q", *args, "--out", tmp_path / "b", cwd=tmp_path)
    quieter = kvfuzz("-qq", *args, "--out", tmp_path / "c", cwd=tmp_path)
    verbose = kvfuzz("-v", *args, "--out", tmp_path / "d", cwd=tmp_path)
    for r in (plain, quiet, quieter, verbose):
        assert r.returncode == 0 and "summary:" in r.stdout, r.stdout + r.stderr
    assert "fuzzing planted.correct" in plain.stdout and "planted.correct coverage: path: " in plain.stdout
    assert "fuzzing" not in quiet.stdout and "coverage" not in quiet.stdout and "kvfuzz summary" in quiet.stdout
    assert "kvfuzz summary" not in quieter.stdout
    assert "planted.correct coverage:\n  path: default 3\n" in verbose.stdout


# ---- progress: one stats line per tick, a time left -----------------------------------------------------------------
@pytest.mark.cli_text
def test_the_stats_line_is_one_line_for_every_target():
    from kvfuzz.fuzz.cli.progress import progress_line

    stats = [_stats("vllm.cpu_attention", 160, 2.5, failures=1), _stats("vllm.unified_attention", 152, 2.25)]
    assert progress_line(stats, 65, max_examples=200) == (
        "[1m05s] 312 examples (4.8/s), 1 failure, ~19s left | vllm.cpu_attention 160/200 (2.5/s, 1 failure) | "
        "vllm.unified_attention 152/200 (2.2/s)")
    stats[0].elapsed, stats[1].elapsed = 60.0, 20.0  # in turn: the first target's minute is over
    assert progress_line(stats, 80, duration=60) == (
        "[1m20s] 312 examples (4.8/s), 1 failure, 40s left | vllm.cpu_attention 160 (2.5/s, 1 failure) | "
        "vllm.unified_attention 152 (2.2/s)")


def test_time_left_under_duration_and_budget():
    from kvfuzz.fuzz.cli.progress import clock, time_left

    s = [_stats("t", 10, 2.0)]
    assert time_left(s, 30, None, 90) == "1m00s left"  # --duration: the time to its end
    assert time_left(s, 5, 20, None) == "~5s left"  # --max-examples: 10 more at 2/s, an estimate
    assert time_left(s, 5, 20, 90) == "~5s left"  # both: the sooner
    assert time_left([_stats("t", 0, 0.0)], 1, 20, None) == ""  # no rate yet: no guess
    assert time_left(s, 5, None, None) == ""
    # the targets take the workers in turn: 60 s left of one, all 90 s of one not started, none of one stopped
    turn = [SimpleNamespace(examples=10, examples_per_second=2.0, elapsed=30.0, stopped=""),
            SimpleNamespace(examples=0, examples_per_second=0.0, elapsed=0.0, stopped=""),
            SimpleNamespace(examples=3, examples_per_second=1.0, elapsed=4.0, stopped="its first failure")]
    assert time_left(turn, 30, None, 90) == "2m30s left"
    assert [clock(x) for x in (0.2, 59.6, 185, 7620)] == ["0s", "1m00s", "3m05s", "2h07m"]


@pytest.mark.cli_text
def test_off_a_terminal_a_tick_prints_one_line_not_every_targets(monkeypatch, capsys):
    """136 lines in one `make fuzz` log: every tick reprinted each target's line. Now one line per tick."""
    from kvfuzz.fuzz.cli import progress

    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    stats = [_stats(f"t{i}", 0, 0.0) for i in range(11)]
    with progress.CampaignProgress([s.target for s in stats], 200, None) as p:
        assert p.logging and not p.terminal
        for tick in range(60):  # a minute of updates, one a second
            now[0] += 1.0
            for s in stats:
                s.examples += 1
            p.update(stats)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(line.startswith("[") and line.count(" | ") == 11 for line in lines), lines


# ---- coverage lines capped ------------------------------------------------------------------------------------------
@pytest.mark.cli_text
def test_coverage_is_one_capped_line_unless_verbose():
    from kvfuzz.fuzz.cli.common import set_verbosity
    from kvfuzz.fuzz.cli.summary import LINE_CHARS, coverage_lines

    target = {"target": "vllm.unified_attention", "examples": 900,
              "coverage": {f"dimension{d}": {f"value{v}": v + 1 for v in range(40)} for d in range(30)},
              "declared": {"head_size": {str(h): 0 for h in range(32, 600, 16)}}}
    lines = coverage_lines(target)
    assert len(lines) == 2 and all(len(line) <= LINE_CHARS + 120 for line in lines), [len(x) for x in lines]
    assert "value39 40, value38 39, value37 38, +37 more" in lines[0] and "more dimensions (report.md" in lines[0]
    assert lines[1].endswith("head_size 144, +28 more")  # 36 values: 8 listed
    try:
        set_verbosity(1)
        full = coverage_lines(target)
    finally:
        set_verbosity(0)
    assert len(full) == 1 + 30 + 1 and "value0 1" in full[1]


# ---- project defaults: [tool.kvfuzz] --------------------------------------------------------------------------------
def _project(tmp_path, text: str):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n' + text)
    (tmp_path / "sub" / "deeper").mkdir(parents=True, exist_ok=True)
    return tmp_path / "sub" / "deeper"


@pytest.mark.cli_text
def test_project_defaults_come_from_the_nearest_pyproject_and_the_command_line_wins(tmp_path):
    here = _project(tmp_path, f'[tool.kvfuzz]\ntarget = ["{PLANTED}:Correct"]\nmax-examples = 3\n\n'
                              '[tool.kvfuzz.fuzz]\nout = "build/out"\nworkers = 1\n')
    r = kvfuzz("fuzz", cwd=here)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"config: {tmp_path / 'pyproject.toml'} [tool.kvfuzz] (max-examples, out, target, workers)" in r.stderr
    (t,) = json.loads((tmp_path / "build" / "out" / "summary.json").read_text())["targets"]
    assert (t["target"], t["examples"]) == ("planted.correct", 3)  # out is relative to pyproject.toml's folder
    r = kvfuzz("fuzz", "--max-examples", "2", "--out", here / "o", cwd=here)
    assert r.returncode == 0 and json.loads((here / "o" / "summary.json").read_text())["examples"] == 2
    r = kvfuzz("-q", "targets", "--json", cwd=here)  # a command the keys do not reach: its JSON stays JSON
    assert r.returncode == 0 and json.loads(r.stdout) and "config:" not in r.stderr


@pytest.mark.cli_text
@pytest.mark.parametrize("text, says", [
    ('[tool.kvfuzz.fuzz]\nduration = "soon"\n',
     "Invalid value for '--duration': 'soon': give seconds"),
    ('[tool.kvfuzz]\nbogus = 1\n', "[tool.kvfuzz] bogus: no kvfuzz command has an option --bogus"),
    ('[tool.kvfuzz.fuzz]\nshards = 4\n', "[tool.kvfuzz.fuzz] shards: kvfuzz fuzz has no option --shards"),
    ('[tool.kvfuzz.fuz]\nseed = 4\n', "[tool.kvfuzz.fuz]: not a kvfuzz command"),
    ('[tool.kvfuzz.fuzz]\nseed = [1, 2]\n', "[tool.kvfuzz.fuzz] seed: takes one value, not a list"),
    ('[tool.kvfuzz.fuzz]\nmax-examples = 0\n', "'--max-examples': 0 is not in the range"),
    ('[tool.kvfuzz\nseed = 1\n', "not valid TOML"),
])
def test_a_bad_project_default_exits_2_naming_the_file_and_the_key(tmp_path, text, says):
    here = _project(tmp_path, text)
    r = kvfuzz("fuzz", "--target", f"{PLANTED}:Correct", "--out", here / "o", cwd=here)
    assert r.returncode == 2 and says in r.stderr and str(tmp_path / "pyproject.toml") in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_pyproject_without_the_table_is_none_of_kvfuzzs_business(tmp_path, monkeypatch):
    """A project's other pyproject.toml, even a broken one, is passed over (its text has no [tool.kvfuzz])."""
    from kvfuzz.fuzz.cli.project import find_pyproject

    (tmp_path / "pyproject.toml").write_text("[tool.other\nbroken = ")
    assert find_pyproject(tmp_path) != tmp_path / "pyproject.toml"
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["fuzz", "--help"])
    assert r.exit_code == 0, r.output


@pytest.mark.cli_text
def test_bench_bugs_says_which_known_findings_a_campaign_met_and_let_pass(capsys):
    """With ``--baseline``, a campaign that met a live bug (vllm#56862 under bug.vllm-56579 on an H200) and went on
    says so on its line; one that met none says nothing more."""
    from kvfuzz.fuzz.cli import bench

    show = bench._bug_progress(live=False)
    run = {"bug": "bug.vllm-56579", "seed": 0, "found": False, "examples_total": 248, "seconds_total": 90.1}
    show({**run, "known_hits": ["vllm-56862"]})
    show({**run, "seed": 1, "known_hits": []})
    met, plain = capsys.readouterr().out.splitlines()
    assert met.endswith("; known, passed: vllm-56862") and "seed 0: not found" in met
    assert "known" not in plain and "seed 1: not found" in plain
