"""The "CUDA-graph padding" state in the attention property (:mod:`kvfuzz.contracts.model.padding`): what the
harness does around a call with pad sequences, whatever the target.

Before the call: SGLang's pad reads token slot 0, where its pad token wrote its own key and value
(:func:`fill_pad_slot`); the output's pad rows hold finite values, as the engine's reused activation buffer
does (the rest of the output is NaN, :func:`~kvfuzz.fuzz.harness.attention.poison_output`), so a kernel that
leaves a pad row alone passes and one that writes NaN or inf there fails. After it: the pad rows are finite
(``Oracle.PAD_FINITE``) and the paged cache is bitwise as before (``Oracle.PAD_WRITES``: an attention
kernel writes nothing, the null block and slot 0 included). The real rows are checked against the reference
as without pads (:func:`~kvfuzz.fuzz.harness.attention.check_example`). The attention property reaches these
through the state's hooks, :class:`~kvfuzz.fuzz.harness.states.PaddingHooks` (:data:`kvfuzz.fuzz.harness.states.HOOKS`).
"""

from __future__ import annotations

import attrs
import torch

from kvfuzz.contracts.caches.materialize import CacheState, is_big
from kvfuzz.contracts.calls.paged_call import bits
from kvfuzz.contracts.checks.oracles import (
    OracleFailure,
    block_digests,
    check_cache_digests,
    check_cache_unchanged,
    check_pad_rows,
)
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.padding import PAD_SLOT
from kvfuzz.fuzz.targets.base import KernelCall, Target


def fill_pad_slot(target: Target, batch: Batch, data: BatchData, cache: CacheState) -> None:
    """Under SGLang's convention, with pads and slot :data:`PAD_SLOT` unwritten (poison): write zeros there, the
    finite key and value SGLang's pad tokens leave in the slot (the pool starts zeroed; ``out_cache_loc.zero_()``
    sends the pads' writes there). Nothing otherwise."""
    if not batch.num_pad_seqs or target.capabilities.cuda_graph_padding != "sglang":
        return
    if bool((cache.written_slots == PAD_SLOT).any()):
        return
    keys = torch.zeros_like(data.cache_keys[:1])
    values = torch.zeros_like(data.cache_values[:1])
    dev = cache.key_cache.device
    slots = torch.tensor([PAD_SLOT], dtype=torch.int64, device=dev)
    cache.layout.write(cache.key_cache, cache.value_cache, slots, keys.to(dev), values.to(dev))


@attrs.define
class PadSnapshot:
    """What a padded call must leave as it was: the caches' bits before the kernel ran (None without pads), or
    for caches over :data:`~kvfuzz.contracts.caches.materialize.FULL_POISON_MAX_BYTES` together (a big-cache
    example: a copy would double several GiB on a device that workers share) their
    :func:`~kvfuzz.contracts.checks.oracles.block_digests` (``digests`` True)."""

    caches: tuple[torch.Tensor, torch.Tensor] | None = None
    digests: bool = False

    @classmethod
    def before(cls, batch: Batch, call: KernelCall) -> "PadSnapshot":
        """Right before the kernel runs: fills the output's pad rows (rows ``num_tokens ..``) with zeros and
        copies the caches' bits; nothing for a batch without pads."""
        if not batch.num_pad_seqs:
            return cls()
        out = call.output
        if isinstance(out, torch.Tensor) and out.dtype.is_floating_point and out.shape[0] > batch.num_tokens:
            out[batch.num_tokens:].zero_()
        if is_big(call.key_cache, call.value_cache):
            return cls((block_digests(call.key_cache), block_digests(call.value_cache)), digests=True)
        return cls((bits(call.key_cache).clone(), bits(call.value_cache).clone()))

    def after(self, batch: Batch, output: torch.Tensor, call: KernelCall) -> OracleFailure | None:
        """The pad oracles on ``output`` (the kernel's, ``[num_tokens + pads, ...]``) and the caches: a
        non-finite pad row first, then a changed cache; None when both hold (or without pads)."""
        if self.caches is None:
            return None
        fail = check_pad_rows(batch, output)
        if fail is not None:
            return fail
        for before, now in zip(self.caches, (call.key_cache, call.value_cache)):
            fail = check_cache_digests(before, now) if self.digests else check_cache_unchanged(before, bits(now))
            if fail is not None:
                return fail
        return None


__all__ = ["PadSnapshot", "fill_pad_slot"]
