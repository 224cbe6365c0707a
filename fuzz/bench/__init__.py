"""kvfuzz's own benchmarks: the mutant zoo (:mod:`.mutants`), detection against vLLM's test grids
(:mod:`.detection`, :mod:`.grid`) and throughput profiles (:mod:`.throughput`)."""

__all__: list[str] = []  # exports nothing itself: its modules are imported by name
