"""benchmarks/upstream_table.py: the table of an upstream test file run plainly and under the guard."""

import json
from pathlib import Path

import pytest
from support import benchmark_script

table = benchmark_script("upstream_table")

CLS = "tests.kernels.test_k"
NODE = "tests/kernels/test_k.py"


def _junit(path: Path, outcomes: dict[str, str]) -> str:
    cases = []
    for name, outcome in outcomes.items():
        child = {"passed": "", "failed": '<failure message="assert">x</failure>',
                 "error": '<error message="setup">x</error>', "skipped": '<skipped message="s"/>'}[outcome]
        cases.append(f'<testcase classname="{CLS}" name="{name}" time="0.1">{child}</testcase>')
    path.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                    + "".join(cases) + "</testsuite></testsuites>")
    return path.name


def _violation(check, severity, category="absent"):
    v = {"check": check, "severity": severity, "message": "m"}
    if category != "absent":
        v["category"] = category
    return v


REPORT = {
    "calls": {"vllm.decode_attention_fwd": 5}, "unchecked": {}, "stopped": 0,
    "failed_tests": [f"{NODE}::test_a[fp16-1]", f"{NODE}::test_c"],
    "records": [
        {"kernel": "vllm.decode_attention_fwd", "caller": "c", "test": f"{NODE}::test_a[fp16-1]", "index": 0,
         "violations": [_violation("index tensor dtype", "error", None), _violation("argument shapes", "error")]},
        {"kernel": "vllm.decode_attention_fwd", "caller": "c", "test": f"{NODE}::test_a[fp16-1]", "index": 1,
         "violations": [_violation("index tensor dtype", "error", None)]},
        {"kernel": "vllm.decode_attention_fwd", "caller": "c", "test": f"{NODE}::test_c", "index": 0,
         "violations": [_violation("index tensor dtype", "error", None),
                        _violation("head size support", "warning", "portability")]},
        {"kernel": "vllm.decode_attention_fwd", "caller": "c", "test": f"{NODE}::test_b", "index": 0,
         "violations": []},
    ],
}


@pytest.fixture
def outdir(tmp_path):
    plain = _junit(tmp_path / "p.xml", {"test_a[fp16-1]": "passed", "test_b": "passed", "test_c": "failed",
                                        "test_d": "skipped", "test_e": "passed"})
    guard = _junit(tmp_path / "g.xml", {"test_a[fp16-1]": "failed", "test_b": "passed", "test_c": "failed",
                                        "test_d": "skipped", "test_e": "error"})
    (tmp_path / "r.json").write_text(json.dumps(REPORT))
    runs = [[NODE, plain, guard, "r.json", "100.0", "110.0", "110.0", "135.0", "1", "1"],
            ["tests/other.py", plain, guard, "", "0", "4", "4", "6", "1", "1"],
            ["tests/broken.py", "missing.xml", "missing.xml", "missing.json", "0", "1", "1", "2", "4", "4"]]
    (tmp_path / "runs.tsv").write_text("".join("\t".join(r) + "\n" for r in runs))
    return tmp_path


def test_counts_and_tests_failed_by_the_guard_that_passed_plainly(outdir):
    row = table.summarize(table.read_runs(outdir)[0], outdir)
    assert row["plain"] == {"tests": 5, "passed": 3, "failed": 1, "skipped": 1}
    assert row["guard"] == {"tests": 5, "passed": 1, "failed": 3, "skipped": 1}
    # test_c failed in both runs: not the guard's doing; test_e errored under the guard without a check
    assert row["failed_by_guard_passed_plainly"] == [f"{NODE}::test_a[fp16-1]", f"{NODE}::test_e"]
    assert row["failed_by_check_passed_plainly"] == 1
    assert row["failed_tests_in_report"] == 2
    assert (row["plain_seconds"], row["guard_seconds"], row["ratio"]) == (10.0, 25.0, 2.5)


def test_checks_fired_with_severity_category_and_counts(outdir):
    row = table.summarize(table.read_runs(outdir)[0], outdir)
    assert row["checks"] == [
        {"check": "index tensor dtype", "severity": "error", "category": None, "violations": 3, "calls": 3,
         "tests": 2},
        {"check": "argument shapes", "severity": "error", "category": None, "violations": 1, "calls": 1,
         "tests": 1},
        {"check": "head size support", "severity": "warning", "category": "portability", "violations": 1,
         "calls": 1, "tests": 1},
    ]


def test_markdown_and_json_written(outdir):
    assert table.main([str(outdir)]) == 0
    md = (outdir / "upstream.md").read_text().splitlines()
    rows = [line for line in md if line.startswith("| tests/")]
    assert len(rows) == 3
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[:5] == [NODE, "5", "3", "1 / 3", "2 (1 by a check)"]
    assert "index tensor dtype (error, 3× in 2 tests)" in cells[5]
    assert "head size support (warning, portability, 1× in 1 tests)" in cells[5]
    assert cells[6:] == ["10.0 s", "25.0 s", "2.50×"]
    # no report for the second file (a plugin without --kvfuzz-guard-report); nothing at all for the third
    other = [c.strip() for c in rows[1].strip("|").split("|")]
    assert other[4:6] == ["2", "no guard report"]
    broken = [c.strip() for c in rows[2].strip("|").split("|")]
    assert broken[1:6] == ["no junit (rc 4)", "no junit (rc 4)", "no junit (rc 4)", "0", "no guard report"]
    data = json.loads((outdir / "upstream.json").read_text())
    assert [r["file"] for r in data] == [NODE, "tests/other.py", "tests/broken.py"]
    assert data[1]["guard_report"] is False and "checks" not in data[1]


@pytest.mark.parametrize("nodeid", [
    "tests/kernels/attention/test_prefix_prefill.py::test_contexted_kv_attention[1-auto-cuda:0-0-fp16-128-1-64]",
    "test_x.py::TestClass::test_m[a/b::c]",
    "tests/sub/test_y.py::test_plain",
])
def test_junit_address_matches_pytests_junitxml_and_back(nodeid):
    mangle = pytest.importorskip("_pytest.junitxml").mangle_test_address
    names = mangle(nodeid)
    assert table.junit_address(nodeid) == (".".join(names[:-1]), names[-1])
    assert table.nodeid(nodeid.split("::")[0], *table.junit_address(nodeid)) == nodeid
