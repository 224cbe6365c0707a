"""A patched copy of a whole installed package, for bugs in files a JIT compiles (FlashInfer's CUDA headers).

:mod:`.patching` re-injects a bug into one Python module, loaded under a private name. That cannot reach a bug
in FlashInfer's CUDA sources: flashinfer-python ships them in the package (``flashinfer/data/include/...``) and
its JIT compiles them with nvcc on first use of each module. flashinfer/jit/env.py finds them from its own file
(``_package_root = Path(__file__).resolve().parents[1]``, then ``FLASHINFER_INCLUDE_DIR = _package_root / "data"
/ "include"``) and caches the compiled modules under ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/
<arch>/`` (read once, when ``flashinfer.jit.env`` is imported), keyed by version, architecture and module name,
not by the sources' content. So a re-injected FlashInfer bug needs:

- a copy of the whole package with the patch applied (:func:`build_copy`): the package's files hard-linked
  (copied where the file system refuses a link), each patched file written as a new file, so the installed
  package is never edited; ``data/aot`` (prebuilt modules that would win over the JIT) left out;
- a JIT workspace of its own (``<copy>/jit``), so the patched build never reuses the installed package's
  compiled modules nor overwrites them;
- the copy imported as ``flashinfer`` before anything imports the installed one (:func:`import_copy`): its
  folder first on ``sys.path`` and ``FLASHINFER_WORKSPACE_BASE`` set to its workspace while ``import flashinfer``
  runs, both restored afterwards (processes started later, e.g. campaign workers, inherit neither). One copy per
  process: the package imports itself by its own name, so a process holds one ``flashinfer``.

Copies live under :func:`copies_root` (``$KVFUZZ_BUG_COPIES``, else ``<tmp>/kvfuzz-bug-copies``), one folder per
bug and content key (:meth:`PackageCopy.key`: the patches, the installed files they edit, the package's place
and version), so the processes of one campaign or benchmark (seeds, workers) share one copy and its compiled
modules, and a changed patch or package gets a fresh one. A copy is built in a temporary folder and renamed into
place, so concurrent builders never see a half-built one.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import attrs

from kvfuzz.fuzz.bench.bugs.patching import Patch

#: The module attribute :func:`import_copy` sets on the imported copy: "<name> (<folder>)". The targets refuse a
#: process whose package is a copy (kvfuzz.fuzz.targets.flashinfer.PATCHED_COPY_ATTR is the same name).
MARK = "__kvfuzz_patched__"


class CopyConflict(RuntimeError):
    """The package is already imported in this process from somewhere else than this copy: a re-injected bug's
    copy must be the first import of the package in its process."""


@attrs.frozen
class PackageCopy:
    """A patched copy of installed ``package`` for bug ``name`` (``flashinfer-350``).

    ``patches``: the files it changes (paths relative to the folder holding the package, ``flashinfer/...``);
    ``workspace_env``: the environment variable the package reads its JIT workspace from at import
    (``FLASHINFER_WORKSPACE_BASE``); ``exclude``: paths inside the package left out of the copy (``data/aot``)."""

    name: str
    package: str
    patches: tuple[Patch, ...]
    workspace_env: str
    exclude: tuple[str, ...] = ()

    def installed(self) -> Path | None:
        """The installed package's folder, found on ``sys.path`` without importing it and never a copy
        (folders under :func:`copies_root` are skipped); None when it is not installed."""
        root = copies_root().resolve()
        path = [p for p in sys.path if not _under(Path(p or "."), root)]
        spec = importlib.machinery.PathFinder.find_spec(self.package, path)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(list(spec.submodule_search_locations)[0])

    def key(self, installed: Path) -> str:
        """The copy's content key: a digest of the patches, the installed files they edit, the installed
        package's folder and its version (from ``_build_meta.py``/``version.py`` when present)."""
        h = hashlib.sha256()
        h.update(str(installed.resolve()).encode())
        for f in ("_build_meta.py", "version.py"):
            if (installed / f).is_file():
                h.update((installed / f).read_bytes())
        for p in self.patches:
            h.update(p.path.encode())
            h.update(repr(p.hunks).encode())
            f = installed.parent / p.path
            h.update(f.read_bytes() if f.is_file() else b"<missing>")
        return h.hexdigest()[:16]

    def folder(self, installed: Path) -> Path:
        """Where this copy lives: ``<copies_root>/<name>-<key>`` (``site/<package>``: the copy; ``jit``: its
        workspace)."""
        return copies_root() / f"{self.name}-{self.key(installed)}"

    def patched_sources(self, installed: Path) -> dict[str, str]:
        """Each patched file's new text by its path (relative to the folder holding the package). Raises
        :class:`~.patching.PatchDoesNotApply` naming the patch and the installed file, FileNotFoundError when the
        patch names a file the package does not have."""
        out = {}
        for p in self.patches:
            f = installed.parent / p.path
            if not f.is_file():
                raise FileNotFoundError(f"patch {p.name} edits {p.path}, which the installed {self.package} "
                                        f"({installed}) does not have")
            out[p.path] = p.apply(f.read_text(), f)
        return out


def copies_root() -> Path:
    """The folder holding every patched copy: ``$KVFUZZ_BUG_COPIES``, else ``<tmp>/kvfuzz-bug-copies``."""
    return Path(os.environ.get("KVFUZZ_BUG_COPIES") or Path(tempfile.gettempdir()) / "kvfuzz-bug-copies")


def _under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError):
        return False
    return True


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a copy
        shutil.copy2(src, dst)


def build_copy(copy: PackageCopy, installed: Path | None = None) -> Path:
    """The folder of ``copy`` (:meth:`PackageCopy.folder`), built if absent: ``site/<package>`` (the installed
    package hard-linked or copied, ``copy.exclude`` and ``__pycache__`` left out, each patched file written anew)
    and an empty ``jit`` workspace. Idempotent and safe against concurrent builders. Raises
    :class:`~.patching.PatchDoesNotApply` (before anything is written) or FileNotFoundError when the package is
    not installed."""
    installed = installed or copy.installed()
    if installed is None:
        raise FileNotFoundError(f"{copy.name}: python package {copy.package!r} is not installed")
    sources = copy.patched_sources(installed)
    final = copy.folder(installed)
    if (final / "COPY.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        excluded = {(installed / e).resolve() for e in copy.exclude}

        def ignore(folder: str, names: list[str]) -> list[str]:
            return [n for n in names if n == "__pycache__" or (Path(folder) / n).resolve() in excluded]

        shutil.copytree(installed, tmp / "site" / copy.package, ignore=ignore, copy_function=_link_or_copy,
                        symlinks=True)
        for rel, text in sources.items():
            f = tmp / "site" / rel
            mode = f.stat().st_mode
            f.unlink()  # a new file: writing through the hard link would edit the installed package
            f.write_text(text)
            f.chmod(mode)
        (tmp / "jit").mkdir()
        (tmp / "COPY.json").write_text(json.dumps(
            {"bug": copy.name, "package": copy.package, "installed": str(installed),
             "patched": sorted(sources), "workspace_env": copy.workspace_env}, indent=1))
        try:
            tmp.rename(final)
        except OSError:  # another process built it first
            if not (final / "COPY.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def import_copy(copy: PackageCopy) -> types.ModuleType:
    """Import the patched copy as ``copy.package`` in this process (building it first, :func:`build_copy`) with
    ``copy.workspace_env`` pointing at its own workspace; ``sys.path`` and the environment are restored
    afterwards. Returns the module, marked with :data:`MARK`; the same module again when this copy is already
    imported. Raises :class:`CopyConflict` when the package was imported from elsewhere first (the installed
    package, or another bug's copy), :class:`~.patching.PatchDoesNotApply`, FileNotFoundError, or what the
    package's import raises."""
    loaded = sys.modules.get(copy.package)
    installed = copy.installed()
    if installed is None:
        raise FileNotFoundError(f"{copy.name}: python package {copy.package!r} is not installed")
    folder = copy.folder(installed)
    if loaded is not None:
        if _under(Path(getattr(loaded, "__file__", None) or "/"), (folder / "site").resolve()):
            return loaded
        raise CopyConflict(
            f"{copy.name}: {copy.package} is already imported in this process from "
            f"{getattr(loaded, '__file__', None)} ({getattr(loaded, MARK, 'the installed package')}); a "
            f"re-injected {copy.package} bug needs its patched copy to be the process's first import of "
            f"{copy.package}: run it in a process of its own")
    folder = build_copy(copy, installed)
    site = str(folder / "site")
    saved_env, saved_path = os.environ.get(copy.workspace_env), list(sys.path)
    os.environ[copy.workspace_env] = str(folder / "jit")
    sys.path.insert(0, site)
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(copy.package)
    except BaseException:
        for m in [m for m in sys.modules if m == copy.package or m.startswith(copy.package + ".")]:
            del sys.modules[m]
        raise
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop(copy.workspace_env, None)
        else:
            os.environ[copy.workspace_env] = saved_env
    if not _under(Path(module.__file__), Path(site).resolve()):
        raise CopyConflict(f"{copy.name}: importing {copy.package} gave {module.__file__}, not the copy in {site}")
    setattr(module, MARK, f"{copy.name} ({folder})")
    return module


__all__ = ["MARK", "CopyConflict", "PackageCopy", "build_copy", "copies_root", "import_copy"]
