"""Each production state's part in the attention property (:data:`HOOKS`, by the state's name in
:data:`kvfuzz.contracts.model.states.PRODUCTION_STATES`): what the harness does around one call of a batch in the
state, whatever the target. :func:`~kvfuzz.fuzz.harness.attention.check_example` and
:func:`~kvfuzz.fuzz.harness.caller.call_violations` run the hooks of the states the batch is in
(:func:`active_hooks`) and name no state.

A state's hooks (:class:`StateHooks`; every one optional):

- ``prepare(target, batch, data, cache)``: after the cache is materialized, before the call is built (CUDA-graph
  padding: SGLang's pad slot holds finite values);
- ``call_check_args(batch)``: keyword arguments for the guard's checks of the call
  (:func:`~kvfuzz.contracts.calls.call_checks.check_call`; freed window blocks: ``null_block``);
- ``before(batch, call)``: right before the kernel runs, a snapshot of what the state's oracle compares;
- ``after(snapshot, batch, output, call)``: the state's oracle, an
  :class:`~kvfuzz.contracts.checks.oracles.OracleFailure` or None, run once the real rows passed (a state's
  failure is named only alone);
- ``call_rows(target, batch)``: the sequences the engine's call carries after the real ones, as their seq_lens
  and the whole call's query_start_loc, for the caller's metadata check
  (:func:`~kvfuzz.fuzz.harness.caller.metadata_violations`); ``appends_rows`` says a state has them (the
  sanitizer then keeps the real rows' order: :func:`~kvfuzz.fuzz.harness.sanitizer.exact_batch`);
- ``for_relations(batch)``: the batch the metamorphic relations run in its place (they compare the real rows of
  two plain calls, :mod:`kvfuzz.fuzz.harness.relations`; CUDA-graph padding: without its pads).

The oracles themselves are contracts/'s generic checks (``check_pad_rows``: "these rows are pads";
``check_cache_unchanged``: "these columns hold no data"); a state's model and declaration are in its home in
contracts/model (``PRODUCTION_STATES[name].home``), its draw in :data:`kvfuzz.strategies.states.DRAWS`.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvfuzz.contracts.caches.materialize import CacheState
from kvfuzz.contracts.checks.oracles import OracleFailure
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import BatchData
from kvfuzz.contracts.model.freed_window import NULL_BLOCK
from kvfuzz.contracts.model.padding import padding
from kvfuzz.contracts.model.states import PRODUCTION_STATES
from kvfuzz.fuzz.harness.padding import PadSnapshot, fill_pad_slot
from kvfuzz.fuzz.targets.base import KernelCall, Target


class StateHooks:
    """A state's hooks around one call (see the module docstring); each does nothing by default."""

    #: Whether the call carries rows after the real sequences' (:meth:`call_rows`).
    appends_rows = False

    def prepare(self, target: Target, batch: Batch, data: BatchData, cache: CacheState) -> None:
        return None

    def call_check_args(self, batch: Batch) -> dict[str, Any]:
        return {}

    def before(self, batch: Batch, call: KernelCall) -> Any:
        return None

    def after(self, snapshot: Any, batch: Batch, output: Any, call: KernelCall) -> OracleFailure | None:
        return None

    def call_rows(self, target: Target, batch: Batch) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        return None

    def for_relations(self, batch: Batch) -> Batch:
        return batch


class PaddingHooks(StateHooks):
    """CUDA-graph padding (kvfuzz.contracts.model.padding): SGLang's pad slot filled (:func:`fill_pad_slot`);
    the pad rows finite and the cache untouched (:class:`PadSnapshot`)."""

    def prepare(self, target: Target, batch: Batch, data: BatchData, cache: CacheState) -> None:
        fill_pad_slot(target, batch, data, cache)

    def before(self, batch: Batch, call: KernelCall) -> PadSnapshot:
        return PadSnapshot.before(batch, call)

    def after(self, snapshot: PadSnapshot, batch: Batch, output: Any, call: KernelCall) -> OracleFailure | None:
        return snapshot.after(batch, output, call)

    appends_rows = True

    def call_rows(self, target: Target, batch: Batch) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The pads' seq_lens and the padded query_start_loc, in the target's convention (a decode-only kernel
        computes row ``i`` for sequence ``i``: each pad owns a row)."""
        pad = padding(batch, target.capabilities.cuda_graph_padding)
        return (pad.pad_seq_len,) * pad.num_pads, pad.query_start_loc(target.capabilities.decode_only)

    def for_relations(self, batch: Batch) -> Batch:
        return attrs.evolve(batch, num_pad_seqs=0)


class FreedWindowHooks(StateHooks):
    """Freed window blocks (kvfuzz.contracts.model.freed_window): the guard checks no column a query can see
    points at the null block (``null_block``); the freed columns' poison is the materializer's, their oracle
    the reference's (a kernel reading them sees poison)."""

    def call_check_args(self, batch: Batch) -> dict[str, Any]:
        return {"null_block": NULL_BLOCK}


#: Each state's hooks, by name (a state with none is absent: shared prefix blocks, whose consequences are the
#: reference's). tests/test_states.py: every name is a registered state.
HOOKS: dict[str, StateHooks] = {"freed_window_blocks": FreedWindowHooks(), "cuda_graph_padding": PaddingHooks()}


def active_hooks(batch: Batch) -> list[StateHooks]:
    """The hooks of every state ``batch`` is in, in :data:`PRODUCTION_STATES` order."""
    return [HOOKS[name] for name, state in PRODUCTION_STATES.items() if name in HOOKS and state.in_batch(batch)]


def call_check_args(batch: Batch) -> dict[str, Any]:
    """The guard's extra check arguments of every state ``batch`` is in (e.g. ``{"null_block": 0}``)."""
    out: dict[str, Any] = {}
    for hooks in active_hooks(batch):
        out.update(hooks.call_check_args(batch))
    return out


__all__ = ["HOOKS", "FreedWindowHooks", "PaddingHooks", "StateHooks", "active_hooks", "call_check_args"]
