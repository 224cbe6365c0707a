"""The test suite's own rules, read off its source (no kernels, no subprocess but one ``kvfuzz --help``): the
kvfuzz command is run through the one helper in tests/support/__init__.py, and no test passes an unavailable
target by skipping its body in silence (it skips, naming why, or asserts that it checked something)."""

import ast
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


def rooms() -> set[str]:
    """The rooms of tests/: every folder holding test modules (the whole-package tests at the top as "."), but
    the helpers and the guard's seeds scenario (collected only when a guard test runs it)."""
    return {str(p.parent.relative_to(HERE)) for p in MODULES if p.name.startswith("test_")
            and "seeds_scenario" not in p.parts}


def quick_gaps(quick: tuple[str, ...]) -> list[str]:
    """What is wrong with a QUICK list (conftest.py): an entry naming no module or test any more, a room without
    a quick test, no quick module running a real kernel."""
    out = []
    for entry in quick:
        path, _, name = entry.partition("::")
        module = HERE.parent / path
        if not module.is_file() or (name and f"def {name}(" not in module.read_text()):
            out.append(f"{entry}: no such test")
    covered = {str((HERE.parent / q.partition("::")[0]).parent.relative_to(HERE)) for q in quick}
    out += [f"room {r} has no quick test" for r in sorted(rooms() - covered)]
    if not any("pytest.mark.kernel" in (HERE.parent / q.partition("::")[0]).read_text()
               for q in quick if (HERE.parent / q.partition("::")[0]).is_file()):
        out.append("no quick module runs a real kernel")
    return out


def test_the_quick_run_touches_every_room_and_real_kernels():
    """``make test`` runs the tests conftest.py's QUICK lists (``pytest -m quick``); CI runs the rest after it."""
    # read, not imported: "conftest" may name another conftest.py here (the guard's seeds scenario)
    tree = ast.parse((HERE.parent / "conftest.py").read_text())
    QUICK = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["QUICK"])

    assert {"contracts", "strategies", "fuzz/harness", "fuzz/guard", "fuzz/targets", "."} <= rooms()
    assert quick_gaps(QUICK) == []
    # planted: a renamed test, a room left out, no kernel
    assert quick_gaps(("tests/test_docs.py::test_gone",))[0] == "tests/test_docs.py::test_gone: no such test"
    assert "room fuzz/campaign has no quick test" in quick_gaps(tuple(q for q in QUICK if "/campaign/" not in q))
    assert quick_gaps(("tests/test_docs.py",))[-1] == "no quick module runs a real kernel"
    # CI runs make test, then everything else exactly once
    ci = (HERE.parent / ".ci" / "run").read_text()
    make = (HERE.parent / "Makefile").read_text()
    assert re.search(r"^test: setup\n\t\$\(BIN\)/python -m pytest -q -m quick$", make, re.M), make
    assert "\nmake test\n" in ci and '-m "not quick"' in ci
