"""The test suite's own rules, read off its source (no kernels, no subprocess but one ``kvfuzz --help``): the
kvfuzz command is run through the one helper in tests/support/__init__.py, and no test passes an unavailable
target by skipping its body in silence (it skips, naming why, or asserts that it checked something)."""

import re
from pathlib import Path

from support import KVFUZZ, kvfuzz

HERE = Path(__file__).resolve().parent
MODULES = sorted(p for p in HERE.rglob("*.py") if p.parent.name != "support")


def _hits(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [f"{p.name}:{i}: {line.strip()}" for p in MODULES
            for i, line in enumerate(p.read_text().splitlines(), 1) if rx.search(line)]


def test_the_rules_read_every_test_module():
    assert len(MODULES) > 10 and HERE / "test_test_suite.py" in MODULES


def test_the_kvfuzz_command_runs_only_through_the_shared_helper():
    """One helper (timeout, working directory, environment) rather than a copy per module that drifts."""
    assert _hits(r"^def kvfuzz\(") == []
    assert _hits(r"""["']-m["'],\s*["']kvfuzz\.fuzz\.cli["']""") == []


def test_no_test_runs_its_body_only_when_a_target_is_available():
    """A body guarded by the target's availability being ok passes having checked nothing where the kernel is
    missing: skip with ``support.available(name)`` (or ``pytest.skip`` naming why) instead."""
    assert _hits(r"\bif\s+(?!not\b)[^#\n]*\bavail(ability\(\))?\.ok\s*:") == []
    assert _hits(r"\bif\s+(?!not\b)[^#\n]*\bAVAIL\.ok\s*:") == []


def test_the_helper_runs_the_command_from_anywhere(tmp_path):
    r = kvfuzz("--help", cwd=tmp_path, timeout=300)
    assert r.returncode == 0 and "fuzz" in r.stdout, r.stdout + r.stderr
    assert KVFUZZ[-1] == "kvfuzz.fuzz.cli"
