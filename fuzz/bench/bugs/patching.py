"""Apply a unified diff to a copy of an installed module's source and load the result as a private module.

The installed package is never edited: the patched source is written to a private folder of this process
(``tempfile``), outside site-packages, and imported from there under a module name of its own
(``kvfuzz_bug_<slug>.<original name>``), so the real module and its users stay as they are. Triton's JIT reads a
kernel's source with ``inspect``, which needs a file: hence a file, not ``exec`` of a string. The file keeps the
upstream module's basename (in a folder of its own per private module), so a memcheck report on the copy names
the upstream file and line, as a known finding's ``locations`` do (vllm#56862 at triton_unified_attention.py:432
under the unified kernel's re-injected bugs).

A patch is a unified diff (``diff -u``) with free text before its first ``---`` line (the header saying what
the upstream fix changed and what undoing it does). It must apply exactly: every hunk's context and removed
lines must match the installed file (at the hunk's line or anywhere else, the nearest match first); otherwise
:class:`PatchDoesNotApply` names the patch, the file and the first line that differs.
"""

from __future__ import annotations

import atexit
import importlib.util
import re
import shutil
import sys
import tempfile
import types
from pathlib import Path

import attrs

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchDoesNotApply(ValueError):
    """A patch whose context no longer matches the installed file (upstream changed it): the re-injected bug
    must be re-derived against the new source."""


@attrs.frozen
class Hunk:
    """One hunk: its old start line (1-based), the old lines (context and removed) and the new lines (context
    and added), without their ``' '``/``-``/``+`` prefixes."""

    old_start: int
    old: tuple[str, ...]
    new: tuple[str, ...]


@attrs.frozen
class Patch:
    """A parsed unified diff of one file: ``header`` (the text before ``---``), ``path`` (the file, relative to
    the package root, from the ``+++ b/...`` line), its hunks, and ``name`` (where it came from, for messages)."""

    name: str
    header: str
    path: str
    hunks: tuple[Hunk, ...]

    @classmethod
    def parse(cls, text: str, name: str = "<patch>") -> "Patch":
        """Parse ``text``; raises ValueError naming ``name`` when it is not a one-file unified diff."""
        patches = parse_patches(text, name)
        if len(patches) > 1:
            raise ValueError(f"patch {name}: more than one file (one patch re-injects one file)")
        return patches[0]

    @classmethod
    def read(cls, path: Path) -> "Patch":
        return cls.parse(Path(path).read_text(), name=str(path))

    def apply(self, source: str, file: str | Path = "<source>") -> str:
        """``source`` with every hunk applied. Raises :class:`PatchDoesNotApply` naming this patch, ``file``
        and the first line of the first hunk that matches nowhere."""
        lines = source.splitlines()
        trailing = source.endswith("\n")
        offset = 0
        for n, h in enumerate(self.hunks, 1):
            want = list(h.old)
            at = _find(lines, want, h.old_start - 1 + offset)
            if at is None:
                expected = h.old_start - 1 + offset
                got = lines[expected:expected + len(want)]
                diff = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                exp_line = want[diff] if diff < len(want) else "<end of hunk>"
                got_line = got[diff] if diff < len(got) else "<end of file>"
                raise PatchDoesNotApply(
                    f"patch {self.name} no longer applies to {file}: hunk {n} of {len(self.hunks)} (old line "
                    f"{h.old_start}) matches nowhere in the file; at line {expected + diff + 1} the patch expects "
                    f"{exp_line!r} but the file has {got_line!r}. The installed source changed: re-derive the "
                    "re-injection against it (see the patch's header for what the upstream fix changed)")
            lines[at:at + len(want)] = list(h.new)
            offset = at - (h.old_start - 1) + len(h.new) - len(want)
        return "\n".join(lines) + ("\n" if trailing else "")


#: git's extended header lines, left out of a patch's header text.
_GIT_HEADER = ("diff --git ", "index ", "new file mode ", "deleted file mode ", "similarity index ")


def _file_start(lines: list[str], i: int) -> bool:
    return lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")


def parse_patches(text: str, name: str = "<patch>") -> tuple[Patch, ...]:
    """Parse a unified diff of one or more files (``git diff`` output included) into one :class:`Patch` per
    file, in order. The free text before the first ``---`` line (git's ``diff --git``/``index`` lines left out)
    is the first patch's header; the others have none. Raises ValueError naming ``name`` when ``text`` holds no
    file, a file no hunk, a hunk is truncated or holds an unexpected line, or a file appears twice."""
    lines = text.splitlines()
    starts = [i for i in range(len(lines)) if _file_start(lines, i)]
    if not starts:
        raise ValueError(f"patch {name}: no '--- a/FILE' / '+++ b/FILE' lines (not a unified diff)")
    header = "\n".join(ln for ln in lines[:starts[0]] if not ln.startswith(_GIT_HEADER)).strip()
    patches: list[Patch] = []
    i = starts[0]
    while i < len(lines):
        path = lines[i + 1][4:].split("\t")[0].strip()
        path = path[2:] if path.startswith("b/") else path
        hunks: list[Hunk] = []
        i += 2
        while i < len(lines) and not _file_start(lines, i):
            m = _HUNK.match(lines[i])
            if not m:  # text between hunks or files (git's "diff --git" and "index" lines)
                i += 1
                continue
            old_n = int(m.group(2) if m.group(2) is not None else 1)
            new_n = int(m.group(4) if m.group(4) is not None else 1)
            old, new = [], []
            i += 1
            while (len(old) < old_n or len(new) < new_n) and i < len(lines):
                ln = lines[i]
                tag, body = (ln[:1], ln[1:]) if ln else (" ", "")
                if tag == " ":
                    old.append(body)
                    new.append(body)
                elif tag == "-":
                    old.append(body)
                elif tag == "+":
                    new.append(body)
                elif tag != "\\":  # "\ No newline at end of file"
                    raise ValueError(f"patch {name}: {path}: hunk at old line {m.group(1)}: unexpected line {ln!r}")
                i += 1
            if len(old) != old_n or len(new) != new_n:
                raise ValueError(f"patch {name}: {path}: hunk at old line {m.group(1)} is truncated")
            hunks.append(Hunk(int(m.group(1)), tuple(old), tuple(new)))
        if not hunks:
            raise ValueError(f"patch {name}: {path}: no hunks")
        if any(p.path == path for p in patches):
            raise ValueError(f"patch {name}: {path} appears twice")
        patches.append(Patch(name, header if not patches else "", path, tuple(hunks)))
    return tuple(patches)


def _find(lines: list[str], want: list[str], near: int) -> int | None:
    """The start index of ``want`` in ``lines`` nearest to ``near`` (ties: the earlier), or None."""
    if not want:
        return max(0, min(near, len(lines)))
    n = len(want)
    starts = [i for i in range(len(lines) - n + 1) if lines[i] == want[0] and lines[i:i + n] == want]
    return min(starts, key=lambda i: (abs(i - near), i)) if starts else None


_PRIVATE_ROOT: Path | None = None


def _private_root() -> Path:
    global _PRIVATE_ROOT
    if _PRIVATE_ROOT is None:
        _PRIVATE_ROOT = Path(tempfile.mkdtemp(prefix="kvfuzz-bugs-"))
        atexit.register(shutil.rmtree, _PRIVATE_ROOT, True)  # the patched copies live as long as this process
    return _PRIVATE_ROOT


def load_patched(patch: Patch, installed: Path, private_name: str, package: str,
                 globals_: dict | None = None) -> types.ModuleType:
    """Apply ``patch`` to the source of ``installed`` (the upstream module's file) and import the result as the
    private module ``private_name`` (registered in ``sys.modules``; loaded once per process). ``package``: the
    original module's package, so its relative imports resolve as upstream's do. ``globals_``: names set in
    the module before its body runs (none by default). Raises :class:`PatchDoesNotApply`, or FileNotFoundError
    when ``installed`` is missing."""
    if private_name in sys.modules:
        return sys.modules[private_name]
    source = patch.apply(Path(installed).read_text(), installed)
    return load_source(source, private_name, package, globals_)


def load_source(source: str, private_name: str, package: str, globals_: dict | None = None) -> types.ModuleType:
    """Write ``source`` to this process's private folder and import it as ``private_name`` (see
    :func:`load_patched`)."""
    if private_name in sys.modules:
        return sys.modules[private_name]
    folder = _private_root() / private_name.replace(".", "_")
    folder.mkdir(exist_ok=True)
    path = folder / (private_name.rpartition(".")[2] + ".py")  # the upstream basename (module docstring)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(private_name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    module.__dict__.update(globals_ or {})
    sys.modules[private_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[private_name]
        raise
    return module


__all__ = ["Hunk", "Patch", "PatchDoesNotApply", "load_patched", "load_source", "parse_patches"]
