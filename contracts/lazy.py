"""Lazy package exports (PEP 562): a package's ``__init__`` names what it exports and from which submodule,
and a submodule is imported only when one of its names is first used. So ``import kvfuzz`` and the CLI's
``--help`` do not pay for torch, and ``kvfuzz.contracts.model.poison`` imports without it."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public names are ``exports`` (name -> submodule,
    relative to the package). Unknown names raise AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__


__all__ = ["lazy_exports"]
