"""The project's style rules run in CI: ruff with the rules pyproject.toml's [tool.ruff] selects (pyflakes: unused
imports and names; isort: import order, kvfuzz first-party; E501: lines over 120 characters), over every Python file
of the repository."""

import subprocess
import sys

from support import ROOT


def ruff(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_ruff_passes_on_the_repository():
    r = ruff("check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_fails_on_a_planted_violation(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    long_line = f"print({' '.join(['word'] * 30)!r})\n"  # 158 characters (one word alone would be exempt)
    (tmp_path / "planted.py").write_text("import sys\nimport os\n\nprint(os.sep)\n" + long_line)  # unsorted, sys unused
    r = ruff("check", "--no-cache", "planted.py", cwd=tmp_path)
    assert r.returncode == 1 and "I001" in r.stdout and "F401" in r.stdout and "E501" in r.stdout, r.stdout + r.stderr
