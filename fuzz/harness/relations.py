"""Metamorphic relations: oracles that need no tolerance where the kernel is deterministic.

The fp64-reference oracle (:mod:`kvfuzz.contracts.checks.oracles`) must allow rounding error, and an error that
fits inside the tolerance goes unseen. A metamorphic relation instead runs the kernel twice on inputs that
must give the same answer and compares the two outputs **bit for bit** (except decode-prefill consistency,
where two different kernel paths meet and the oracle's bound is used):

- ``poison-invariance[nan|inf|stale]``: the slots the contract says are not read (other sequences' blocks,
  spare blocks, the tail of a last block, positions past the contract, and reused scratch buffers) hold
  zeros in one run and NaN / +inf / large finite stale values in the other;
- ``block-relocation``: every block a sequence uses moves to another physical id and the block table is
  rewritten accordingly (tokens and poison stay with their physical slots);
- ``batch-order``: the sequences are permuted; each output row must move with its sequence;
- ``batch-invariance``: each sequence alone gives the rows it gets inside the mixed batch (same cache);
- ``determinism``: the same call twice gives the same bits;
- ``decode-prefill``: decoding position ``p`` of a prefill sequence (a decode call with ``ctx_len = p``)
  gives its prefill row, within twice the oracle's per-row bound.

``batch-invariance`` and ``determinism`` are *design properties* (:attr:`Relation.design_property`): many
correct kernels are not batch invariant (split heuristics depend on the batch) or not deterministic (atomic
reductions) by design; a violation says the kernel is not, not that it is wrong. A violation of the others
is a kernel bug: the output depends on something it must not read.

Each relation raises :class:`RelationViolation` (kind "kernel mismatch", check = the relation's name), whose
message locates the first differing element (sequence, position, head, dim, both values).
"""

from __future__ import annotations

import json
import random
from typing import Callable

import attrs
import torch

from kvfuzz.contracts.caches.materialize import CacheState, materialize
from kvfuzz.contracts.checks.failures import FailureKind, Finding, KernelCrash
from kvfuzz.contracts.checks.oracles import RTOL, row_floor
from kvfuzz.contracts.checks.reference import reference_attention, same_precision_attention
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import BatchData, make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.run import error_name, run_kernel
from kvfuzz.fuzz.harness.states import active_hooks
from kvfuzz.fuzz.targets.base import Target


class RelationViolation(Finding):
    """A metamorphic relation does not hold: two outputs that must agree differ."""

    kind = FailureKind.KERNEL_MISMATCH


# ---- building and running calls ------------------------------------------------------------------------

def materialize_with(target: Target, batch: Batch, data: BatchData, poison: Poison,
                     poison_seeds: tuple[int, int] | None = None,
                     cached_lens: tuple[int, ...] | None = None) -> CacheState:
    """:func:`kvfuzz.contracts.caches.materialize.materialize` in the target's layout and on its device, with the
    target's contract's cached lengths unless ``cached_lens`` is given, and explicit poison seeds."""
    lens = target.capabilities.contract.cached_lens(batch) if cached_lens is None else tuple(cached_lens)
    return materialize(batch, data, target.layout(batch), lens, poison, device=target.device,
                       poison_seeds=poison_seeds)


def call_kernel(target: Target, batch: Batch, data: BatchData, cache: CacheState,
                prefill_output: float | None = float("nan")) -> torch.Tensor:
    """Build and run one call; returns the output on the CPU (a copy). The output buffer is pre-filled with
    ``prefill_output`` (so memory left from an earlier run cannot make two runs agree or differ). Raises
    :class:`~kvfuzz.contracts.checks.failures.KernelCrash` if the kernel raises."""
    call = target.build_call(batch, data, cache)
    if prefill_output is not None:
        call.output.fill_(prefill_output)
    out, crash = run_kernel(target, call)
    if crash is not None:
        raise KernelCrash(f"raised {error_name(crash)}", crash.splitlines()[0],
                          {"traceback": crash, "batch": batch.summary()})
    return out.detach().to("cpu", copy=True)


def _locate(batch: Batch, token: int) -> tuple[int, int]:
    qsl = batch.query_start_loc
    seq = max(i for i in range(batch.num_seqs) if qsl[i] <= token)
    return seq, batch.ctx_lens[seq] + token - qsl[seq]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _fmt(x: float) -> str:
    return repr(float(x))


def compare_bits(relation: str, batch: Batch, a: torch.Tensor, b: torch.Tensor, what_a: str, what_b: str,
                 tokens: torch.Tensor | None = None, details: dict | None = None) -> None:
    """Raise :class:`RelationViolation` unless ``a`` and ``b`` (``[T', H, D]``, rows ``tokens`` of
    ``batch``'s output; all rows when None) are bit-identical. Two NaNs count as equal whatever their
    payload (a NaN output is the finiteness oracle's finding, not a relation's)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise RelationViolation(relation, f"{what_a} has shape {tuple(a.shape)} {a.dtype}, {what_b} "
                                          f"{tuple(b.shape)} {b.dtype}", details)
    diff = (_bits(a) != _bits(b)) & ~(a.isnan() & b.isnan())
    if not diff.any():
        return
    r, h, d = (int(i) for i in torch.nonzero(diff)[0])
    token = int(tokens[r]) if tokens is not None else r
    seq, pos = _locate(batch, token)
    va, vb = float(a[r, h, d]), float(b[r, h, d])
    rows = int(diff.any(dim=-1).sum())
    fa, fb = a.double(), b.double()
    finite = diff & fa.isfinite() & fb.isfinite()
    maxdiff = float((fa - fb).abs()[finite].max()) if finite.any() else float("nan")
    msg = (f"{what_a} and {what_b} differ in {int(diff.sum())} elements of {rows} (token, head) rows "
           f"(max |diff| over finite pairs {maxdiff:.3g}); first at sequence {seq} position {pos} (output row "
           f"{token}), head {h}, dim {d}: {_fmt(va)} vs {_fmt(vb)}")
    raise RelationViolation(relation, msg, {**(details or {}), "seq": seq, "position": pos, "token": token,
                                            "head": h, "dim": d, "a": va, "b": vb, "elements": int(diff.sum()),
                                            "rows": rows})


def _rng(batch: Batch, salt: str) -> random.Random:
    return random.Random(f"{salt}:{batch.seed}:{batch.num_seqs}:{batch.num_blocks}")


def _sub_data(batch: Batch, data: BatchData, order: list[int]) -> BatchData:
    """The data of sequences ``order`` (original indices), in that order."""
    qsl, ssl = batch.query_start_loc, batch.seq_start_loc
    return data.select(torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in order]),
                       torch.cat([torch.arange(ssl[i], ssl[i + 1]) for i in order]))


def _token_rows(batch: Batch, order: list[int]) -> torch.Tensor:
    qsl = batch.query_start_loc
    return torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in order])


def _sub_batch(batch: Batch, order: list[int], **changes) -> Batch:
    return attrs.evolve(batch, query_lens=[batch.query_lens[i] for i in order],
                        ctx_lens=[batch.ctx_lens[i] for i in order],
                        block_table=[batch.block_table[i] for i in order], **changes)


# ---- relations -----------------------------------------------------------------------------------------

@attrs.frozen
class Relation:
    """A metamorphic relation, run as its own property.

    name: the check name findings carry. description: one line. design_property: a violation says the
    kernel does not have a property many correct kernels lack by design (batch invariance, determinism),
    not that its output is wrong. exact: compared bit for bit (else within the oracle's bound).
    """

    name: str
    description: str
    _check: Callable[[Target, Example], None] = attrs.field(repr=False)
    _applies: Callable[[Target, Batch], bool] = attrs.field(default=lambda t, b: True, repr=False)
    design_property: bool = False
    exact: bool = True
    #: False when the relation can never apply to the target (e.g. decode-only kernels and decode-prefill)
    _for_target: Callable[[Target], bool] = attrs.field(default=lambda t: True, repr=False)

    def applies_to_target(self, target: Target) -> bool:
        """Whether any batch of ``target`` can be checked: never for cache writers (their output is the
        cache, checked bitwise by the writer property)."""
        return target.capabilities.contract.is_attention and self._for_target(target)

    def applies(self, target: Target, batch: Batch) -> bool:
        return self.applies_to_target(target) and self._applies(target, batch)

    def check(self, target: Target, example: Example) -> None:
        """Run the relation on ``example``; raise :class:`RelationViolation` when it does not hold (or
        :class:`~kvfuzz.contracts.checks.failures.KernelCrash` when the kernel raises). ValueError if it does not
        apply."""
        if not self.applies(target, example.batch):
            raise ValueError(f"relation {self.name} does not apply to {target.name} on {example.batch.summary()}")
        for hooks in active_hooks(example.batch):  # a state the relations leave to the property (the pads)
            example = attrs.evolve(example, batch=hooks.for_relations(example.batch))
        self._check(target, example)


def _call_data(target: Target, batch: Batch) -> BatchData:
    """The batch's ground truth as its caller hands it to the kernel (:meth:`Target.call_data`: an fp8 query)."""
    return target.call_data(batch, make_batch_data(batch))


def _poison_invariance(level: Poison) -> Callable[[Target, Example], None]:
    name = f"poison-invariance[{level.value}]"

    def check(target: Target, example: Example) -> None:
        b = example.batch
        data = _call_data(target, b)
        # different seeds too, so two stale fills differ everywhere; zeros is the clean baseline
        clean = call_kernel(target, b, data, materialize_with(target, b, data, Poison.ZEROS))
        dirty = call_kernel(target, b, data, materialize_with(target, b, data, level, (b.seed + 11, b.seed + 12)))
        compare_bits(name, b, clean, dirty, "the output with zeros in the unread slots",
                     f"the output with {level.value} there", details={"poison": level.value})

    return check


def relocated(batch: Batch) -> Batch:
    """``batch`` with every block a sequence uses moved to another physical id (a permutation of the
    ``max(num_blocks, 2)`` ids, drawn from the seed, that moves every used block); unused table columns
    keep their padding."""
    n = max(batch.num_blocks, 2)
    used = {b for i, row in enumerate(batch.block_table) for b in row[:batch.blocks_needed(i)]}
    rng = _rng(batch, "relocate")
    perm = list(range(n))
    for _ in range(100):
        rng.shuffle(perm)
        if all(perm[x] != x for x in used):
            break
    else:  # a rotation moves everything
        perm = [(x + 1) % n for x in range(n)]
    table = [[perm[x] if c < batch.blocks_needed(i) else x for c, x in enumerate(row)]
             for i, row in enumerate(batch.block_table)]
    return attrs.evolve(batch, num_blocks=n, block_table=table)


def _block_relocation(target: Target, example: Example) -> None:
    b = example.batch
    b2 = relocated(b)
    data = _call_data(target, b)
    out1 = call_kernel(target, b, data, materialize_with(target, b, data, example.poison))
    out2 = call_kernel(target, b2, data, materialize_with(target, b2, data, example.poison))
    compare_bits("block-relocation", b, out1, out2,
                 "the output with block table " + str([list(r) for r in b.block_table]),
                 "with " + str([list(r) for r in b2.block_table]), details={"relocated_table": b2.block_table})


def sequence_permutation(batch: Batch) -> list[int]:
    """A permutation of the sequences (drawn from the seed), never the identity for 2+ sequences."""
    order = list(range(batch.num_seqs))
    _rng(batch, "order").shuffle(order)
    if order == sorted(order):
        order.reverse()
    return order


def _batch_order(target: Target, example: Example) -> None:
    b = example.batch
    order = sequence_permutation(b)
    b2 = _sub_batch(b, order)
    data = _call_data(target, b)
    data2 = _sub_data(b, data, order)
    out1 = call_kernel(target, b, data, materialize_with(target, b, data, example.poison))
    out2 = call_kernel(target, b2, data2, materialize_with(target, b2, data2, example.poison))
    back = torch.empty_like(out2)
    back[_token_rows(b, order)] = out2
    compare_bits("batch-order", b, out1, back, "the output in the original order",
                 f"the rows of the batch with its sequences in order {order}", details={"order": order})


def _batch_invariance(target: Target, example: Example) -> None:
    b = example.batch
    data = _call_data(target, b)
    full = call_kernel(target, b, data, materialize_with(target, b, data, example.poison))
    for i in range(b.num_seqs):
        solo = _sub_batch(b, [i])
        cache = materialize_with(target, b, data, example.poison)  # the mixed batch's cache, as it was
        alone = call_kernel(target, solo, _sub_data(b, data, [i]), cache)
        rows = _token_rows(b, [i])
        compare_bits("batch-invariance", b, full[rows], alone, "the rows inside the mixed batch",
                     f"the output of sequence {i} alone", tokens=rows, details={"sequence": i})


def _determinism(target: Target, example: Example) -> None:
    b = example.batch
    data = _call_data(target, b)
    out1 = call_kernel(target, b, data, materialize_with(target, b, data, example.poison))
    out2 = call_kernel(target, b, data, materialize_with(target, b, data, example.poison))
    compare_bits("determinism", b, out1, out2, "the first run", "the second run on the same input")


def decode_probe(batch: Batch, data: BatchData, j_of: Callable[[int], int]) -> tuple[Batch, BatchData, torch.Tensor]:
    """One decode call probing query token ``j_of(seq)`` of every prefill sequence: a decode sequence with
    ``ctx_len = ctx_len + j``, that token's query, the same keys/values and block table row. Returns the
    decode batch, its data, and the rows of ``batch``'s output the probes correspond to."""
    pre = list(batch.prefill_seqs)
    qsl, ssl = batch.query_start_loc, batch.seq_start_loc
    js = [j_of(i) for i in pre]
    ctx = [batch.ctx_lens[i] + j for i, j in zip(pre, js)]
    probe = attrs.evolve(batch, query_lens=[1] * len(pre), ctx_lens=ctx,
                         block_table=[batch.block_table[i] for i in pre])
    rows = torch.tensor([qsl[i] + j for i, j in zip(pre, js)], dtype=torch.int64)
    kv_rows = torch.cat([torch.arange(ssl[i], ssl[i] + c + 1) for i, c in zip(pre, ctx)])
    return probe, data.select(rows, kv_rows), rows


def _decode_prefill(target: Target, example: Example) -> None:
    b = example.batch
    data = _call_data(target, b)
    full = call_kernel(target, b, data, materialize_with(target, b, data, example.poison))
    ref, lowp = reference_attention(b, data), same_precision_attention(b, data)
    floor = row_floor(b, ref)
    probes = {"last": lambda i: b.query_lens[i] - 1, "first": lambda i: 0}
    for which, j_of in probes.items():
        probe, pdata, rows = decode_probe(b, data, j_of)
        dec = call_kernel(target, probe, pdata, materialize_with(target, probe, pdata, example.poison))
        pre = full[rows].double()
        d = dec.double()
        bound = 2 * (RTOL[b.dtype] * (lowp[rows] - ref[rows]).abs().amax(dim=-1) + floor[rows])  # [n, H]
        err = (pre - d).abs()
        bad = ~(err <= bound[..., None]) & ~(pre.isnan() & d.isnan())
        if not bad.any():
            continue
        r, h, dd = (int(i) for i in torch.nonzero(bad)[0])
        token = int(rows[r])
        seq, pos = _locate(b, token)
        raise RelationViolation(
            "decode-prefill",
            f"decoding position {pos} of prefill sequence {seq} (a decode call with ctx_len {pos}) disagrees "
            f"with its prefill row (output row {token}) beyond twice the oracle bound in "
            f"{int(bad.any(dim=-1).sum())} (token, head) rows; first at head {h}, dim {dd}: prefill "
            f"{_fmt(pre[r, h, dd])} vs decode {_fmt(d[r, h, dd])}, |diff| {float(err[r, h, dd]):.3g} > bound "
            f"{float(bound[r, h]):.3g} ({which} query token of each prefill probed)",
            {"seq": seq, "position": pos, "token": token, "head": h, "dim": dd, "a": float(pre[r, h, dd]),
             "b": float(d[r, h, dd]), "bound": float(bound[r, h]), "probe": which})


def _multi(target: Target, batch: Batch) -> bool:
    return batch.num_seqs >= 2


RELATIONS: dict[str, Relation] = {
    r.name: r for r in [
        *(Relation(f"poison-invariance[{p.value}]",
                   f"unread cache slots and scratch holding {p.value} instead of zeros leave the output "
                   "bit-identical", _poison_invariance(p))
          for p in (Poison.NAN, Poison.INF, Poison.STALE)),
        Relation("block-relocation", "moving every used block to another physical id (block table rewritten) "
                 "leaves the output bit-identical", _block_relocation),
        Relation("batch-order", "permuting the sequences permutes the output rows with them, bit for bit",
                 _batch_order, _multi),
        Relation("batch-invariance", "each sequence alone gives bit-identical rows to those it gets in the "
                 "mixed batch", _batch_invariance, _multi, design_property=True),
        Relation("determinism", "two runs of the same call give the same bits", _determinism,
                 design_property=True),
        Relation("decode-prefill", "decoding position p of a prefill sequence agrees with its prefill row within "
                 "twice the oracle's per-row bound", _decode_prefill,
                 lambda t, b: bool(b.prefill_seqs), exact=False,
                 for_target=lambda t: not t.capabilities.decode_only),
    ]
}


def example_key(example: Example) -> str:
    """The example as canonical JSON (sorted keys): equal examples give equal keys."""
    return json.dumps(example.to_dict(), sort_keys=True)


__all__ = ["RELATIONS", "Relation", "RelationViolation", "call_kernel", "compare_bits", "decode_probe",
           "example_key", "materialize_with", "relocated", "sequence_permutation"]
