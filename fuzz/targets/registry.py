"""Where targets come from, and the kernel families that define them: kvfuzz's built-in adapters (:data:`BUILTIN`,
each in its family's home, a module of :data:`FAMILIES`), adapters other packages register under the entry-point
group :data:`ENTRY_POINT_GROUP`, and adapters a user names by file or module (``path/to/file.py:CLASS``,
``package.module:CLASS``).

A package registers an adapter in its ``pyproject.toml``::

    [project.entry-points."kvfuzz.targets"]
    "mykernels.paged_decode" = "mykernels.kvfuzz_adapter:PagedDecodeTarget"

An entry whose name ends in ``*`` registers a family: ``"mutant.*" = "kvfuzz.fuzz.bench.mutants:get_mutant"``
resolves every name starting with ``mutant.`` by calling ``get_mutant(name)``. Registered names (built-in or
entry point) are safe to resolve from a reproducer's case.json; file and module specs run the user's code and
are resolved only when the user names them (see :func:`is_registered`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from .base import Target

#: The kernel families' homes: each module holds a family's targets (``TARGETS``, the classes), their
#: capabilities, its kernels' call signatures (``SIGNATURES``: :mod:`kvfuzz.fuzz.targets.signature`) and what each
#: kernel needs of its caller. The guard builds its table of signatures from these
#: (:mod:`kvfuzz.fuzz.guard.signatures`) and :data:`BUILTIN` the target list. Importing one imports no kernel
#: library. A new family: its module here; a new target: its class in its family's ``TARGETS``.
FAMILIES = (
    "kvfuzz.fuzz.targets.vllm_triton",
    "kvfuzz.fuzz.targets.vllm_mla",
    "kvfuzz.fuzz.targets.vllm_flash_attn",
    "kvfuzz.fuzz.targets.vllm_merge",
    "kvfuzz.fuzz.targets.vllm_cpu",
    "kvfuzz.fuzz.targets.cache_writers",
    "kvfuzz.fuzz.targets.torch_flex",
    "kvfuzz.fuzz.targets.sglang_triton",
    "kvfuzz.fuzz.targets.flashinfer",
)


class _Builtin(Mapping):
    """:data:`BUILTIN`: target name -> ``"module:class"``, from every family's ``TARGETS`` in :data:`FAMILIES`
    order, read on first use (importing the family modules, which load no kernel library; a command that names
    no target never pays for it). Raises ValueError naming both classes when two targets share a name."""

    def __init__(self) -> None:
        self._table: dict[str, str] | None = None

    def _read(self) -> dict[str, str]:
        if self._table is None:
            table: dict[str, str] = {}
            for home in families():
                for cls in home.TARGETS:
                    spec = f"{home.__name__}:{cls.__name__}"
                    if cls.name in table:
                        raise ValueError(f"targets {table[cls.name]} and {spec} share the name {cls.name!r}")
                    table[cls.name] = spec
            self._table = table
        return self._table

    def __getitem__(self, name: str) -> str:
        return self._read()[name]

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


#: Built-in targets: name -> "module:class" (each target's class imported lazily by get_target; its family's
#: TARGETS lists it).
BUILTIN: Mapping[str, str] = _Builtin()

#: The entry-point group other packages register adapters under.
ENTRY_POINT_GROUP = "kvfuzz.targets"


def families() -> list[ModuleType]:
    """The modules of :data:`FAMILIES`, imported (cheap: no kernel library loads)."""
    return [importlib.import_module(name) for name in FAMILIES]


_cache: dict[str, Target] = {}
#: target name -> the file or module spec it was loaded from (absent for registered targets)
_specs: dict[str, str] = {}


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def registered() -> list[str]:
    """Names of every target that can be resolved without a file or module spec: the built-ins, then the
    individually registered entry points (families, ``prefix.*``, are not listed)."""
    return list(BUILTIN) + sorted(n for n in _entry_points() if not n.endswith("*") and n not in BUILTIN)


def _entry_point_for(name: str) -> importlib.metadata.EntryPoint | None:
    eps = _entry_points()
    if name in eps:
        return eps[name]
    families = [n for n in eps if n.endswith("*") and name.startswith(n[:-1])]
    return eps[max(families, key=len)] if families else None


def is_registered(name: str) -> bool:
    """Whether ``name`` resolves without importing code the user did not name: a built-in or an entry point."""
    return name in BUILTIN or _entry_point_for(name) is not None


def _instance(obj, spec: str) -> Target:
    target = obj() if isinstance(obj, type) else obj
    if not isinstance(target, Target):
        raise ValueError(f"target {spec!r}: {obj!r} is not a kvfuzz Target (subclass kvfuzz.Target)")
    return target


def load_spec(spec: str) -> Target:
    """Import a user adapter from ``path/to/file.py:CLASS`` or ``package.module:CLASS`` (this runs that code).
    A file's folder goes first on ``sys.path`` while it is imported, so it can import modules beside it (a
    base class in a sibling file). Raises ValueError naming the problem."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ValueError(f"target {spec!r}: expected NAME, path/to/file.py:CLASS or package.module:CLASS")
    if module_part.endswith(".py"):
        path = Path(module_part).resolve()
        if not path.exists():
            raise ValueError(f"target {spec!r}: file {module_part} does not exist")
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        mspec = importlib.util.spec_from_file_location(f"kvfuzz_user_target_{path.stem}", path)
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mspec.name] = module
        try:
            mspec.loader.exec_module(module)
        except ImportError as e:
            raise ValueError(f"target {spec!r}: importing {module_part} failed: {e} (its folder {folder} is on "
                             "sys.path; install other packages it needs)") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ValueError(f"target {spec!r}: cannot import {module_part}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"target {spec!r}: {module_part} has no attribute {attr!r}")
    try:
        target = _instance(obj, spec)
    except TypeError as e:  # e.g. a subclass that does not set its own name (Target.__new__)
        raise ValueError(f"target {spec!r}: {e}") from None
    _specs[target.name] = f"{path}:{attr}" if module_part.endswith(".py") else spec
    return target


def spec_of(target: Target) -> str | None:
    """How ``target`` was loaded when it is not registered: ``/abs/path/file.py:CLASS`` or ``module:CLASS``;
    None for a built-in or entry-point target (reproducers record it; replay needs the user's consent to
    import it)."""
    return None if is_registered(target.name) else _specs.get(target.name)


def get_target(name: str) -> Target:
    """A target by name: a built-in, an entry point of :data:`ENTRY_POINT_GROUP` (or of a family ``prefix.*``,
    e.g. ``mutant.<slug>``), or a user adapter as ``path/to/file.py:CLASS`` / ``package.module:CLASS``.

    Raises ValueError naming the known targets when ``name`` is none of these."""
    if name not in _cache:
        if name in BUILTIN:
            module, _, cls = BUILTIN[name].partition(":")
            _cache[name] = _instance(getattr(importlib.import_module(module), cls), name)
        elif (ep := _entry_point_for(name)) is not None:
            obj = ep.load()
            try:
                _cache[name] = _instance(obj(name), name) if ep.name.endswith("*") else _instance(obj, name)
            except KeyError as e:  # a family that does not know this member
                raise ValueError(e.args[0]) from None
        elif ":" in name:
            _cache[name] = load_spec(name)
        else:
            raise ValueError(f"unknown target {name!r}; registered targets: {', '.join(registered())} "
                             "(or mutant.<slug>, or path/to/file.py:CLASS, or package.module:CLASS)")
    return _cache[name]


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "FAMILIES", "families", "get_target", "is_registered", "load_spec",
           "registered", "spec_of"]
