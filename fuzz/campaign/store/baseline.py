"""A findings baseline: failures a team has accepted (upstream kernel properties kvfuzz documents), so that
``kvfuzz fuzz --baseline FILE`` still finds, counts and lists them but exits 0 unless something new is found.

The file is TOML (read with the standard library's ``tomllib``), one ``[[known]]`` table per accepted finding::

    [[known]]
    id = "finding-1"                    # unique; summaries and reports name the finding by it
    target = "vllm.cpu_attention"       # the target's registered name
    kind = "non-finite output"          # a failure kind: "non-finite output", "kernel mismatch" or "memory safety"
    check = "finite output"             # the oracle (contracts.oracles.Oracle value; or "finite pad rows"; or
                                        # sanitizer.CHECK, "memory safety (compute-sanitizer memcheck)")
    reason = "V rows past seq_len ..."  # why it is accepted
    reference = "README.md Findings 1"  # where it is documented upstream or here
    # non-finite output: what decides "the same bug"
    poisons = ["nan", "inf"]            # the poisons it shows with
    slots = "tail"                      # where the poison it reads sits: "tail", "unwritten" or "freed"; or "none": the
                                        # NaN comes from the batch's own values (needs values and features)
    tail_tokens = 32                    # slots = "tail": the kernel's token group
    values = ["extreme"]                # slots = "none": the value ranges it shows with
    features = ["softcap"]              # slots = "none": the features that cause it (the batch has them): "softcap",
                                        # "magnitudes", "padding" or "sliding_window" (FEATURES_OFF)
    # kernel mismatch: what decides "the same bug"
    max_ratio = 10.0                    # the worst element's |out - ref| / bound may be at most this; or (and)
    # values = ["extreme"], features = ["magnitudes"]: the value ranges and features it shows with (as above)
    # memory safety (kvfuzz fuzz --sanitize on CUDA): what decides "the same bug"
    locations = ["triton_unified_attention.py:432"]  # the source lines (file basename:line) its invalid accesses are at
    kernels = ["kernel_unified_attention"]            # optional: the kernels they are in
    heads = "equal"                     # optional: "equal" (num_heads == num_kv_heads only), "group-split" or "any"

A failing example matches an entry only when all of these hold (:func:`match`):

- target, failure kind and check are the entry's;
- ``heads = "equal"``: the batch has as many query heads as kv heads; ``heads = "group-split"`` (Finding 14, the
  grouped decode kernels' ``cur_head_id // cdiv(group, 16)``): a group past 16 that is not a multiple of 16 over two
  or more kv heads, and the worst element's head one that program reads from another kv head
  (:func:`kvfuzz.fuzz.targets.decode_attention.split_heads`);
- a non-finite output: the example's poison is one of ``poisons``, and **the same example passes** (no finding
  at all) when the entry's ``slots`` hold finite values (zeros) and everything else is unchanged: ``"tail"``,
  the slots the contract leaves unwritten from each sequence's ``seq_len`` up to the next multiple of
  ``tail_tokens`` and of its block size (inside the sequence's block-table row); ``"unwritten"``, every slot the
  contract leaves unwritten; ``"freed"``, the null block's slots, where a batch with freed window blocks
  (``Batch.freed_window_blocks``) points the columns wholly before each window (so only such a batch can match).
  So the NaN came from there, as the documented bug says, and from nowhere else.
  ``slots = "none"``: the batch's value range is one of ``values``, it has every feature of ``features``, and
  the same example passes with those features off (e.g. no softcap; ``"padding"``: no CUDA-graph pads;
  ``"sliding_window"``: no window, a freed-window batch's freed columns given blocks of their own), or fails
  there only with findings other entries accept, each matching that re-run itself (scoped ones re-run it again
  with their own features off): the NaN comes from that feature at those magnitudes, as the documented bug says.
  A re-run failing the same check, or another check no entry accepts (a failure of its own), keeps it new;
- a kernel mismatch: ``error / bound`` at the worst element is at most ``max_ratio``. Above it the finding is
  new (the known bug changed: it got worse), and its details say which entry it outgrew. An entry with ``values``
  and ``features`` (instead of, or with, ``max_ratio``; ``heads = "group-split"`` needs neither) matches as
  ``slots = "none"`` does: the value range is one
  of ``values`` and the same example passes with the features off (or fails there only with findings other
  entries accept: Finding 3 at normal values, a pad row's NaN). The feature ``"magnitudes"`` re-runs the same
  batch at the ``"normal"`` value range: a precision bug that only large magnitudes expose (an fp16 score that
  overflows, a rounding error that grows with the score) and that stays inside the bound at normal values. The
  feature ``"sliding_window"`` re-runs it without a window: a kernel wrong only with a window (Finding 12).
- a memory safety finding (compute-sanitizer memcheck, :mod:`kvfuzz.fuzz.harness.sanitizer`): it lists at least
  one invalid access (``details["accesses"]``), and **every** access it lists is at one of ``locations`` (the
  access's source file's basename and line, as :meth:`~kvfuzz.fuzz.harness.sanitizer.MemoryAccess.describe` prints
  them) and, with ``kernels``, in one of those kernels. One access anywhere else is a new bug (it is not the
  documented overrun), and so is a memcheck error with no access listed (a launch failure). Nothing is re-run:
  the report already names where the kernel read or wrote.

Anything else the same target does stays a new failure: a crash, a caller violation, NaN with finite poison
or from other slots, a larger error. ``kvfuzz baseline add DIR`` writes an entry from a reproducer
(:mod:`kvfuzz.fuzz.campaign.store.baseline_add`).
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path

import attrs

#: Failure kinds an entry may name (and what decides "the same bug" for each).
KINDS = ("non-finite output", "kernel mismatch", "memory safety")
#: Where the poison a known non-finite output reads sits (module docstring).
SLOT_CLASSES = ("tail", "unwritten", "freed", "none")
#: Features a ``slots = "none"`` entry may name, and how a re-run turns each off (a Batch field's value).
#: "magnitudes": the re-run draws the same batch at the "normal" value range (the failure comes from the batch's
#: magnitudes alone, as a documented precision bug of an input-dtype score says).
#: "padding": the re-run drops the CUDA-graph pad sequences (``num_pad_seqs`` 0: a NaN that only pads cause).
#: "sliding_window": the re-run has no window (``sliding_window`` None; a batch with freed window blocks gets blocks
#: of its own for the freed columns, :func:`~kvfuzz.contracts.model.freed_window.without_window`).
FEATURES_OFF = {"softcap": ("softcap", None), "magnitudes": ("value_range", "normal"), "padding": ("num_pad_seqs", 0),
                "sliding_window": ("sliding_window", None)}
HEADS = ("any", "equal", "group-split")
#: A memory safety entry's fields (module docstring); a ``locations`` entry: a file's basename and a line.
MEMORY_FIELDS = ("locations", "kernels")
LOCATION = re.compile(r"[^/\\:\s]+:[1-9]\d*")
POISONS = ("nan", "inf", "stale", "zeros")


class BaselineError(ValueError):
    """A baseline file that cannot be used: ``path``, ``field`` (e.g. ``known[2].max_ratio``, or None for the
    whole file), what is wrong and how to fix it, all in the message."""

    def __init__(self, path: str | Path, field: str | None, problem: str, fix: str):
        self.path, self.field, self.problem, self.fix = Path(path), field, problem, fix
        where = f"{path}" + (f", field {field}" if field else "")
        super().__init__(f"{where}: {problem}; {fix}")


@attrs.frozen
class KnownFinding:
    """One accepted finding (a ``[[known]]`` table of the module docstring); every field as there."""

    id: str
    target: str
    kind: str
    check: str
    reason: str
    reference: str
    poisons: tuple[str, ...] = ()
    slots: str | None = None
    tail_tokens: int = 32
    max_ratio: float | None = None
    heads: str = "any"
    values: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    locations: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()

    def to_toml(self) -> str:
        """This entry as a ``[[known]]`` table (strings as TOML basic strings, via JSON's escapes, which TOML's
        basic strings share)."""
        s = json.dumps
        lines = ["[[known]]", f"id = {s(self.id)}", f"target = {s(self.target)}", f"kind = {s(self.kind)}",
                 f"check = {s(self.check)}", f"reason = {s(self.reason, ensure_ascii=False)}",
                 f"reference = {s(self.reference, ensure_ascii=False)}"]
        if self.kind == "non-finite output":
            lines += [f"poisons = [{', '.join(s(p) for p in self.poisons)}]", f"slots = {s(self.slots)}"]
            if self.slots == "tail":
                lines.append(f"tail_tokens = {self.tail_tokens}")
            if self.slots == "none":
                lines += [f"values = [{', '.join(s(v) for v in self.values)}]",
                          f"features = [{', '.join(s(f) for f in self.features)}]"]
        elif self.kind == "memory safety":
            lines.append(f"locations = [{', '.join(s(loc) for loc in self.locations)}]")
            if self.kernels:
                lines.append(f"kernels = [{', '.join(s(k) for k in self.kernels)}]")
        else:
            if self.max_ratio is not None:
                lines.append(f"max_ratio = {self.max_ratio!r}")
            if self.values:
                lines += [f"values = [{', '.join(s(v) for v in self.values)}]",
                          f"features = [{', '.join(s(f) for f in self.features)}]"]
        if self.heads != "any":
            lines.append(f"heads = {s(self.heads)}")
        return "\n".join(lines) + "\n"


@attrs.frozen
class Baseline:
    """The entries of one baseline file (``path``: where it was read)."""

    path: str
    entries: tuple[KnownFinding, ...] = ()

    def get(self, entry_id: str) -> KnownFinding | None:
        return next((e for e in self.entries if e.id == entry_id), None)

    def for_target(self, target: str) -> tuple[KnownFinding, ...]:
        return tuple(e for e in self.entries if e.target == target)

    def retarget(self, source: str, target: str) -> Baseline:
        """This baseline with target ``source``'s entries moved to ``target`` (their ids kept, so a match still
        names the upstream bug): a target that runs ``source``'s kernel under another name (``kvfuzz bench
        bugs``'s ``bug.<slug>`` targets, whose base kernel's live upstream bugs are still there) is held to the
        same known findings."""
        return attrs.evolve(self, entries=tuple(attrs.evolve(e, target=target) if e.target == source else e
                                                for e in self.entries))


def _field(path, i: int, table: dict, name: str, typ, what: str, required: bool = True, default=None):
    where = f"known[{i}].{name}"
    if name not in table:
        if required:
            raise BaselineError(path, where, "is missing", f"add {name} = {what}")
        return default
    v = table[name]
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or isinstance(v, bool):
        raise BaselineError(path, where, f"is {type(v).__name__} {v!r}", f"give {what}")
    return v


def parse_baseline(text: str, path: str | Path = "<baseline>") -> Baseline:
    """Parse and validate a baseline (the module docstring's format).

    Raises :class:`BaselineError` naming the file, the field and the fix: TOML syntax, an unknown key, a
    missing or mistyped field, a kind or slot class kvfuzz does not know, a duplicate id, a non-finite entry
    without poisons and slots or a mismatch entry without ``max_ratio``. Targets are not resolved here (a
    baseline may list targets not installed on this machine)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BaselineError(path, None, f"is not valid TOML ({e})", "fix the syntax (https://toml.io)") from None
    extra = set(doc) - {"known"}
    if extra:
        raise BaselineError(path, sorted(extra)[0], "is not a baseline key",
                            "a baseline holds only [[known]] tables (kvfuzz baseline add writes them)")
    tables = doc.get("known", [])
    if not isinstance(tables, list):
        raise BaselineError(path, "known", "is not an array of tables", "write each entry as [[known]]")
    entries: list[KnownFinding] = []
    for i, t in enumerate(tables):
        entries.append(_entry(path, i, t, {e.id for e in entries}))
    return Baseline(str(path), tuple(entries))


def _entry(path, i: int, t: dict, taken: set[str]) -> KnownFinding:
    """The ``i``-th ``[[known]]`` table ``t``, validated (``taken``: the ids of the entries before it): the fields
    every entry has, then its kind's."""
    keys = {f.name for f in attrs.fields(KnownFinding)}
    unknown = sorted(set(t) - keys)
    if unknown:
        raise BaselineError(path, f"known[{i}].{unknown[0]}", "is not a field of a baseline entry",
                            f"use only {', '.join(sorted(keys))}")
    entry_id = _field(path, i, t, "id", str, 'a unique name, e.g. "finding-1"')
    if not entry_id.strip() or entry_id in taken:
        raise BaselineError(path, f"known[{i}].id", f"{entry_id!r} is empty or used twice",
                            "give every entry its own id")
    target = _field(path, i, t, "target", str, 'the target\'s name, e.g. "vllm.cpu_attention"')
    kind = _field(path, i, t, "kind", str, f"one of {', '.join(map(repr, KINDS))}")
    if kind not in KINDS:
        raise BaselineError(path, f"known[{i}].kind", f"is {kind!r}, which a baseline cannot accept",
                            f"one of {', '.join(map(repr, KINDS))} (crashes, hangs and caller violations "
                            "are never baselined)")
    check = _check(path, i, t, kind)
    reason = _field(path, i, t, "reason", str, "why the finding is accepted (a string)")
    reference = _field(path, i, t, "reference", str, "where it is documented (an issue, a README section)")
    heads = _field(path, i, t, "heads", str, f"one of {HEADS}", required=False, default="any")
    if heads not in HEADS:
        raise BaselineError(path, f"known[{i}].heads", f"is {heads!r}", f"one of {', '.join(map(repr, HEADS))}")
    if kind != "memory safety" and (name := next((n for n in MEMORY_FIELDS if n in t), None)):
        raise BaselineError(path, f"known[{i}].{name}", f"is a field of a memory safety entry, not of a {kind}",
                            f"remove {name} (a {kind} entry's fields: the module docstring)")
    if kind == "memory safety":
        kw = _memory_fields(path, i, t)
    elif kind == "non-finite output":
        kw = _non_finite_fields(path, i, t)
    else:
        kw = _mismatch_fields(path, i, t)
    return KnownFinding(entry_id, target, kind, check, reason, reference, heads=heads, **kw)


def _check(path, i: int, t: dict, kind: str) -> str:
    """The entry's ``check`` (an old name read as its new one), which must be the oracle of its ``kind``: a
    non-finite output's is the finite-output oracle or the pad rows' (a NaN only CUDA-graph pads show)."""
    from kvfuzz.contracts.checks.oracles import LEGACY_NAMES, Oracle

    check = _field(path, i, t, "check", str, f"an oracle: {', '.join(repr(o.value) for o in Oracle)}")
    check = LEGACY_NAMES.get(check, check)
    want = (Oracle.FINITE.value, Oracle.PAD_FINITE.value) if kind == "non-finite output" else (
        Oracle.AGREEMENT.value,)
    if kind == "memory safety":
        from kvfuzz.fuzz.harness.sanitizer import CHECK as MEMCHECK

        want = (MEMCHECK,)
    if check not in want:
        raise BaselineError(path, f"known[{i}].check", f"is {check!r}, not the oracle of a {kind}",
                            " or ".join(f"check = {w!r}" for w in want))
    return check


def _non_finite_fields(path, i: int, t: dict) -> dict:
    """A non-finite output entry's ``poisons``, ``slots`` and ``tail_tokens`` (and, for ``slots = "none"``,
    ``values`` and ``features``), validated."""
    poisons = _field(path, i, t, "poisons", list, 'the poisons it shows with, e.g. ["nan", "inf"]')
    if not poisons or any(p not in POISONS for p in poisons):
        raise BaselineError(path, f"known[{i}].poisons", f"is {poisons!r}",
                            f"a non-empty list of {', '.join(map(repr, POISONS))}")
    slots = _field(path, i, t, "slots", str, f"one of {', '.join(map(repr, SLOT_CLASSES))}")
    if slots not in SLOT_CLASSES:
        raise BaselineError(path, f"known[{i}].slots", f"is {slots!r}", f"one of {', '.join(map(repr, SLOT_CLASSES))}")
    tail = _field(path, i, t, "tail_tokens", int, "a positive token count, e.g. 32", required=False, default=32)
    if tail < 1:
        raise BaselineError(path, f"known[{i}].tail_tokens", f"is {tail}", "a positive token count")
    kw = dict(poisons=tuple(poisons), slots=slots, tail_tokens=tail)
    return kw | _values_and_features(path, i, t) if slots == "none" else kw


def _mismatch_fields(path, i: int, t: dict) -> dict:
    """A kernel mismatch entry's ``max_ratio`` (required unless it has ``values`` and ``features``, or
    ``heads = "group-split"``: its head scope is the bug's, and the error, two heads' attention apart, has no bound
    that holds at every value range), validated."""
    scoped = "values" in t or "features" in t
    kw = _values_and_features(path, i, t) if scoped else {}
    if "max_ratio" in t or not (scoped or t.get("heads") == "group-split"):
        ratio = _field(path, i, t, "max_ratio", float,
                       "the largest |out - ref| / bound accepted, e.g. 10.0 (or values and features)")
        if not (math.isfinite(ratio) and ratio >= 1.0):
            raise BaselineError(path, f"known[{i}].max_ratio", f"is {ratio}",
                                "a finite number >= 1 (a failure exceeds its bound: ratio > 1)")
        kw["max_ratio"] = ratio
    return kw


def _values_and_features(path, i: int, t: dict) -> dict:
    from kvfuzz.contracts.model.space import VALUE_RANGES

    values = _field(path, i, t, "values", list, 'the value ranges it shows with, e.g. ["extreme"]')
    if not values or any(v not in VALUE_RANGES for v in values):
        raise BaselineError(path, f"known[{i}].values", f"is {values!r}",
                            f"a non-empty list of {', '.join(map(repr, VALUE_RANGES))}")
    features = _field(path, i, t, "features", list, 'the features that cause it, e.g. ["softcap"]')
    if not features or any(f not in FEATURES_OFF for f in features):
        raise BaselineError(path, f"known[{i}].features", f"is {features!r}",
                            f"a non-empty list of {', '.join(map(repr, FEATURES_OFF))}")
    if "magnitudes" in features and "normal" in values:
        raise BaselineError(path, f"known[{i}].values", "lists 'normal' with the feature 'magnitudes' (whose re-run "
                            "is at 'normal': the same example)", "list only the larger value ranges")
    return dict(values=tuple(values), features=tuple(features))


def _memory_fields(path, i: int, t: dict) -> dict:
    """A memory safety entry's ``locations`` (required) and ``kernels`` (optional), validated; no field of the
    other kinds."""
    other = next((n for n in ("poisons", "slots", "tail_tokens", "max_ratio", "values", "features") if n in t), None)
    if other:
        raise BaselineError(path, f"known[{i}].{other}", "is not a field of a memory safety entry",
                            "remove it: the invalid accesses' locations (and kernels) decide the same bug")
    locations = _field(path, i, t, "locations", list,
                       'the source lines of its invalid accesses, e.g. ["triton_unified_attention.py:432"]')
    bad = next((loc for loc in locations if not (isinstance(loc, str) and LOCATION.fullmatch(loc))), None)
    if not locations or bad is not None:
        raise BaselineError(path, f"known[{i}].locations", f"is {locations!r}" + (
            f" ({bad!r} is not file:line)" if bad is not None else ""),
            'a non-empty list of "file:line", the file\'s basename as the accesses report it, e.g. '
            '"triton_unified_attention.py:432"')
    kernels = _field(path, i, t, "kernels", list, 'the kernels of its invalid accesses, e.g. ["_fwd_kernel"]',
                     required=False, default=[])
    if "kernels" in t and (not kernels or any(not isinstance(k, str) or not k.strip() for k in kernels)):
        raise BaselineError(path, f"known[{i}].kernels", f"is {kernels!r}",
                            'a non-empty list of kernel names, e.g. ["kernel_unified_attention"] (or no kernels)')
    return dict(locations=tuple(locations), kernels=tuple(kernels))


def load_baseline(path: str | Path) -> Baseline:
    """Read and validate a baseline file (:func:`parse_baseline`). Raises :class:`BaselineError` when it cannot
    be read or is invalid."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BaselineError(path, None, f"cannot be read ({getattr(e, 'strerror', None) or e})",
                            "name an existing UTF-8 TOML file (e.g. kvfuzz-baseline.toml)") from None
    return parse_baseline(text, path)


# ---- matching a failing example -------------------------------------------------------------------------------
def freed_slots(batch):
    """int64 slots of the "freed" class (module docstring): the null block's ``block_size`` slots when the batch
    has freed window blocks (vLLM's ``BlockPool.null_block``, :data:`~kvfuzz.contracts.model.batch.NULL_BLOCK`,
    which the cache holds no token in), else none."""
    import torch

    from kvfuzz.contracts.model.batch import NULL_BLOCK

    if not batch.freed_window_blocks:
        return torch.zeros(0, dtype=torch.int64)
    return torch.arange(NULL_BLOCK * batch.block_size, (NULL_BLOCK + 1) * batch.block_size, dtype=torch.int64)


def tail_slots(batch, cache, tail_tokens: int):
    """int64 slots of the "tail" class (module docstring): for each sequence, positions ``seq_len`` up to the
    next multiple of ``tail_tokens`` and of ``block_size`` (the larger), in columns of its block-table row, minus
    every slot the cache holds a token in (``cache.written_slots``)."""
    import torch

    seqs, poss = [], []
    for i, s in enumerate(batch.seq_lens):
        end = max(-(-s // tail_tokens) * tail_tokens, -(-s // batch.block_size) * batch.block_size)
        end = min(end, len(batch.block_table[i]) * batch.block_size)
        seqs += [i] * max(0, end - s)
        poss += list(range(s, end))
    if not seqs:
        return torch.empty(0, dtype=torch.int64)
    slots = batch.slots(torch.tensor(seqs, dtype=torch.int64), torch.tensor(poss, dtype=torch.int64))
    written = cache.written_slots.to(torch.int64).cpu()
    held = torch.zeros(max(int(slots.max()), int(written.max()) if len(written) else 0) + 1, dtype=torch.bool)
    held[written] = True  # a mask over the slots: a third of the time torch.isin took
    return torch.unique(slots[~held[slots]])


def _reusable(target, example, run) -> bool:
    """Whether ``run`` (the failing run of ``example``, or None) holds what a re-run of the same batch may reuse:
    the ground truth and the fp64 reference and envelope, which depend on the batch only, not on the poison."""
    return (run is not None and target.capabilities.contract.is_attention and run.reference is not None
            and run.envelope is not None
            and run.example.batch == example.batch)


def _still_fails_with_finite(entry: KnownFinding, target, example, run=None) -> str:
    """What ``example`` still fails with the entry's slot class holding zeros instead of its poison, in this
    process: "" when it passes every check (no finding, nothing raised), else the failure's kind and message
    (another finding there is not the entry's bug: a near miss that names it). ``run``: the example's failing Run;
    its data, reference and envelope are reused (:func:`_reusable`) and the cache, the call, the kernel and the
    output checks are done again. So are the caller checks, unless ``run`` was prepared without a caller fault:
    then its call passed them (its finding is not a caller violation), the re-run's call is built the same way
    from the same data, and its cache differs only in slots the contract leaves unwritten, which no caller check
    reads."""
    from kvfuzz.contracts.checks.failures import Finding
    from kvfuzz.contracts.model.poison import Poison
    from kvfuzz.fuzz.harness import attention, properties

    reuse = _reusable(target, example, run)
    checked = reuse and run.fault is None

    def again(example_, after_materialize=None):
        """A fresh run of ``example_``, carrying ``run``'s data, reference and envelope when reusable."""
        if not reuse:
            return attention.prepare(target, example_, after_materialize=after_materialize)
        fresh = attention.prepare(target, example_, after_materialize=after_materialize, data=run.data)
        fresh.reference, fresh.envelope = run.reference, run.envelope
        return fresh

    try:
        if entry.slots == "unwritten":
            zeros = attrs.evolve(example, poison=Poison.ZEROS)
            if reuse:
                attention.check_example(target, zeros, run=again(zeros), caller_checked=checked)
            else:
                properties.check(target, zeros)
            return ""

        def finite_tail(batch, data, cache) -> None:
            slots = freed_slots(batch) if entry.slots == "freed" else tail_slots(batch, cache, entry.tail_tokens)
            if len(slots):
                rows = (len(slots), *data.cache_keys.shape[1:])
                zeros = data.cache_keys.new_zeros(rows)
                cache.layout.write(cache.key_cache, cache.value_cache, slots.to(cache.key_cache.device),
                                   zeros.to(cache.key_cache.device), zeros.to(cache.key_cache.device))

        if reuse:
            attention.check_example(target, example, run=again(example, finite_tail), caller_checked=checked)
        else:
            properties.check(target, example, run=again(example, finite_tail))
        return ""
    except Finding as f:
        return str(f)[:300]  # "[kind] check: message"
    except Exception as e:  # anything unexpected: not shown to be the known bug, so it stays new
        return f"{type(e).__name__}: {str(e)[:300]}"


def match(entry: KnownFinding, target, example, finding, run=None, others=()) -> tuple[bool, str]:
    """Whether ``finding`` (raised by ``example`` on ``target``) is the entry's known bug, and why not.

    Returns ``(True, "")`` or ``(False, reason)``; ``reason`` is "" when target, kind or check differ, else
    what failed (for a near miss worth saying: a known precision bug that outgrew its ``max_ratio``, a
    non-finite output not explained by the entry's slots). A non-finite entry re-runs the example once, in
    this process (module docstring), reusing ``run``'s ground truth, reference and envelope when ``run`` is
    the failing :class:`~kvfuzz.fuzz.harness.run.Run` of this example (the same answer, computed once).
    ``others``: entries whose findings a scoped entry's re-run (its features off) may still show, each of which
    must match that re-run itself (:func:`classify` passes the target's entries; :func:`_off_failure`)."""
    if (entry.target, entry.kind, entry.check) != (target.name, finding.kind.value, finding.check):
        return False, ""
    b = example.batch
    if entry.heads == "equal" and b.num_heads != b.num_kv_heads:
        return False, f"baseline {entry.id} covers num_heads == num_kv_heads only ({b.num_heads} != {b.num_kv_heads})"
    if entry.heads == "group-split":
        from kvfuzz.fuzz.targets.decode_attention import split_heads

        if (finding.details.get("oracle") or {}).get("head") not in split_heads(b):
            return False, (f"baseline {entry.id} covers the heads a group past 16 (not a multiple of 16) reads from "
                           f"another kv head only ({b.num_heads} heads over {b.num_kv_heads})")
    if entry.kind == "memory safety":
        return _memory_match(entry, finding)
    if entry.kind == "non-finite output":
        if example.poison.value not in entry.poisons:
            return False, f"baseline {entry.id} covers poisons {', '.join(entry.poisons)}, not {example.poison.value}"
        if entry.slots == "none":
            return _scoped_match(entry, target, example, finding, others)
        still = _still_fails_with_finite(entry, target, example, run)
        if still:
            return False, (f"baseline {entry.id}: the example still fails with zeros in its {entry.slots} slots, so "
                           f"the non-finite output does not come (only) from there ({still})")
        return True, ""
    if entry.max_ratio is not None:
        oracle = finding.details.get("oracle") or {}
        try:
            ratio = float(oracle["error"]) / float(oracle["bound"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return False, f"baseline {entry.id}: the finding records no error and bound"
        if not ratio <= entry.max_ratio:
            return False, (f"baseline {entry.id} accepts |out - ref| up to {entry.max_ratio:g}x the bound; this one "
                           f"is {ratio:.3g}x: the known bug changed")
    return _scoped_match(entry, target, example, finding, others) if entry.values else (True, "")


class _NoBatchOff(Exception):
    """The example has no valid batch with an entry's features off (:func:`features_off` raised ValueError)."""


def features_off(batch, features):
    """``batch`` with ``features`` off (:data:`FEATURES_OFF`); ``"sliding_window"`` through
    :func:`~kvfuzz.contracts.model.freed_window.without_window` (a freed-window batch's freed columns need blocks of
    their own once every position is visible). Raises ValueError where that is no valid batch."""
    from kvfuzz.contracts.model.freed_window import without_window

    fields = dict(FEATURES_OFF[f] for f in features if f != "sliding_window")
    batch = attrs.evolve(batch, **fields) if fields else batch
    return without_window(batch) if "sliding_window" in features else batch


def _off_failure(entry: KnownFinding, target, example, others=()):
    """What ``example`` re-run with the entry's features off (:data:`FEATURES_OFF`) fails with that no entry
    accepts: None when the re-run passes or fails only with a finding one of ``others`` (not ``entry``), scoped
    or not, matches on the re-run itself (:func:`match`, so a scoped one's own re-run decides too: vllm#57017's
    pad-row NaN at normal values, known while the batch without pads passes); else its Finding, or the
    exception it raised. Each nested match turns more features off and is handed fewer entries, so it ends."""
    from kvfuzz.contracts.checks.failures import Finding
    from kvfuzz.fuzz.harness import properties

    try:
        off = attrs.evolve(example, batch=features_off(example.batch, entry.features))
    except ValueError as e:  # no valid batch without them: nothing shows the feature caused it
        return _NoBatchOff(str(e))
    try:
        properties.check(target, off)
    except Finding as f:
        rest = tuple(o for o in others if o is not entry)
        if any(match(o, target, off, f, others=tuple(x for x in rest if x is not o))[0] for o in rest):
            return None
        return f
    except Exception as e:  # anything unexpected: not shown to be the known bug, so it stays new
        return e
    return None


def _scoped_match(entry: KnownFinding, target, example, finding, others=()) -> tuple[bool, str]:
    """An entry with ``values`` and ``features``: the batch's value range is one of them, it has the features,
    and the same example passes with them off, or fails there only with findings ``others`` accept
    (:func:`_off_failure`): the precision bug at normal values that the larger values magnify, a CUDA-graph pad
    row's known NaN. A re-run failing the finding's own check, or another check that no entry accepts, keeps
    the finding new (the latter is a failure of its own, which accepting this one would hide)."""
    from kvfuzz.contracts.checks.failures import Finding

    b = example.batch
    missing = [f for f in entry.features if getattr(b, FEATURES_OFF[f][0]) in (None, 0)]  # padding: no pads
    if b.value_range not in entry.values or missing:
        return False, (f"baseline {entry.id} covers values {', '.join(entry.values)} with "
                       f"{', '.join(entry.features)}, not values {b.value_range}"
                       + (f" without {', '.join(missing)}" if missing else ""))
    failure = _off_failure(entry, target, example, others)
    if failure is None:
        return True, ""
    off = ", ".join(entry.features)
    if isinstance(failure, Finding) and failure.check == finding.check:
        return False, (f"baseline {entry.id}: the example still fails with {off} off, so the {entry.kind} does not "
                       "come (only) from there")
    if isinstance(failure, _NoBatchOff):
        return False, f"baseline {entry.id}: the example has no valid batch with {off} off ({failure})"
    what = failure.check if isinstance(failure, Finding) else f"raised {type(failure).__name__}"
    return False, (f"baseline {entry.id}: with {off} off the example fails another check ({what}), which no "
                   "baseline entry accepts")


def access_location(access) -> str | None:
    """Where an invalid access of a memory safety finding's ``details["accesses"]`` (a dict of
    :class:`~kvfuzz.fuzz.harness.sanitizer.MemoryAccess`'s fields) is: ``"file:line"``, the file's basename, as an
    entry's ``locations`` name it; None when the report printed no source line."""
    from kvfuzz.fuzz.harness.sanitizer import MemoryAccess

    try:
        return MemoryAccess(**access).location
    except TypeError:  # not a dict of MemoryAccess's fields
        return None


def _memory_match(entry: KnownFinding, finding) -> tuple[bool, str]:
    """A memory safety entry (module docstring): the finding lists an invalid access, and every one it lists is at
    one of the entry's locations (and, with ``kernels``, in one of its kernels)."""
    accesses = finding.details.get("accesses") or []
    if not accesses:
        return False, f"baseline {entry.id}: the memcheck errors list no invalid access, so not its accesses"
    covers = ", ".join(entry.locations) + (f" in {', '.join(entry.kernels)}" if entry.kernels else "")
    for a in accesses:
        where, kernel = access_location(a), a.get("kernel") if isinstance(a, dict) else None
        if where not in entry.locations or (entry.kernels and kernel not in entry.kernels):
            return False, (f"baseline {entry.id} covers invalid accesses at {covers}; this finding has one in "
                           f"{kernel} at {where or '(no source line)'}: a new bug")
    return True, ""


def classify(baseline: Baseline | None, target, example, finding, run=None) -> str | None:
    """The id of the first entry of ``baseline`` that ``finding`` matches (:func:`match`, handed ``run``, the
    example's failing Run when the caller has it), or None. Sets
    ``finding.known`` to it (so its signature differs from a new failure's of the same kind and check) and
    records in ``finding.details["baseline"]`` the entry, or the near misses that kept it new (which its
    message then also names)."""
    if baseline is None:
        return None
    misses = []
    entries = baseline.for_target(target.name)
    for entry in entries:
        ok, why = match(entry, target, example, finding, run, others=entries)
        if ok:
            finding.known = entry.id
            finding.details["baseline"] = {"known": entry.id, "reason": entry.reason, "reference": entry.reference}
            return entry.id
        if why:
            misses.append(why)
    if misses:
        finding.details["baseline"] = {"known": None, "near_misses": misses}
        finding.message += f" (new: {'; '.join(misses)})"
    return None


__all__ = ["FEATURES_OFF", "Baseline", "BaselineError", "KINDS", "KnownFinding", "SLOT_CLASSES", "access_location",
           "classify", "features_off", "load_baseline", "match", "parse_baseline", "tail_slots"]
