"""kvfuzz.contracts.calls: Checks of a real call's arguments, without ground truth (the runtime guard's): the normalized
call (PagedCall), what each kernel declares it needs, the call checks, the CSR checks, the kv_cache_dtype policy and
vLLM's ROCm routing model. Nothing else in contracts imports it."""

__all__: list[str] = []  # exports nothing itself: its modules are imported by name
