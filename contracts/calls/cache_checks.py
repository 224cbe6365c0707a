"""What the kernel reads from the cache, against what the call says should be there (checks of one real call;
see :mod:`kvfuzz.contracts.calls.call_checks`): the new tokens the kernel reads from the cache are there (the
decode and unified invariants, bitwise, after the cache dtype's quantization), and a warning when the region
read is all zeros or constant (vacuity).

Sources: vllm/v1/attention/ops/chunked_prefill_paged_decode.py (``kernel_paged_attention_2d`` reads all
seq_len positions of a decode from the cache), csrc/cache_kernels.cu (``scaled_convert``: how a writer stores
fp8), SGLang's triton_backend.py (the current token written to the pool before decode).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..checks.violations import MAX_RECORDS_PER_CHECK, Category, Check, Severity, Violation, capped, violation
from .kv_cache_dtype import as_cache_repr, scale_value
from .paged_call import Lens, NewTokensCached, PagedCall, bits, fmt, index_values, is_tensor


def _differs(found: torch.Tensor, expected: torch.Tensor, fp8: torch.dtype | None) -> torch.Tensor:
    """bool ``[n, Hkv]``: rows whose bits differ (fp8: by more than one code, or sign; +0 == -0)."""
    if fp8 is None:
        return (bits(found) != bits(expected)).any(dim=-1)
    a, b = bits(found.view(fp8)).to(torch.int16), bits(expected).to(torch.int16)
    same = ((a - b).abs() <= 1) & ((a & 0x80) == (b & 0x80))
    same |= (found.view(fp8).float() == expected.float())
    return (~same).any(dim=-1)


#: How a CSR (SGLang) caller keeps the unified contract.
CSR_NEW_TOKENS_FIX = ("write the current token's k/v into the pool at its slot (the last kv_indices entry of the "
                      "sequence) before calling, as SGLang's backend does (token_to_kv_pool.set_kv_buffer at "
                      "out_cache_loc, then decode_attention_fwd): the decode kernel reads every listed slot, the "
                      "current token's included")


def check_new_tokens_cached(call: PagedCall, lens: Lens, readable: torch.Tensor, *,
                            rocm_arch: str | None = None) -> list[Violation]:
    """The new tokens the kernel reads from the cache are there: bitwise, the cache at each new token's slot
    holds the ``key``/``value`` row the call passes for it (cast to the cache dtype; fp8 caches: ``(k / k_scale)``
    rounded to the fp8 dtype, one code of rounding slack).

    split contract (``new_tokens_cached`` is ``DECODE``): every decode sequence (query_len == 1) at position
    ``seq_len-1`` — the **decode invariant** (chunked_prefill_paged_decode.py: ``kernel_paged_attention_2d``
    gets no key/value and reads all seq_len positions from the cache). unified contract (``"all"``, only when
    the caller hands the new tokens' key/value to the checker: unified kernels take none): every sequence's
    last query_len positions — the **unified invariant**. Sequences with unreadable blocks are skipped (the
    block checks report them). With an interleaved value cache (``use_interleaved_v_cache``, vLLM's
    test_prefix_prefill.py ``interleave_v``) only the keys are compared. Returns one record per offending sequence, at
    its first wrong (position, head).
    """
    if call.new_tokens_cached is NewTokensCached.NONE or not is_tensor(call.key) or not is_tensor(call.value) \
            or call.skip_blocks:
        return []
    if call.key.shape[0] != int(lens.qsl[-1]):
        return []  # Check.PREFILL_ROWS reports it; rows cannot be matched to tokens
    where = _new_token_slots(call, lens, readable)
    if where is None:
        return []
    compared = _compare(call, where, rocm_arch)
    if compared is None:
        return []
    bad_rows = (compared.kbad | compared.vbad).any(axis=1)
    if not bad_rows.any():
        return []
    offenders = np.unique(where.seq[bad_rows])
    out = [_missing_token(call, lens, where, compared, bad_rows & (where.seq == s), s)
           for s in offenders[:MAX_RECORDS_PER_CHECK].tolist()]
    return capped(out, len(offenders))


class _Slots(NamedTuple):
    """Where the invariant looks, one entry per new token it covers (numpy, host): its sequence, position, row of
    the call's key/value, block and slot; the check (decode or unified) and every sequence's query_len."""

    check: Check
    ql: np.ndarray
    seq: np.ndarray
    pos: np.ndarray
    rows: np.ndarray
    blk: np.ndarray
    slots: np.ndarray


def _new_token_slots(call: PagedCall, lens: Lens, readable: torch.Tensor) -> _Slots | None:
    """The new tokens the invariant covers (decode sequences, or every sequence's), readable ones only; None: none.
    The index arithmetic runs in numpy on the host (small arrays; a torch operator costs microseconds of
    dispatch)."""
    query_lens, ctx_lens, qsl = (x.numpy() for x in (lens.query_lens, lens.ctx_lens, lens.qsl))
    ql = np.maximum(query_lens, 0)
    include = readable.numpy() & (query_lens >= 0) & (ctx_lens >= 0)
    if call.new_tokens_cached is NewTokensCached.DECODE:
        include &= query_lens == 1
        check = Check.DECODE
    else:
        check = Check.UNIFIED
    counts = np.where(include, ql, 0)
    total = int(counts.sum())
    if total == 0:
        return None
    seq = np.repeat(np.arange(len(counts)), counts)
    j = np.arange(total) - (np.cumsum(counts) - counts)[seq]
    pos = ctx_lens[seq] + j
    bt = index_values(call.block_table).numpy()
    bs = call.block_size
    blk = bt[seq, pos // bs]
    return _Slots(check, ql, seq, pos, qsl[seq] + j, blk, blk * bs + pos % bs)


class _Compared(NamedTuple):
    """The cache's rows at the slots and the rows expected there (cache representation), per key and value, and
    which ``[token, head]`` differ (numpy bool)."""

    found_k: torch.Tensor
    found_v: torch.Tensor
    exp_k: torch.Tensor
    exp_v: torch.Tensor
    fp8: torch.dtype | None
    desc: str
    kbad: np.ndarray
    vbad: np.ndarray


def _compare(call: PagedCall, where: _Slots, rocm_arch: str | None) -> _Compared | None:
    """The cache at ``where``'s slots against the call's key/value rows for those tokens, cast as a writer stores
    them; None for per-head scales or a mismatched cache dtype (Check.KV_CACHE_DTYPE reports it)."""
    dev = call.key_cache.device
    kc_rows, vc_rows = call.layout.gather(call.key_cache, call.value_cache, torch.from_numpy(where.slots).to(dev))
    rows = where.rows
    if len(rows) == call.key.shape[0] and rows[0] == 0 and (np.diff(rows) == 1).all():  # every row, in order
        key_rows, value_rows = call.key, call.value
    else:
        rows_d = torch.from_numpy(rows).to(call.key.device)
        key_rows, value_rows = call.key[rows_d], call.value[rows_d]
    exp_k, fp8, desc = as_cache_repr(call, key_rows.to(dev), scale_value(call.k_scale), rocm_arch)
    exp_v, _, _ = as_cache_repr(call, value_rows.to(dev), scale_value(call.v_scale), rocm_arch)
    if (fp8 is not None and scale_value(call.k_scale) is None) or (fp8 is None and kc_rows.dtype != exp_k.dtype):
        return None
    kbad = _differs(kc_rows, exp_k, fp8)
    # an interleaved value cache (use_interleaved_v_cache) cannot be read through the layout: keys only
    vbad = torch.zeros_like(kbad) if call.skip_value_layout else _differs(vc_rows, exp_v, fp8)
    kbad, vbad = torch.stack([kbad, vbad]).cpu().numpy()  # one device-to-host copy (one sync on a GPU)
    return _Compared(kc_rows, vc_rows, exp_k, exp_v, fp8, desc, kbad, vbad)


def _missing_token(call: PagedCall, lens: Lens, where: _Slots, cmp: _Compared, in_s: np.ndarray,
                   s: int) -> Violation:
    """The record of sequence ``s``, whose tokens ``in_s`` (a mask over ``where``) are not in the cache: at its
    first wrong (position, head), key before value."""
    r = int(np.flatnonzero(in_s)[0])
    is_k = bool(cmp.kbad[r].any())
    h = int(np.flatnonzero(cmp.kbad[r] if is_k else cmp.vbad[r])[0])
    got, exp = (cmp.found_k, cmp.exp_k) if is_k else (cmp.found_v, cmp.exp_v)
    g = got[r, h].view(cmp.fp8) if cmp.fp8 is not None else got[r, h]
    e = exp[r, h]
    d = int(torch.nonzero(bits(g) != bits(e)).flatten()[0]) if (bits(g) != bits(e)).any() else 0
    n_bad = int(in_s.sum())
    p = int(where.pos[r])
    row = int(where.rows[r])
    which = "key" if is_k else "value"
    if where.check == Check.DECODE:
        sl = int(lens.seq_lens[s])
        story = (f"sequence {s} is a decode (query_len 1, seq_len {sl}), so the decode kernel reads "
                 f"{'all ' + str(sl) + ' positions' if sl > 1 else 'its 1 position'} from the cache, but its "
                 f"current token's {which} "
                 f"({call.name(which)} row {row}) is not in the cache at position {p}")
    else:
        story = (f"the unified kernel reads all {int(lens.seq_lens[s])} positions of sequence {s} from the cache, "
                 f"but the {which} of its new token at position {p} (row {row} of the {which} handed "
                 f"to the guard) is not there" + (f"; {n_bad} of its {int(where.ql[s])} new positions are missing"
                                                  if n_bad > 1 else ""))
    csr = call.csr is not None  # a token pool: the "block" is the slot
    return violation(where.check, story, kernel=call.kernel, seq=s, position=p,
                     block=None if csr else int(where.blk[r]), slot=int(where.slots[r]), head=h,
                     expected=f"{fmt(float(e[d]))} ({cmp.desc}, head dim {d})",
                     found=f"{fmt(float(g[d]))} in the cache", count=n_bad, source="cache",
                     fix=CSR_NEW_TOKENS_FIX if csr else None)


#: Vacuity samples this many rows of the read region first; only a constant sample triggers a full pass.
VACUITY_SAMPLE_ROWS = 64


def check_vacuity(call: PagedCall, lens: Lens, readable: torch.Tensor) -> list[Violation]:
    """Warning when the key or value cache region the kernel reads is all zeros or one constant: such a test
    cannot tell a right read from a wrong one (e.g. vLLM's test_prefix_prefill.py fp8 cases copy fp16 values of
    magnitude <= 1e-3 into a uint8 cache, which stores them as 0).

    The region: per sequence positions ``0 .. n-1`` with n = ctx_len for prefill and seq_len for decode
    sequences (split contract), seq_len (unified, or ``context_attention_fwd`` with ``k=None``), ctx_len
    (``context_attention_fwd``); sequences with unreadable blocks are left out; sliding windows are ignored
    (the region may be larger than what is read); an interleaved value cache is not judged (keys only). Cost:
    one gather of at most :data:`VACUITY_SAMPLE_ROWS` rows
    unless that sample is constant.
    """
    if call.skip_blocks:
        return []
    n = call.cache_reads.positions(lens)
    n = torch.where(readable, n.clamp(min=0), torch.zeros_like(n))
    total = int(n.sum())
    if total == 0:
        return []
    bt = index_values(call.block_table)
    bs = call.block_size
    dev = call.key_cache.device

    def slots_of(idx: torch.Tensor) -> torch.Tensor:
        starts = torch.cumsum(n, 0) - n
        seq = torch.searchsorted(torch.cumsum(n, 0), idx, right=True)
        pos = idx - starts[seq]
        return bt[seq, pos // bs] * bs + pos % bs

    def constant(idx: torch.Tensor) -> tuple[bool, bool, torch.Tensor, torch.Tensor]:
        kr, vr = call.layout.gather(call.key_cache, call.value_cache, slots_of(idx).to(dev))
        kb, vb = bits(kr).reshape(-1), bits(vr).reshape(-1)
        kc, vc = torch.stack([(kb == kb[0]).all(), (vb == vb[0]).all()]).tolist()  # one sync on a GPU
        vconst = vc and not call.skip_value_layout  # interleaved values: keys only
        return kc, vconst, kr.reshape(-1)[0], vr.reshape(-1)[0]

    sample = torch.unique(torch.linspace(0, total - 1, min(total, VACUITY_SAMPLE_ROWS), dtype=torch.float64,
                                         device=n.device).round().long())
    kconst, vconst, k0, v0 = constant(sample)
    if (kconst or vconst) and len(sample) < total:
        # confirm on the whole region, in chunks
        kc_all, vc_all = kconst, vconst
        for start in range(0, total, 65536):
            idx = torch.arange(start, min(total, start + 65536))
            kk, vv, k1, v1 = constant(idx)
            kc_all &= kk and bool(bits(k1.reshape(1)) == bits(k0.reshape(1)))
            vc_all &= vv and bool(bits(v1.reshape(1)) == bits(v0.reshape(1)))
            if not (kc_all or vc_all):
                break
        kconst, vconst = kc_all, vc_all
    out = []
    nseq = int((n > 0).sum())
    for name, const, v0_ in (("key", kconst, k0), ("value", vconst, v0)):
        if not const:
            continue
        val = float(v0_.float()) if v0_.dtype != torch.uint8 else int(v0_)
        what = "all zeros" if bits(v0_.reshape(1)).item() == 0 else f"the constant {fmt(float(val))}"
        out.append(violation(
            Check.VACUITY, f"the {name} cache region the kernel reads ({total} positions of {nseq} sequences, "
            f"{call.key_cache.dtype} storage) is {what}, so a wrong read (wrong block, slot, position or length) "
            f"gives the same output as a right one and the test cannot catch it",
            kernel=call.kernel, expected=f"varied values in the {name} cache", found=what,
            severity=Severity.WARNING, category=Category.VACUITY, count=total))
    return out


__all__ = ["CSR_NEW_TOKENS_FIX", "VACUITY_SAMPLE_ROWS", "check_new_tokens_cached", "check_vacuity"]
