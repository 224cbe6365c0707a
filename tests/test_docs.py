"""The documentation stays true to the code: every command and option of docs/cli.md (and the README's command list)
against the click commands of kvfuzz.fuzz.cli, with the defaults the code gives them; the documented chunk sizes
against the campaign's constants; every file of benchmarks/results/ in docs/benchmarks.md's index, every script of
benchmarks/ in its README; the README a front door (at most 250 lines, none over 160 characters). Each checker is
also fed a planted drift to show it fails. No kernel runs here."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import click

from kvfuzz.fuzz.cli import main


def _repo_root() -> Path:
    """The checkout this test file is in: the nearest folder above it with README.md and docs/."""
    for folder in Path(__file__).resolve().parents:
        if (folder / "README.md").is_file() and (folder / "docs").is_dir():
            return folder
    raise FileNotFoundError("no README.md with a docs/ folder above this test")


ROOT = _repo_root()
CLI_DOC = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
UNSET = "—"  # docs/cli.md's default cell for an option without a default


def leaf_commands(group: click.Group = main, path: tuple[str, ...] = ("kvfuzz",)) -> dict[str, click.Command]:
    """Every runnable command under ``group``, by its full name ("kvfuzz bench curve")."""
    found = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            found |= leaf_commands(cmd, (*path, name))
        else:
            found[" ".join((*path, name))] = cmd
    return found


def code_default(param: click.Option) -> str:
    """An option's default as docs/cli.md writes it: "off" for a flag, ``UNSET`` when there is none, else the
    value (a repeatable option's values joined with ", ")."""
    if param.is_flag:
        return "off"
    d = param.default
    if d is None or d == () or type(d).__name__ == "Sentinel" or callable(d):
        return UNSET
    if isinstance(d, (tuple, list)):
        return ", ".join(str(x) for x in d)
    return str(d)


def code_options() -> dict[str, dict[str, str]]:
    """``{command: {option: default}}`` from the click commands."""
    return {name: {p.opts[0]: code_default(p) for p in cmd.params if isinstance(p, click.Option)}
            for name, cmd in leaf_commands().items()}


def doc_options(text: str) -> dict[str, dict[str, str]]:
    """``{command: {option: default}}`` from docs/cli.md's text: each "## `kvfuzz ...`" section's table rows
    "| `--option META` | default | ... |", the default cell's backticks dropped (several values joined with ", ")."""
    doc: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^## `(kvfuzz(?: [a-z-]+)+)`\s*$", line)
        if m:
            current = doc.setdefault(m.group(1), {})
            continue
        if line.startswith("## "):
            current = None
            continue
        row = re.match(r"^\| `(--[a-z0-9-]+)[^`]*` \| ([^|]*) \|", line)
        if current is not None and row:
            cell = row.group(2).strip()
            values = re.findall(r"`([^`]*)`", cell)
            current[row.group(1)] = ", ".join(values) if values else cell
    return doc


def _same(doc: str, code: str) -> bool:
    if doc == code:
        return True
    try:
        return float(doc.replace(",", "")) == float(code)
    except ValueError:
        return False


def cli_doc_drift(text: str) -> list[str]:
    """What ``text`` (docs/cli.md) says that the code does not, or leaves out; empty when they agree."""
    doc, code = doc_options(text), code_options()
    problems = [f"{c}: not documented (no '## `{c}`' section)" for c in code if c not in doc]
    problems += [f"{c}: documented but not a command" for c in doc if c not in code]
    for c in code.keys() & doc.keys():
        for opt, default in code[c].items():
            if opt not in doc[c]:
                problems.append(f"{c} {opt}: not documented")
            elif not _same(doc[c][opt], default):
                problems.append(f"{c} {opt}: documented default {doc[c][opt]!r}, the code's is {default!r}")
        problems += [f"{c} {opt}: documented but not an option" for opt in doc[c] if opt not in code[c]]
    return problems


def readme_command_drift(text: str) -> list[str]:
    """Commands missing from the README's "## Commands" list (one per line, "kvfuzz NAME ...")."""
    section = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    listed = {" ".join(m.split()) for m in re.findall(r"^\s+(kvfuzz(?: [a-z][a-z-]*)+)", section, re.M)}
    return [f"{c}: not in the README's command list" for c in leaf_commands() if c not in listed]


def exit_status_drift(text: str) -> list[str]:
    """Commands whose docs/cli.md section has no "Exit status:" table, or whose table leaves out status 0 or the
    interrupted ending (3, which every command has: Ctrl-C, SIGTERM, SIGHUP); empty when every command has one."""
    problems = []
    for name in leaf_commands():
        head = f"## `{name}`"
        if head not in text:
            continue  # cli_doc_drift reports the missing section
        section = text.split(head, 1)[1].split("\n## ", 1)[0]
        if "Exit status:" not in section:
            problems.append(f"{name}: no exit status table")
            continue
        table = section.split("Exit status:", 1)[1]
        statuses = set(re.findall(r"^\| `(\d)` \|", table, re.M))
        problems += [f"{name}: exit status {s} not listed" for s in ("0", "3") if s not in statuses]
        if "interrupted" not in table:
            problems.append(f"{name}: the interrupted ending is not listed")
    return problems


# ---- docs/cli.md and the README against the code ----
def test_cli_doc_lists_every_commands_exit_statuses():
    assert exit_status_drift(CLI_DOC) == []
    section = CLI_DOC.split("## `kvfuzz replay`", 1)[1].split("\n## ", 1)[0]
    planted = CLI_DOC.replace(section, section.split("Exit status:", 1)[0])
    assert exit_status_drift(planted) == ["kvfuzz replay: no exit status table"]
    row = "| `3` | interrupted: Ctrl-C, SIGTERM or SIGHUP"  # kvfuzz targets' only status 3
    planted = CLI_DOC.replace(row, row.replace("`3`", "`4`"))
    assert exit_status_drift(planted) == ["kvfuzz targets: exit status 3 not listed"]


def test_cli_doc_lists_every_command_and_option_with_the_codes_default():
    assert cli_doc_drift(CLI_DOC) == []


def test_cli_doc_checker_catches_a_wrong_default():
    section = CLI_DOC.split("## `kvfuzz fuzz`", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| `--seed "))
    planted = CLI_DOC.replace(row, row.replace("| `0` |", "| `7` |"), 1)
    assert planted != CLI_DOC
    assert cli_doc_drift(planted) == ["kvfuzz fuzz --seed: documented default '7', the code's is '0'"]


def test_cli_doc_checker_catches_a_missing_option_an_invented_one_and_a_missing_command():
    planted = "\n".join(line for line in CLI_DOC.splitlines() if not line.startswith("| `--chunk-examples "))
    planted = planted.replace("| `--warmup N` |", "| `--warm-up N` |", 1)
    planted = planted.replace("## `kvfuzz bench curve`", "## `kvfuzz bench curves`", 1)
    problems = cli_doc_drift(planted)
    assert "kvfuzz fuzz --chunk-examples: not documented" in problems
    assert "kvfuzz fuzz --warmup: not documented" in problems
    assert "kvfuzz fuzz --warm-up: documented but not an option" in problems
    assert "kvfuzz bench curve: not documented (no '## `kvfuzz bench curve`' section)" in problems
    assert "kvfuzz bench curves: documented but not a command" in problems


def test_readme_lists_every_command():
    assert readme_command_drift(README) == []
    assert readme_command_drift(README.replace("kvfuzz bench curve", "kvfuzz bench")) == [
        "kvfuzz bench curve: not in the README's command list"]


def test_readme_is_a_front_door():
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 160]
    assert not long, f"README.md lines over 160 characters: {long}"
    for page in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / page).is_file(), f"README links {page}, which does not exist"
    assert history_in_prose(README) == []


def history_in_prose(text: str) -> list[str]:
    """Commit hashes and issue numbers in ``text``'s prose (code blocks, indented or fenced, left out): the
    README says what is, and the history lives in git."""
    prose, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            prose.append(line)
    return re.findall(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|\b[Ii]ssues? #?\d+|(?<![\w/])#\d+\b",
                      "\n".join(prose))


def test_history_checker_finds_a_hash_and_an_issue_number():
    assert history_in_prose("measured at b76db29 (issue 21); a hash in a sample:\n    out-6206480da1\n") == [
        "b76db29", "issue 21"]


# ---- the chunk size ----

def _campaign_constant(name: str) -> int:
    """``name`` from whichever module of kvfuzz.fuzz.campaign defines it (modules may move between its folders)."""
    package = importlib.import_module("kvfuzz.fuzz.campaign")
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        if name in vars(module):
            return vars(module)[name]
    raise LookupError(f"no module of kvfuzz.fuzz.campaign defines {name}")


def chunk_size_drift(texts: dict[str, str], pinned: int, free: int) -> list[str]:
    """Every statement of the default chunk size in ``texts`` ({page: text}) that differs from the code's."""
    patterns = [  # (page, regex with the pinned size as group 1 and, where stated, the free size as group 2)
        ("docs/cli.md", r"Default: ([\d,]+) pinned, ([\d,]+) free"),
        ("docs/campaigns.md", r"the rest of the chunk \(([\d,]+) examples by default"),
        ("docs/fuzzing.md", r"`--chunk-examples`, ([\d,]+) by default when pinned"),
    ]
    problems = []
    for page, pattern in patterns:
        m = re.search(pattern, " ".join(texts[page].split()))
        if m is None:
            problems.append(f"{page}: the chunk size statement is gone (pattern {pattern!r})")
            continue
        said = [int(g.replace(",", "")) for g in m.groups()]
        if said != [pinned, free][:len(said)]:
            problems.append(f"{page}: says {said}, the code's default is {[pinned, free][:len(said)]}")
    return problems


def test_documented_chunk_sizes_are_the_codes():
    pages = {p: (ROOT / p).read_text(encoding="utf-8") for p in ("docs/cli.md", "docs/campaigns.md", "docs/fuzzing.md")}
    pinned, free = _campaign_constant("PINNED_CHUNK_EXAMPLES"), _campaign_constant("CHUNK_EXAMPLES")
    assert chunk_size_drift(pages, pinned, free) == []
    stale = dict(pages, **{"docs/campaigns.md": pages["docs/campaigns.md"].replace(
        f"the rest of the chunk ({pinned:,} examples", "the rest of the chunk (200 examples")})
    assert chunk_size_drift(stale, pinned, free) == [f"docs/campaigns.md: says [200], the code's default is [{pinned}]"]


# ---- the index of benchmarks/results/ ----

def expand(pattern: str) -> set[str]:
    """File names a pattern of docs/benchmarks.md's index names: ``{a,b}`` alternatives, ``[x]`` optional."""
    m = re.search(r"\{([^{}]*)\}|\[([^\[\]]*)\]", pattern)
    if m is None:
        return {pattern}
    options = m.group(1).split(",") if m.group(1) is not None else [m.group(2), ""]
    return set().union(*(expand(pattern[:m.start()] + o + pattern[m.end():]) for o in options))


def unindexed_results(index_text: str, files: list[str]) -> list[str]:
    names = set().union(*(expand(p) for p in re.findall(r"`([^`\s]+\.[^`\s]+)`", index_text)))
    return sorted(f for f in files if f not in names)


def test_every_benchmark_result_is_in_the_index():
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    index = text.split("## The files in benchmarks/results/", 1)[1]
    files = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir() if p.is_file())
    assert files and unindexed_results(index, files) == []
    assert unindexed_results(index, [*files, "curve-b300.json"]) == ["curve-b300.json"]



def unnamed_scripts(readme: str, folder: Path) -> list[str]:
    """Scripts of ``folder`` (benchmarks/: its .py and .sh files, those of adapters/, and repro/) that ``readme``
    does not name in backticks."""
    names = set(re.findall(r"`([^`\s]+)`", readme))
    scripts = [p.name for p in folder.iterdir() if p.suffix in (".py", ".sh")]
    scripts += [f"adapters/{p.name}" for p in (folder / "adapters").glob("*.py")] + ["repro/"]
    return sorted(s for s in scripts if s not in names)


def test_the_benchmarks_readme_names_every_script():
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    assert unnamed_scripts(readme, ROOT / "benchmarks") == []
    assert unnamed_scripts(readme.replace("`pyspy_top.py`", "pyspy_top"), ROOT / "benchmarks") == ["pyspy_top.py"]
    assert history_in_prose(readme) == []

# ---- defaults stated in the prose of other pages ----

#: (page, regex whose group 1 is the stated default, command, option): every default the docs state outside cli.md.
PROSE_DEFAULTS = [
    ("docs/campaigns.md", r"`--max-crashes` times \(default (\d+)\)", "kvfuzz fuzz", "--max-crashes"),
    ("docs/campaigns.md", r"`--structural-shrink` seconds \(`CampaignConfig.structural_shrink`, default (\d+)",
     "kvfuzz fuzz", "--structural-shrink"),
    ("docs/fuzzing.md", r"`--structural-shrink` seconds \((\d+)\)", "kvfuzz fuzz", "--structural-shrink"),
    ("docs/fuzzing.md", r"`--out` \(default `([^`]+?)/?`\)", "kvfuzz fuzz", "--out"),
]


def prose_default_drift(texts: dict[str, str]) -> list[str]:
    code = code_options()
    problems = []
    for page, pattern, command, option in PROSE_DEFAULTS:
        m = re.search(pattern, " ".join(texts[page].split()))
        if m is None:
            problems.append(f"{page}: the statement of {option}'s default is gone (pattern {pattern!r})")
        elif not _same(m.group(1), code[command][option]):
            problems.append(f"{page}: {option} defaults to {m.group(1)!r}, the code's is {code[command][option]!r}")
    return problems


def test_defaults_stated_in_prose_are_the_codes():
    pages = {p: (ROOT / p).read_text(encoding="utf-8") for p in {page for page, *_ in PROSE_DEFAULTS}}
    assert prose_default_drift(pages) == []
    planted = dict(pages, **{"docs/campaigns.md": pages["docs/campaigns.md"].replace("times (default 10)",
                                                                                      "times (default 5)")})
    assert prose_default_drift(planted) == ["docs/campaigns.md: --max-crashes defaults to '5', the code's is '10'"]
