"""`make setup` reads like a clean install (issue 48, 9): no pip resolver ERROR (vLLM, installed with --no-deps,
goes last: pip checks the installed packages' requirements after every install it resolves, never after a --no-deps
one), no setuptools deprecation of the license table, no "Package would be ignored" for the bugs' patch folder. Run
in a fresh venv, setup printed none of them (docs/install.md); these check the three causes without a network."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_recipe() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("$(STAMP): pyproject.toml Makefile\n", 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in recipe.splitlines()]


def test_vllm_is_installed_last_and_alone_without_its_dependencies():
    installs = [line for line in _setup_recipe() if re.search(r"pip install\b", line)]
    assert installs[-1].endswith("--no-deps $(VLLM_PIN)"), installs
    assert sum("$(VLLM_PIN)" in line for line in installs) == 1


def test_the_license_is_an_spdx_expression():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == "setuptools>=77"  # the first to read project.license as an SPDX string


def test_the_patch_folder_is_a_package_of_its_own():
    setup = (ROOT / "setup.py").read_text()
    assert '"kvfuzz.fuzz.bench.bugs.patches"' in setup and '{"kvfuzz.fuzz.bench.bugs.patches": ["*.patch"]}' in setup
