"""A user adapter as issue 40 measured it: vllm.unified_attention subclassed, only run() overridden (loaded as
``benchmarks/adapters/unified_run_only.py:UnifiedRunOnly``). kvfuzz's device-memory budget must hold for it as
for the built-in target (benchmarks/gpu_memory_adapter.sh)."""

from kvfuzz.fuzz.targets.vllm_triton import VllmUnifiedAttention


class UnifiedRunOnly(VllmUnifiedAttention):
    name = "user.unified_run_only"

    def run(self, call):
        return super().run(call)
