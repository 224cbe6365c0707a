"""What SGLang's Triton decode kernel and vLLM's copy share (fuzz/targets/decode_attention.py): the grouped stage-1
kernel's heads read from the wrong kv head (Finding 14), checked against its launch grid written out program by
program, and the stage-1 choice both targets name in their paths. No kernel runs."""

import pytest

from kvfuzz.contracts.model.batch import Batch
from kvfuzz.fuzz.targets.decode_attention import BLOCK_H, split_heads, stage1


def _batch(num_heads: int, num_kv_heads: int) -> Batch:
    return Batch(query_lens=[1], ctx_lens=[3], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32,
                 block_size=16, num_blocks=1, block_table=[[0]], dtype="float32")


def _misread_by_the_grid(num_heads: int, num_kv_heads: int) -> set[int]:
    """The heads ``_fwd_grouped_kernel_stage1`` reads from another kv head than ``h // group``, launch by launch
    (vllm/v1/attention/ops/triton_decode_attention.py ``_decode_grouped_att_m_fwd``: grid
    ``cdiv(H, min(BLOCK_H, group))``; program ``p`` covers ``VALID_BLOCK_H`` heads from ``p * VALID_BLOCK_H`` and
    reads kv head ``p // cdiv(group, BLOCK_H)``)."""
    group = num_heads // num_kv_heads
    valid = BLOCK_H if group > BLOCK_H else group
    wrong = set()
    for p in range(-(-num_heads // min(BLOCK_H, group))):
        kv_head = p // -(-group // BLOCK_H)
        wrong |= {h for h in range(p * valid, min((p + 1) * valid, num_heads)) if h // group != kv_head}
    return wrong


@pytest.mark.parametrize("num_heads, num_kv_heads", [
    (8, 8), (8, 2), (32, 2), (48, 1), (48, 2), (40, 2), (34, 2), (56, 2), (64, 2), (96, 3), (232, 8), (128, 4)])
def test_split_heads_are_the_heads_the_grouped_kernels_grid_reads_from_another_kv_head(num_heads, num_kv_heads):
    assert split_heads(_batch(num_heads, num_kv_heads)) == _misread_by_the_grid(num_heads, num_kv_heads)


def test_finding_14s_minimal_case_and_the_groups_it_spares():
    """docs/findings.md, Finding 14: 48 heads over 2 (a group of 24) reads heads 24-31 from kv head 0; groups up to
    16, multiples of 16 and a single kv head are read right."""
    assert split_heads(_batch(48, 2)) == set(range(24, 32))
    assert not split_heads(_batch(32, 2)) and not split_heads(_batch(64, 2)) and not split_heads(_batch(48, 1))


def test_stage1_is_the_mha_kernel_only_when_every_query_head_has_its_own_kv_head():
    assert stage1(_batch(8, 8)) == "normal"
    assert stage1(_batch(8, 2)) == "grouped" and stage1(_batch(8, 1)) == "grouped"
