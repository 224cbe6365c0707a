"""GQA groups past 16 (issue 53, item 4): the real kernels run on the CPU at the groups the small tier now draws
(32 and 64 query heads over one kv head: MQA; 24 over two), and the grouped decode kernels that split such a group
over programs of 16 heads read the wrong kv head when the group is not a multiple of 16 (docs/findings.md 14).

Each case is one small mixed batch (decode-only for the decode kernels) checked by kvfuzz's property against the
fp64 reference; zeros in the unwritten slots where a target's documented NaN-tail finding (1, 2) would hide what
the test is about.
"""

import pytest
from support import available, batch_of

from kvfuzz.contracts.checks.failures import KernelMismatch
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.strategies.configs import GQA_RATIOS

#: Every CPU attention target, with a batch of its own kind.
CPU_TARGETS = ("vllm.unified_attention", "vllm.chunked_prefill_paged_decode", "vllm.context_attention_fwd",
               "vllm.decode_attention_fwd", "vllm.cpu_attention", "torch.flex_paged", "sglang.extend_attention_fwd",
               "sglang.decode_attention_fwd")
#: Targets whose NaN-tail findings (docs/findings.md 1, 2) fire on any poisoned tail: zeros there.
NAN_TAIL = ("vllm.cpu_attention", "torch.flex_paged")


def _example(t, heads, kv, seed=1):
    c = t.capabilities
    lens = [(1, 20), (1, 5)] if c.decode_only else [(1, 20), (5, 9), (3, 0)]
    b = batch_of(lens, block_size=16, num_heads=heads, num_kv_heads=kv, head_size=64, dtype="float32", seed=seed)
    assert c.accepts(b), c.outside(b)
    return Example(b, Poison.ZEROS if t.name in NAN_TAIL else Poison.NAN)


def test_the_groups_past_16_are_drawn_and_shrink_toward_mha():
    assert GQA_RATIOS[0] == 1 and {24, 32, 64} <= set(GQA_RATIOS)


@pytest.mark.kernel
@pytest.mark.parametrize("name", CPU_TARGETS)
def test_every_cpu_target_agrees_with_the_reference_at_a_group_of_64(name):
    """One kv head under 64 query heads: the unified kernel's BLOCK_M = 64 (one query token a tile), the grouped
    decode kernels' four programs of 16 heads over one kv head, the CPU op's and flex's MQA."""
    t = available(name)
    run = check_example(t, _example(t, 64, 1))
    assert run.output.shape[1] == 64


@pytest.mark.kernel
@pytest.mark.parametrize("name", ("vllm.unified_attention", "vllm.context_attention_fwd", "vllm.cpu_attention"))
def test_a_group_of_32_over_two_kv_heads_and_a_group_of_24_pass(name):
    t = available(name)
    check_example(t, _example(t, 64, 2))
    check_example(t, _example(t, 48, 2))


@pytest.mark.kernel
@pytest.mark.parametrize("name", ("vllm.decode_attention_fwd", "sglang.decode_attention_fwd"))
def test_the_grouped_decode_kernels_read_the_wrong_kv_head_for_a_group_of_24(name):
    """docs/findings.md 14: ``_fwd_grouped_kernel_stage1`` runs ``cdiv(H, 16)`` programs of 16 heads and gives
    program ``p`` kv head ``p // cdiv(group, 16)``: with 48 heads over 2 kv heads (group 24) program 1 covers heads
    16-31, and heads 24-31 (kv head 1's) read kv head 0. 8 heads x 2 decodes = 16 wrong rows; a group that is a
    multiple of 16 (32 over 2) and one kv head (24 over 1) pass."""
    t = available(name)
    with pytest.raises(KernelMismatch, match="in 16 \\(token, head\\) rows"):
        check_example(t, _example(t, 48, 2))
    check_example(t, _example(t, 64, 2))
    check_example(t, _example(t, 24, 1))
