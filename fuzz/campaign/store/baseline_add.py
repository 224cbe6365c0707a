"""What ``kvfuzz baseline add DIR`` writes: an entry of a findings baseline
(:mod:`kvfuzz.fuzz.campaign.store.baseline`, whose docstring gives the format) made from a reproducer, appended to
the file atomically."""

from __future__ import annotations

import math
from pathlib import Path

from kvfuzz.fuzz.campaign.store.baseline import KINDS, BaselineError, KnownFinding, access_location, parse_baseline
from kvfuzz.fuzz.campaign.store.journal import write_text


def entry_from_case(case, entry_id: str, reason: str, reference: str, slots: str = "tail",
                    tail_tokens: int = 32, max_ratio: float | None = None, heads: str = "any") -> KnownFinding:
    """An entry for a reproducer (a loaded :class:`~kvfuzz.fuzz.campaign.store.cases.Case`): its target, kind
    and check; for a non-finite output its poison and ``slots``; for a mismatch ``max_ratio`` (default: 10 times
    the reproducer's own error/bound, so only a tenfold worse error counts as the bug changing); for a memory
    safety finding the ``locations`` and ``kernels`` of its invalid accesses. Raises :class:`BaselineError` (naming
    case.json) for a kind a baseline cannot accept, a mismatch case without an error and bound, or a memory safety
    case without an invalid access with a source line."""
    path = Path(case.directory) / "case.json"
    if case.kind not in KINDS:
        raise BaselineError(path, "kind", f"is {case.kind!r}, which a baseline cannot accept",
                            f"only {' and '.join(KINDS)} reproducers can be baselined; fix the others")
    common = dict(id=entry_id, target=case.target, kind=case.kind, check=case.check, reason=reason,
                  reference=reference, heads=heads)
    if case.kind == "non-finite output":
        return KnownFinding(**common, poisons=(case.example.poison.value,), slots=slots, tail_tokens=tail_tokens)
    if case.kind == "memory safety":
        accesses = (case.raw.get("details") or {}).get("accesses") or []
        where = [access_location(a) for a in accesses]
        kernels = [a.get("kernel") if isinstance(a, dict) else None for a in accesses]
        if not accesses or None in where or None in kernels:
            raise BaselineError(path, "details.accesses", "lists no invalid access, or one without its kernel and "
                                "source line", "write the entry by hand, with locations = [\"file.py:LINE\"]")
        return KnownFinding(**common, locations=tuple(dict.fromkeys(where)), kernels=tuple(dict.fromkeys(kernels)))
    if max_ratio is None:
        oracle = (case.raw.get("details") or {}).get("oracle") or {}
        try:
            max_ratio = math.ceil(10 * float(oracle["error"]) / float(oracle["bound"]) * 10) / 10
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise BaselineError(path, "details.oracle", "has no error and bound",
                                "pass --max-ratio to say how far above its bound the finding may go") from None
    return KnownFinding(**common, max_ratio=float(max_ratio))


def append_entry(path: str | Path, entry: KnownFinding) -> None:
    """Append ``entry`` to the baseline at ``path`` (created if missing), atomically
    (:func:`~kvfuzz.fuzz.campaign.store.journal.write_text`, fsynced). Raises :class:`BaselineError` when the
    existing file is invalid or already has the entry's id, or when the result would not parse (nothing is written
    then), OSError when the file cannot be written (the old one kept whole)."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    existing = parse_baseline(old, path)
    if existing.get(entry.id) is not None:
        raise BaselineError(path, "id", f"{entry.id!r} is already in the baseline", "choose another --id")
    text = (old.rstrip("\n") + "\n\n" if old.strip() else "") + entry.to_toml()
    parse_baseline(text, path)  # what we write must read back
    write_text(path, text, fsync=True)


__all__ = ["append_entry", "entry_from_case"]
