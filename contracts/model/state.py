"""What a production state is (:class:`ProductionState`) and a ready-made one (:class:`State`); the registry of
every state is :data:`kvfuzz.contracts.model.states.PRODUCTION_STATES`. Apart from it so that each state's home
(which defines its ``STATE``) and the registry (which imports every home) import no cycle."""

from __future__ import annotations

from typing import Any, Callable

import attrs


@attrs.frozen
class ProductionState:
    """One production state's declaration. name: the ``Capabilities`` field declaring it (a bool, or a value
    such as a padding convention), stable: reports, baselines and ``gate_states_off`` carry it. label: its name
    in ``kvfuzz targets``' "states". off: the field's value when not declared. outside: the phrase
    ``Capabilities.outside`` gives a batch in the state that the declaration lacks. tag: coverage's tag of a
    batch in the state. home: the module holding its model. A state says which batches are in it
    (:meth:`in_batch`) and may check its declaration (:meth:`validate`); :class:`State` builds one from two
    functions."""

    name: str
    label: str
    off: Any
    outside: str
    tag: str
    home: str

    def in_batch(self, batch: Any) -> bool:
        """Whether ``batch`` (a :class:`~kvfuzz.contracts.model.batch.Batch`) is in this state."""
        raise NotImplementedError(f"{type(self).__name__} does not say which batches are in the state")

    def validate(self, capabilities: Any) -> None:
        """Raise ValueError naming the field and fix when ``capabilities`` declares the state wrongly."""

    def declared(self, capabilities: Any) -> Any:
        """The declared value (``off`` when not declared)."""
        return getattr(capabilities, self.name)


@attrs.frozen
class State(ProductionState):
    """A :class:`ProductionState` from its parts (see there) and two functions: ``predicate(batch) -> bool``
    (:meth:`in_batch`); ``check(caps)`` raises ValueError (None: any declared value is valid)."""

    predicate: Callable[[Any], bool]
    check: Callable[[Any], None] | None = None

    def in_batch(self, batch: Any) -> bool:
        return bool(self.predicate(batch))

    def validate(self, capabilities: Any) -> None:
        if self.check is not None:
            self.check(capabilities)


__all__ = ["ProductionState", "State"]
