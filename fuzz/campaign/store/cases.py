"""Reading a reproducer directory back: :func:`load_case` validates every field of ``case.json`` a replay needs
(and that ``tensors.safetensors``, when present, is a readable safetensors file) and raises
:class:`BadReproducer` naming the file, the field and the fix, so a broken file is never mistaken for a failure
that came back; :func:`earlier_cases` reads those an earlier campaign left in an ``--out``. (Writing and replaying
them: :mod:`kvfuzz.fuzz.campaign.store.reproducers`.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import attrs

from kvfuzz.contracts.checks.failures import FailureKind
from kvfuzz.contracts.checks.oracles import LEGACY_NAMES
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.faults import FAULTS

CASE_FORMAT = 1


class BadReproducer(ValueError):
    """A reproducer directory that cannot be read: ``path`` and ``field`` say where, the message says how to
    fix it. (kvfuzz replay and kvfuzz check exit 2 on it: the file is broken, the bug is not known to be back.)"""

    def __init__(self, path: Path, field: str | None, problem: str, fix: str = "") -> None:
        where = f"{path}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {problem}" + (f"; {fix}" if fix else ""))
        self.path, self.field = path, field


@attrs.frozen
class Case:
    """A validated case.json: the fields a replay needs."""

    directory: Path
    target: str
    target_spec: str | None
    kind: str
    check: str
    example: Example
    fault: str | None
    raw: dict

    @property
    def signature(self) -> tuple[str, ...]:
        """The failure's signature as a campaign keys it (``FailureRecord.signature`` in
        :mod:`kvfuzz.fuzz.campaign.records`): ``(kind, check)``, and the findings-baseline entry it matched when it
        was written (``details.baseline.known``)."""
        details = self.raw.get("details")
        entry = details.get("baseline") if isinstance(details, dict) else None
        known = entry.get("known") if isinstance(entry, dict) else None
        return (self.kind, self.check, known) if isinstance(known, str) else (self.kind, self.check)


def _need(case: dict, path: Path, field: str, typ: type | tuple, what: str) -> Any:
    if field not in case:
        raise BadReproducer(path, field, "is missing", f"a kvfuzz case.json has {what}")
    v = case[field]
    if not isinstance(v, typ):
        raise BadReproducer(path, field, f"is {type(v).__name__} {str(v)[:60]!r}, expected {what}")
    return v


def read_example(raw: dict, path: Path, where: str = "example",
                 fix: str = "restore case.json from the campaign's output (kvfuzz writes every field)") -> Example:
    """The Example of ``raw`` (case.json's ``example``; ``where`` its field in ``path``), each field checked on its
    own so that a bad value is named by its innermost field ("example.batch.query_lens: is 'one': invalid literal
    for int()"), not by the whole example. Raises :class:`BadReproducer` (its message ending in ``fix``)."""
    if not isinstance(raw, dict):
        raise BadReproducer(path, where, f"is {type(raw).__name__}, expected an object with batch and poison", fix)
    for key in ("batch", "poison"):
        if key not in raw:
            raise BadReproducer(path, f"{where}.{key}", "is missing", fix)
    b = raw["batch"]
    if not isinstance(b, dict):
        raise BadReproducer(path, f"{where}.batch", f"is {type(b).__name__}, expected an object of the batch's fields",
                            fix)
    if raw["poison"] not in {p.value for p in Poison}:
        raise BadReproducer(path, f"{where}.poison", f"is {raw['poison']!r}, not a poison",
                            f"one of {', '.join(p.value for p in Poison)}")
    fields = {f.name: f for f in attrs.fields(Batch)}
    unknown = sorted(set(b) - set(fields))
    if unknown:
        raise BadReproducer(path, f"{where}.batch.{unknown[0]}", "is not a field of a batch",
                            f"the fields are {', '.join(fields)}")
    for name, f in fields.items():
        if name not in b:
            if f.default is attrs.NOTHING:
                raise BadReproducer(path, f"{where}.batch.{name}", "is missing", fix)
            continue
        v = b[name]
        try:
            if f.type == "int" and f.converter is None and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"expected an integer, got {type(v).__name__}")
            v = f.converter(v) if f.converter is not None else v
            if f.validator is not None:
                f.validator(None, f, v)
        except (TypeError, ValueError) as e:
            raise BadReproducer(path, f"{where}.batch.{name}", f"is {str(b[name])[:60]!r} ({e})", fix) from None
    try:
        return Example.from_dict(raw)
    except (TypeError, ValueError, KeyError) as e:  # the fields together: lengths that differ, a short table
        raise BadReproducer(path, f"{where}.batch", f"is not a valid batch ({type(e).__name__}: {e})", fix) from None


def load_case(directory: str | Path) -> Case:
    """Read and validate ``directory/case.json`` (and that tensors.safetensors, if present, is a readable
    safetensors file). Raises :class:`BadReproducer` naming the file, the field and the fix."""
    d = Path(directory)
    path = d / "case.json"
    if not d.is_dir():
        raise BadReproducer(d, None, "is not a directory", "pass a reproducer directory written by `kvfuzz fuzz`")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadReproducer(path, None, "does not exist", "pass a reproducer directory written by `kvfuzz fuzz` "
                            "(it holds case.json, tensors.safetensors, test_case.py)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadReproducer(path, None, f"cannot be read ({e})") from None
    try:
        case = json.loads(text)
    except ValueError as e:
        raise BadReproducer(path, None, f"is not valid JSON ({e})", "restore it from the campaign's output") from None
    if not isinstance(case, dict):
        raise BadReproducer(path, None, f"holds a JSON {type(case).__name__}, not an object",
                            "a kvfuzz case.json is an object with target, kind, check, example")
    fmt = case.get("format")
    if fmt != CASE_FORMAT:
        raise BadReproducer(path, "format", f"is {fmt!r}; this kvfuzz reads format {CASE_FORMAT}",
                            "rewrite the case with this kvfuzz (replay its example with `kvfuzz fuzz`)")
    target = _need(case, path, "target", str, "the target's name (a string)")
    spec = case.get("target_spec")
    if spec is not None and not isinstance(spec, str):
        raise BadReproducer(path, "target_spec", f"is {type(spec).__name__}, expected a string or null")
    kind = _need(case, path, "kind", str, "the failure kind (a string)")
    if kind not in {k.value for k in FailureKind}:
        raise BadReproducer(path, "kind", f"is {kind!r}, not a failure kind",
                            f"one of {', '.join(k.value for k in FailureKind)}")
    check = _need(case, path, "check", str, "the check that failed (a string)")
    check = LEGACY_NAMES.get(check, check)  # an oracle by the bare name older reproducers recorded
    example = read_example(_need(case, path, "example", dict, "the example: an object with batch and poison"), path)
    fault = case.get("caller_fault")
    if fault is not None and fault not in FAULTS:
        raise BadReproducer(path, "caller_fault", f"is {fault!r}, not a caller fault this kvfuzz knows",
                            f"one of {', '.join(FAULTS)}, or null")
    tensors = d / "tensors.safetensors"
    if tensors.exists():
        try:
            from safetensors import safe_open

            with safe_open(str(tensors), framework="pt") as f:
                list(f.keys())
        except Exception as e:
            raise BadReproducer(tensors, None, f"is not a readable safetensors file ({type(e).__name__}: {e}); "
                                "kvfuzz never reads pickles", "restore it, or delete it (the case replays from "
                                "case.json alone)") from None
    return Case(d, target, spec, kind, check, example, fault, case)


def earlier_cases(out: str | Path, warn: Callable[[str], None]) -> list[Case]:
    """The reproducers already in ``out`` (each folder directly under it that holds a case.json), read back by
    :func:`load_case`, in name order. One that cannot be read is left out, and ``warn`` is told which file and why:
    a campaign started again on its ``--out`` must start, and reports that failure as new if it finds it again."""
    try:
        folders = sorted(Path(out).iterdir())
    except OSError:  # no --out yet
        return []
    cases = []
    for d in folders:
        try:
            if (d / "case.json").exists():
                cases.append(load_case(d))
        except (BadReproducer, OSError) as e:  # OSError: a folder this user may not look into
            warn(f"an earlier reproducer in {out} cannot be read, so its failure counts as new if found again: {e}")
    return cases


__all__ = ["BadReproducer", "CASE_FORMAT", "Case", "earlier_cases", "load_case", "read_example"]
