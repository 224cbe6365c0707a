"""kvfuzz.contracts.model: The model of one paged-attention call: the batch (structure), its ground-truth tensors, the
poison for unwritten slots, the example (batch + poison), CSR page lists, the cache contracts and what a target
declares. Imports nothing else in contracts."""

__all__: list[str] = []  # exports nothing itself: its modules are imported by name
