"""One example from cache to verdict: :mod:`.properties` dispatches to the attention property
(:mod:`.attention`) or the writer property (:mod:`.writer`) by the target's contract; :mod:`.run` holds what an
example produces; :mod:`.faults` breaks contracts on purpose; :mod:`.relations` defines the metamorphic
relations; :mod:`.coverage` labels what an example exercised."""

__all__: list[str] = []  # exports nothing itself: its modules are imported by name
