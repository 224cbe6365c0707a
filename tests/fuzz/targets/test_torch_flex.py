"""torch.flex_paged: torch's PagedAttention + flex_attention with kvfuzz's block table as its page table."""

from __future__ import annotations

import pytest
import torch

from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.failures import KernelMismatch, NonFiniteOutput
from kvfuzz.contracts.model.batch import Batch, positions
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.targets.torch_flex import FlexPagedLayout, TorchFlexPaged, paged_attention_for
from kvfuzz.strategies import Limits

pytestmark = pytest.mark.kernel

TARGET = TorchFlexPaged()
AVAIL = TARGET.availability()


@pytest.fixture(autouse=True)
def _needs_flex():
    if not AVAIL.ok:
        pytest.skip(f"torch.flex_paged unavailable: {AVAIL.reason}")


def mixed_batch(dtype="float32", seed=0, block_size=16, head_size=32, num_heads=4, num_kv_heads=2) -> Batch:
    """Prefill with context, decode, prefill without context; blocks in reverse order, spare blocks 0 and 7."""
    return Batch(query_lens=[5, 1, 17], ctx_lens=[3, 20, 0], num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_size=head_size, block_size=block_size, num_blocks=8, block_table=[[6, 0], [5, 4], [3, 2]],
                 dtype=dtype, seed=seed)


# ---- the page table and the layout ---------------------------------------------------------------------
def test_page_table_is_the_block_table_in_the_state_reserve_leaves():
    """For the table reserve() itself would build, paged_attention_for reproduces reserve()'s state exactly."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    seq_lens = [8, 21, 17]
    ref = PagedAttention(8, 16, 3, device="cpu")
    for i, s in enumerate(seq_lens):
        ref.reserve(torch.tensor(i), torch.tensor(s))
    table = [[int(p) for p in ref.page_table[i] if p >= 0] for i in range(3)]
    width = max(map(len, table))
    b = Batch(query_lens=[1, 1, 1], ctx_lens=[s - 1 for s in seq_lens], num_heads=1, num_kv_heads=1, head_size=16,
              block_size=16, num_blocks=8, block_table=[r + [0] * (width - len(r)) for r in table])
    pa = paged_attention_for(b, "cpu")
    for name in ("page_table", "physical_to_logical", "capacity"):
        assert torch.equal(getattr(pa, name), getattr(ref, name)), name
    assert pa.empty_pages == ref.empty_pages


def test_page_table_of_an_arbitrary_block_table():
    b = mixed_batch()
    pa = paged_attention_for(b, "cpu")
    for i, row in enumerate(b.block_table):
        need = b.blocks_needed(i)
        assert pa.page_table[i, :need].tolist() == list(row[:need])
        assert (pa.page_table[i, need:] == -1).all()  # padding columns are not pages
        assert [int(pa.physical_to_logical[i, p]) for p in row[:need]] == list(range(need))
        assert int((pa.physical_to_logical[i] >= 0).sum()) == need
    assert pa.empty_pages == [7, 1, 0]


def test_layout_writes_where_paged_attention_assign_writes():
    """kvfuzz's materializer (FlexPagedLayout.write at kvfuzz's slots) and PagedAttention.assign (through its
    page table) produce the same cache, bit for bit."""
    b = mixed_batch(dtype="bfloat16", seed=4)
    data = make_batch_data(b)
    ours = materialize(b, data, FlexPagedLayout(), b.seq_lens, Poison.ZEROS)
    pa = paged_attention_for(b, "cpu")
    kc, vc = FlexPagedLayout().allocate(b)
    kc.zero_(), vc.zero_()
    for i in range(b.num_seqs):
        seq, pos = positions([b.seq_lens[i]])
        rows = data.token_rows(b, seq + i, pos)
        k = data.keys[rows].permute(1, 0, 2)[None]  # [1, Hkv, S, D]
        v = data.values[rows].permute(1, 0, 2)[None]
        pa.assign(torch.tensor([i]), pos[None], k, v, kc, vc)
    assert torch.equal(ours.key_cache.view(torch.int16), kc.view(torch.int16))
    assert torch.equal(ours.value_cache.view(torch.int16), vc.view(torch.int16))
    got_k, got_v = FlexPagedLayout().gather(kc, vc, b.slot_mapping())
    exp_k, exp_v = data.new_kv(b)
    assert torch.equal(got_k, exp_k) and torch.equal(got_v, exp_v)


def test_a_big_cache_is_poisoned_and_stored_through_the_layouts_slots(monkeypatch):
    """A big cache (over FULL_POISON_MAX_BYTES: only the referenced blocks are poisoned) in torch's layout, whose
    dim 0 is 1, not the block: kvfuzz's index_copy_ of block ids along dim 0 was a device-side assert on an H200
    (a --baseline sweep, one decode on page 65,536 of 65,537; on the CPU an index error). Now the referenced
    blocks' slots are poisoned through FlexPagedLayout.write, the sequences' tokens written over them, and a
    reproducer stores those blocks as [blocks, block_size, Hkv, D]."""
    import importlib

    m = importlib.import_module("kvfuzz.contracts.caches.materialize")
    monkeypatch.setattr(m, "FULL_POISON_MAX_BYTES", 1024)
    b = Batch(query_lens=[1, 3], ctx_lens=[5, 9], num_heads=4, num_kv_heads=2, head_size=16, block_size=16,
              num_blocks=9, block_table=[[8], [2]], dtype="float16")
    layout = FlexPagedLayout()
    kc, vc = layout.allocate(b)
    assert not m.block_major(b, kc, vc) and m.is_big(kc, vc)
    with pytest.raises((IndexError, RuntimeError)):  # the block-major path on this layout: what the H200 met
        m._poison_blocks(kc, Poison.NAN, 1, m.referenced_blocks(b))
    data = make_batch_data(b)
    state = m.materialize(b, data, layout, b.seq_lens, Poison.NAN)
    k, v = layout.gather(state.key_cache, state.value_cache, b.slots(*positions(b.seq_lens)))
    assert torch.equal(k, data.keys) and torch.equal(v, data.values)
    tail = torch.tensor([8 * 16 + 6, 2 * 16 + 12, 2 * 16 + 15])  # past seq_len in each referenced block
    tk, tv = layout.gather(state.key_cache, state.value_cache, tail)
    assert torch.isnan(tk).all() and torch.isnan(tv).all()
    kb, vb = m.referenced_rows(b, layout, state.key_cache, state.value_cache)
    assert kb.shape == vb.shape == (2, 16, 2, 16)  # blocks 2 and 8, in that order
    assert torch.equal(kb[1, :6], data.keys[:6]) and torch.isnan(kb[1, 6:]).all()


# ---- end to end ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_flex_paged_agrees_with_the_reference(make_batch, dtype):
    run = properties.check(TARGET, Example(mixed_batch(dtype=dtype, seed=1), Poison.STALE))
    assert run.path == "eager (cpu)" and run.output.shape == (23, 4, 32)
    # GQA 7 over one kv head, a head size that is not a power of two, the smallest page vLLM runs, pages reversed
    b = make_batch([(9, 7), (1, 16), (1, 0)], num_heads=7, num_kv_heads=1, head_size=48, block_size=16, spare=2,
                   dtype=dtype, seed=5, reverse=True)
    run = properties.check(TARGET, Example(b, Poison.ZEROS))
    assert run.output.shape == (11, 7, 48)


def test_nan_in_a_free_page_poisons_the_output():
    """FINDING (torch 2.13 eager flex_attention, the math path): P @ V runs over every page of the pool, so NaN
    in the V rows of any slot that no query may see - the tail of the sequence's own last page, other
    sequences' pages, free pages - multiplies probability 0 and turns the whole output NaN (docs/contracts.md §5,
    bug 3). Minimal case found by the campaign: one decode token, page size 8, one page. The compiled kernel
    (torch 2.11, H200) skips pages outside the block mask but has the same defect in the tail of a sequence's
    last page."""
    b = Batch(query_lens=[1], ctx_lens=[0], num_heads=1, num_kv_heads=1, head_size=16, block_size=8,
              num_blocks=1, block_table=[[0]], dtype="float32")
    with pytest.raises(NonFiniteOutput) as info:
        properties.check(TARGET, Example(b, Poison.NAN))
    assert info.value.details["oracle"]["bad_elements"] == 16
    properties.check(TARGET, Example(b, Poison.STALE))  # finite garbage there is masked correctly


# ---- the kernel options are vLLM's -----------------------------------------------------------------------
#: kvfuzz's former fixed options (BLOCK_M=32, BLOCK_N up to 32): an H200 compile crashed with them at GQA 64
FORMER_FIXED = staticmethod(lambda batch: {"BLOCK_M": 32, "BLOCK_N": min(batch.block_size, 32), "num_warps": 4,
                                           "num_stages": 1})
#: head size, GQA group, page size, dtype: the options must be vLLM's at each
OPTION_GRID = [(h, g, p, dt) for h in (16, 80, 256) for g in (1, 8, 64) for p in (16, 32, 64, 128)
               for dt in ("float32", "float16", "bfloat16")]


def option_mismatches(target: TorchFlexPaged, grid=OPTION_GRID) -> list[str]:
    """Each case of ``grid`` (a prefill with context and a decode) where the call ``target`` builds
    differs from vLLM's: its block mask's ``BLOCK_SIZE`` from vLLM's ``_get_block_sizes`` (default config, paged
    cache, torch >= 2.9 as vLLM's ``is_torch_equal_or_newer`` says), or its ``kernel_options`` from vLLM's
    ``get_kernel_options`` for the call's own query and block mask, both compiled from vLLM's installed file."""
    from vllm.utils.torch_version import is_torch_equal_or_newer

    from kvfuzz.fuzz.targets.flex_options import (
        DEFAULT_ATTENTION_CONFIG,
        GET_BLOCK_SIZES,
        GET_KERNEL_OPTIONS,
        compile_from_source,
        vllm_flex_source,
    )

    if vllm_flex_source() is None:
        pytest.skip("vLLM's flex_attention.py is not installed")
    get_block_sizes = compile_from_source(vllm_flex_source(), GET_BLOCK_SIZES)
    get_kernel_options = compile_from_source(vllm_flex_source(), GET_KERNEL_OPTIONS)
    small = is_torch_equal_or_newer("2.9.0.dev0")
    wrong = []
    for head_size, group, page, dtype in grid:
        b = Batch(query_lens=[3, 1], ctx_lens=[5, 20], num_heads=group * 2, num_kv_heads=2, head_size=head_size,
                  block_size=page, num_blocks=4, block_table=[[2, 0], [3, 1]], dtype=dtype)
        data = make_batch_data(b)
        call = target.build_call(b, data, materialize(b, data, target.layout(b), b.seq_lens, Poison.ZEROS))
        q_block, kv_block = get_block_sizes(DEFAULT_ATTENTION_CONFIG, small, page, True)
        want = get_kernel_options(call.kwargs["query"], q_block, kv_block, small and kv_block == page)
        got = (call.kwargs["block_mask"].BLOCK_SIZE, call.kwargs["kernel_options"])
        if got != ((q_block, kv_block), want):
            wrong.append(f"D={head_size} group={group} page={page} {dtype}: mask {got[0]}, options {got[1]}; vLLM's: "
                         f"mask {(q_block, kv_block)}, options {want}")
    return wrong


def test_the_call_passes_vllms_block_mask_and_kernel_options():
    assert option_mismatches(TARGET) == []
    assert "; vLLM's kernel options from vllm" in AVAIL.reason  # kvfuzz targets --check says whose code chose them


def test_other_options_or_another_mask_than_vllms_are_caught(monkeypatch):
    """Planted, on every 6th case of the grid: the former fixed options; vLLM's options computed for the 128-row
    mask kvfuzz used to build."""
    from kvfuzz.fuzz.targets import flex_options

    grid = OPTION_GRID[::6]
    monkeypatch.setattr(TorchFlexPaged, "kernel_options", FORMER_FIXED)
    wrong = option_mismatches(TARGET, grid)
    assert len(wrong) == len(grid) and "'BLOCK_M': 32" in wrong[0] and "'BLOCK_M': 16" in wrong[0], wrong[0]
    monkeypatch.undo()
    monkeypatch.setattr(flex_options, "block_mask_sizes", lambda page: (128, page, True))
    wrong = option_mismatches(TARGET, grid)
    assert len(wrong) == len(grid) and "mask (128, " in wrong[0], wrong[0]


def test_a_page_vllm_refuses_is_one_kvfuzz_cannot_lay_out():
    """vLLM's _get_block_sizes raises for a page that is not a power of two (48, which --undeclared draws): no call of
    vLLM's to make, so the example is discarded (a LayoutError, which check_undeclared turns into hypothesis's
    reject()), not reported as a crash of kvfuzz's harness."""
    from kvfuzz.contracts.caches.layouts import LayoutError

    b = Batch(query_lens=[2], ctx_lens=[3], num_heads=2, num_kv_heads=1, head_size=16, block_size=48, num_blocks=2,
              block_table=[[1]], dtype="float32")
    with pytest.raises(LayoutError, match="runs no page of 48 .*power of 2"):
        properties.prepare(TARGET, Example(b, Poison.ZEROS))


def test_before_torch_2_9_the_target_is_unavailable(monkeypatch):
    """vLLM masks in 128 x 128 blocks there (no direct build), which a paged mask cannot be."""
    from kvfuzz.fuzz.targets import flex_options

    monkeypatch.setattr(flex_options, "supports_small_blocks", lambda version=None: False)
    for answer in (TorchFlexPaged().availability(), TorchFlexPaged().installed()):
        assert not answer.ok and "torch >= 2.9" in answer.reason and "_get_block_sizes" in answer.reason


def test_the_path_names_the_tiles_on_cuda(monkeypatch):
    from kvfuzz.fuzz.targets import torch_flex

    assert TARGET.path(mixed_batch()) == "eager (cpu)"
    monkeypatch.setattr(torch_flex, "on_cuda", lambda: True)
    assert TARGET.path(mixed_batch(block_size=64)) == "compiled (cuda), BLOCK_M=16 BLOCK_N=64"
    assert TARGET.path(mixed_batch(block_size=48)) == "compiled (cuda), no page vLLM runs"


# ---- broken variants are caught ---------------------------------------------------------------------
class MaskOffByOne(TorchFlexPaged):
    """Query j sees positions 0 .. ctx_len + j - 1: its own token is left out."""

    name = "test.flex_mask_off_by_one"

    @staticmethod
    def logical_mask_mod(query_lens, ctx_lens, sliding_window=None):
        def mask(b, h, q_idx, kv_idx):
            return (q_idx < query_lens[b]) & ((kv_idx < ctx_lens[b] + q_idx) | (kv_idx == 0))

        return mask


class OwnPageTable(TorchFlexPaged):
    """The kernel reads through the pages reserve() hands out, not the ones kvfuzz wrote the cache at."""

    name = "test.flex_own_page_table"

    def paged_attention(self, batch, device):
        from torch.nn.attention.experimental._paged_attention import PagedAttention

        pa = PagedAttention(batch.num_blocks, batch.block_size, batch.num_seqs, device=str(device))
        for i, s in enumerate(batch.seq_lens):
            pa.reserve(torch.tensor(i), torch.tensor(s))
        return pa


@pytest.mark.parametrize("cls", [MaskOffByOne, OwnPageTable])
def test_broken_variant_is_a_kernel_mismatch(cls):
    with pytest.raises(KernelMismatch) as info:
        properties.check(cls(), Example(mixed_batch(seed=2), Poison.STALE))
    assert info.value.check == "agreement with the fp64 reference"


def test_short_campaign(tmp_path):
    cfg = CampaignConfig(out=tmp_path, max_examples=6, seed=1, poisons=(Poison.STALE, Poison.ZEROS),
                         limits=Limits(max_num_seqs=3, max_ctx_len=40, max_query_len=12))
    stats = fuzz_target(TARGET, cfg)
    assert stats.failures == {}, [f.message for f in stats.failures.values()]
    assert stats.examples == 6 and stats.paths["eager (cpu)"] == 6
