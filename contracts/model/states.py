"""Production states: what a serving engine leaves around a kernel call that a fresh batch does not have (shared
prefix blocks, blocks freed behind a sliding window, CUDA-graph pad sequences), one home per state, all of them
in one registry, :data:`PRODUCTION_STATES` (as :data:`kvfuzz.fuzz.targets.registry.FAMILIES` is for targets).

A state is a :class:`ProductionState`: its name, which is the ``Capabilities`` field a target declares it with
(and the name ``kvfuzz targets``, docs/targets.md and ``Target.gate_states_off`` use); the value that declares
it off; a label; whether a batch is in the state; what a declaration needs besides it. The generic code asking
whether a state is declared or a batch is in it reads it from here (``Capabilities``' validation, ``accepts``,
``outside``, ``states``, ``without_states``; ``Target.gate_capabilities``; coverage's state tags). Each state's
home (``home``) holds its model; the rooms above hold the rest, each in one place per state, found from the
state's name:

- its draw: :data:`kvfuzz.strategies.states.DRAWS` (strategies: a draw may not live with a kernel or the harness);
- its hooks around the call: :data:`kvfuzz.fuzz.harness.states.HOOKS` (the harness: before the call, a
  snapshot, after it, its oracle; the rows a call carries past the real sequences, which the caller's metadata
  check and the sanitizer read; the batch the metamorphic relations run in its place);
- the generic consequences stay in contracts/ (``check_cache_unchanged``: "these columns hold no data";
  ``check_pad_rows``: "these rows are pads").

The layering (fuzz -> strategies -> contracts, tests/test_layers.py) is why one state is a module per room and
not one module: a draw imports Hypothesis (strategies), an oracle's hooks the harness (fuzz).

Still naming a state by its field, where no hook can stand in: the targets that build a padded call
(``Padding``: the call is the target's own, as each engine lays its pads out); the reproducer's standalone.py
(kvfuzz.fuzz.campaign.store.standalone: it runs without kvfuzz, so it rebuilds the padded call from case.json's
``num_pad_seqs`` in code of its own); the baseline's ``"padding"`` feature (kvfuzz.fuzz.campaign.store.baseline
``FEATURES_OFF``: a word of the baseline file's format, mapped to the Batch field its re-run clears); and
``kvfuzz targets``' JSON field ``shared_prefix_blocks``.
"""

from __future__ import annotations

from typing import Any

from . import freed_window, padding
from .state import ProductionState, State

#: Shared prefix blocks: its model is the block table itself (``Batch.shared_prefix_blocks``,
#: ``Batch.shared_prefix_rows``, kvfuzz.contracts.model.batch), whose validation allows a block shared by
#: several sequences only as their common prefix.
SHARED_PREFIX = State("shared_prefix_blocks", "shared prefix", False, "shared prefix blocks", "shared-prefix",
                      "kvfuzz.contracts.model.batch", lambda b: any(b.shared_prefix_blocks))

#: Every production state, by name, in the order ``kvfuzz targets`` and coverage list them. A new state: its home
#: module defines its ``STATE`` (its model, declaration and validation), added here; its draw in
#: kvfuzz.strategies.states ``DRAWS``; its oracle's hooks, if it has any, in kvfuzz.fuzz.harness.states ``HOOKS``.
PRODUCTION_STATES: dict[str, ProductionState] = {s.name: s for s in (SHARED_PREFIX, freed_window.STATE,
                                                                     padding.STATE)}


def declared_states(capabilities: Any) -> dict[str, Any]:
    """The states ``capabilities`` declares, name -> declared value (``True``, or a convention)."""
    return {n: getattr(capabilities, n) for n, s in PRODUCTION_STATES.items() if getattr(capabilities, n) != s.off}


def states_off(capabilities: Any, names) -> dict[str, Any]:
    """``attrs.evolve`` keyword arguments that declare the states ``names`` off. Raises ValueError naming an
    unknown state and the known ones."""
    bad = [n for n in names if n not in PRODUCTION_STATES]
    if bad:
        raise ValueError(f"unknown production states {bad}; known: {list(PRODUCTION_STATES)}")
    return {n: PRODUCTION_STATES[n].off for n in names}


__all__ = ["PRODUCTION_STATES", "SHARED_PREFIX", "ProductionState", "State", "declared_states", "states_off"]
