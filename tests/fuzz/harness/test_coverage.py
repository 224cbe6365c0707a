"""Coverage labels (kvfuzz.fuzz.harness.coverage): the production states an example models are counted."""

from kvfuzz.fuzz.bench.paged_torch import small_batch
from kvfuzz.fuzz.harness.coverage import batch_states, labels
from kvfuzz.fuzz.targets import get_target


def test_a_shared_prefix_is_a_state_and_a_private_table_is_none():
    private = small_batch([1, 1], [16, 16], block_size=8)  # blocks 0-2 and 3-5
    shared = small_batch([1, 1], [16, 16], block_size=8, table=[[0, 1, 2], [0, 1, 3]], num_blocks=4)
    assert batch_states(private) == "none" and batch_states(shared) == "shared-prefix"
    assert labels(get_target("mutant.base"), shared)["states"] == "shared-prefix"


def test_the_vllm_targets_declare_shared_prefix_blocks():
    """vLLM's prefix caching hands requests the same full blocks (vllm/v1/core/kv_cache_manager.py
    get_computed_blocks); its kernels are fuzzed with such tables."""
    for name in ("vllm.unified_attention", "vllm.chunked_prefill_paged_decode", "vllm.context_attention_fwd",
                 "vllm.decode_attention_fwd", "vllm.cpu_attention", "vllm.triton_mla_decode"):
        assert get_target(name).capabilities.shared_prefix_blocks, name
