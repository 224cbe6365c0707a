"""Invariants a caller must meet before a paged-attention kernel runs, checked against ground truth.

decode invariant (split contract, vllm/v1/attention/ops/chunked_prefill_paged_decode.py,
    kernel_paged_attention_2d): for every decode sequence the cache holds positions ``0 .. seq_len-1`` at
    the slots its block table names.
prefill invariant (split contract, vllm/v1/attention/ops/prefix_prefill.py, context_attention_fwd): for
    every prefill sequence the cache holds positions ``0 .. ctx_len-1``, and the call's ``key``/``value``
    hold its ``query_len`` new tokens, in query_start_loc order.
unified invariant (vllm/v1/attention/ops/triton_unified_attention.py, unified_attention; vLLM's CPU op):
    for every sequence the cache holds positions ``0 .. seq_len-1``.
prefix contract (vllm/v1/attention/ops/prefix_prefill.py, context_attention_fwd with ``skip_decode=False``):
    the prefill invariant applied to every sequence, decode sequences included: the cache holds positions
    ``0 .. ctx_len-1`` of every sequence and ``key``/``value`` hold the new tokens of every sequence
    (:func:`check_prefix_invariant`).

Comparison is bitwise: the harness writes the very values the reference uses, so anything but the same
bits at a slot is a wrong cache state. Each :class:`~kvfuzz.contracts.checks.violations.Violation` says where:
sequence, position, block, slot, kv head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..caches.layouts import CacheLayout
from ..model.batch import Batch, positions
from ..model.contract import Contract
from ..model.data import BatchData
from .violations import Check, Violation, violation

#: The ground-truth invariants, by their :class:`~kvfuzz.contracts.checks.violations.Check`.
DECODE, PREFILL, UNIFIED = Check.DECODE, Check.PREFILL, Check.UNIFIED


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _bit_views(found: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bits of ``found`` and of ``expected`` converted to ``found.dtype``, as integer tensors."""
    return _bits(found.contiguous()), _bits(expected.to(found.dtype).contiguous())


def _same_bits(found: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``found`` and ``expected`` hold the same bits (:func:`_bit_views`): one pass, the whole of a
    passing check's work."""
    return torch.equal(*_bit_views(found, expected))


def _differing_rows(found: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``[n, Hkv, D]`` x2 -> bool ``[n, Hkv]``: where the bits differ."""
    a, b = _bit_views(found, expected)
    return (a != b).any(dim=-1)


def _first_per_seq(check: Check, what: str, batch: Batch, seq: torch.Tensor, pos: torch.Tensor,
                   slot: torch.Tensor, bad: torch.Tensor, found: torch.Tensor,
                   expected: torch.Tensor) -> list[Violation]:
    """One Violation per sequence with any bad row, located at its first bad (position, head). ``what``:
    "cache" (``slot`` holds cache slots) or "key"/"value" (``slot`` holds rows of that argument)."""
    out = []
    bad_rows = bad.any(dim=1)
    if not bad_rows.any():
        return out
    for s in torch.unique(seq[bad_rows]).tolist():  # loop over offending sequences, not tokens
        rows = torch.nonzero(bad_rows & (seq == s)).flatten()
        r = int(rows[0])
        h = int(torch.nonzero(bad[r]).flatten()[0])
        d = int(torch.nonzero(_bits(found[r, h].contiguous()) != _bits(expected[r, h].to(found.dtype).contiguous()))[0])
        sl = int(slot[r])
        more = f" ({len(rows)} positions of this sequence are wrong)" if len(rows) > 1 else ""
        if what == "cache":
            story = f"the cache does not hold this position's key/value{more}"
            block, sl_ = sl // batch.block_size, sl
        else:
            story = f"row {sl} of the {what} argument is not this position's new token{more}"
            block = sl_ = None
        out.append(violation(check, story, seq=s, position=int(pos[r]), block=block, slot=sl_, head=h,
                             expected=f"{float(expected[r, h, d]):.6g}", found=f"{float(found[r, h, d]):.6g}",
                             count=len(rows), source=what))
    return out


def check_cache_holds(invariant: Check, batch: Batch, data: BatchData, layout: CacheLayout,
                      key_cache: torch.Tensor, value_cache: torch.Tensor, lens: dict[int, int]) -> list[Violation]:
    """Check that the cache holds positions ``0 .. lens[seq]-1`` of each listed sequence, bitwise, for keys
    and for values, less the positions of freed window columns (``Batch.freed_window_blocks``: they point at the
    null block). Vectorized over all (sequence, position) pairs."""
    seqs = sorted(lens)
    per_seq = [lens[s] if s in lens else 0 for s in range(batch.num_seqs)]
    if not seqs or sum(per_seq) == 0:
        return []
    # where the data was drawn (a large batch's GPU: no host sync); a freed window column's positions are owed to
    # no one
    seq, pos = batch.held_positions(per_seq, device=data.cache_keys.device)
    if not len(seq):  # every listed position freed (block size 1, window 1): nothing is owed
        return []
    slots = batch.slots(seq, pos)
    k, v = layout.gather(key_cache, value_cache, slots.to(key_cache.device))
    if per_seq == list(batch.seq_lens) and len(data.cache_keys) == len(seq):  # all of them: the rows in order
        exp_k, exp_v = data.cache_keys, data.cache_values
    else:
        rows = data.token_rows(batch, seq, pos)
        exp_k, exp_v = data.cache_keys.index_select(0, rows), data.cache_values.index_select(0, rows)
    # compared where the data was drawn (a large batch's GPU: no copy of its rows), located on the CPU
    k, v = k.to(exp_k.device), v.to(exp_v.device)
    if _same_bits(k, exp_k) and _same_bits(v, exp_v):
        return []
    k, v, exp_k, exp_v, seq, pos, slots = (t.cpu() for t in (k, v, exp_k, exp_v, seq, pos, slots))
    kbad = _differing_rows(k, exp_k)
    bad = kbad | _differing_rows(v, exp_v)
    # report the key's values where the key differs, else the value's
    kbad = kbad.any(dim=1)
    found = torch.where(kbad[:, None, None], k.to(exp_k.dtype), v.to(exp_v.dtype))
    expected = torch.where(kbad[:, None, None], exp_k, exp_v)
    return _first_per_seq(invariant, "cache", batch, seq, pos, slots, bad, found, expected)


def check_decode_invariant(batch: Batch, data: BatchData, layout: CacheLayout, key_cache: torch.Tensor,
                           value_cache: torch.Tensor) -> list[Violation]:
    """Every decode sequence's positions ``0 .. seq_len-1`` are in the cache (see module docstring)."""
    lens = {s: batch.seq_lens[s] for s in batch.decode_seqs}
    return check_cache_holds(DECODE, batch, data, layout, key_cache, value_cache, lens)


def check_prefill_invariant(batch: Batch, data: BatchData, layout: CacheLayout, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, key: torch.Tensor | None,
                            value: torch.Tensor | None, seqs: Iterable[int] | None = None) -> list[Violation]:
    """Every prefill sequence's positions ``0 .. ctx_len-1`` are in the cache, and ``key``/``value``
    (``[num_tokens, num_kv_heads, head_size]``) hold the new tokens of every sequence in query order.

    ``seqs``: the sequences the prefill kernel computes; default the prefill sequences (split contract,
    ``context_attention_fwd(..., skip_decode=True)``); every sequence for the prefix contract
    (:func:`check_prefix_invariant`). Rows of ``key``/``value`` are checked for these sequences only.
    """
    seqs = batch.prefill_seqs if seqs is None else tuple(sorted(set(seqs)))
    lens = {s: batch.ctx_lens[s] for s in seqs}
    out = check_cache_holds(PREFILL, batch, data, layout, key_cache, value_cache, lens)
    exp_k, exp_v = (t.cpu() for t in data.new_kv(batch))
    seq, pos = positions(batch.query_lens, offsets=batch.ctx_lens)
    prefill = torch.tensor([i in seqs for i in range(batch.num_seqs)], dtype=torch.bool)[seq]
    for name, got, exp in (("key", key, exp_k), ("value", value, exp_v)):
        if got is None or tuple(got.shape) != tuple(exp.shape):
            shape = None if got is None else tuple(got.shape)
            out.append(violation(PREFILL, f"the {name} argument has shape {shape} instead of sum(query_len) "
                                          f"tokens x num_kv_heads x head_size", expected=tuple(exp.shape),
                                 found=shape, source=name))
            continue
        got = got.cpu()
        bad = _differing_rows(got, exp) & prefill[:, None]
        rows = torch.arange(len(seq))
        out += _first_per_seq(PREFILL, name, batch, seq, pos, rows, bad, got, exp)
    return out


def check_prefix_invariant(batch: Batch, data: BatchData, layout: CacheLayout, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, key: torch.Tensor | None,
                           value: torch.Tensor | None) -> list[Violation]:
    """The prefill invariant for every sequence, decode included (prefix contract: vLLM's
    vllm/v1/attention/ops/prefix_prefill.py ``context_attention_fwd`` with ``skip_decode=False`` computes
    every sequence from the cache, positions ``0 .. ctx_len-1``, plus ``key``/``value``, its new tokens)."""
    return check_prefill_invariant(batch, data, layout, key_cache, value_cache, key, value,
                                   seqs=range(batch.num_seqs))


def check_unified_invariant(batch: Batch, data: BatchData, layout: CacheLayout, key_cache: torch.Tensor,
                            value_cache: torch.Tensor) -> list[Violation]:
    """Every sequence's positions ``0 .. seq_len-1`` are in the cache (see module docstring)."""
    lens = dict(enumerate(batch.seq_lens))
    return check_cache_holds(UNIFIED, batch, data, layout, key_cache, value_cache, lens)


def check_contract(contract: Contract, batch: Batch, data: BatchData, layout: CacheLayout,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor | None = None,
                   value: torch.Tensor | None = None) -> list[Violation]:
    """All invariants of ``contract`` for one call; an empty list means the caller kept the contract. A cache
    writer (:attr:`Contract.WRITER`) reads nothing from the cache: it has no cache invariant, and what it
    leaves is checked by the writer property (:mod:`kvfuzz.fuzz.harness.writer`); a merge
    (:attr:`Contract.MERGE`) reads no cache at all (its parts are checked by :mod:`kvfuzz.fuzz.harness.merge`)."""
    if contract in (Contract.WRITER, Contract.MERGE):
        return []
    if contract is Contract.SPLIT:
        return (check_decode_invariant(batch, data, layout, key_cache, value_cache)
                + check_prefill_invariant(batch, data, layout, key_cache, value_cache, key, value))
    if contract is Contract.PREFIX:
        return check_prefix_invariant(batch, data, layout, key_cache, value_cache, key, value)
    return check_unified_invariant(batch, data, layout, key_cache, value_cache)


__all__ = ["check_cache_holds", "check_contract", "check_decode_invariant", "check_prefill_invariant",
           "check_prefix_invariant", "check_unified_invariant"]
