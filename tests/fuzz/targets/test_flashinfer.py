"""FlashInfer support without a GPU (issue 20): page-list metadata from batches, FlashInfer's cache layouts,
the plan/run/append caller checks (each fed a violating call and a correct one), the guard's wrapping of the
wrapper classes (with a stand-in flashinfer module whose run() computes nothing), and the targets' availability
on CPU. The kernels themselves run only on CUDA (benchmarks/gpu_flashinfer.sh)."""

import sys
import warnings

import attrs
import pytest
import torch
from support.flashinfer_standin import standin_flashinfer

from kvfuzz.contracts.caches.flashinfer_layouts import FlashInferLayout, unpack_paged_kv_cache
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.calls.page_contents import check_append, check_current_tokens, token_slots
from kvfuzz.contracts.calls.page_lists import check_plan, check_run, make_plan
from kvfuzz.contracts.checks.violations import FIX, Check
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.guard import flashinfer as fguard
from kvfuzz.fuzz.guard.interception import CallerContractError, guard
from kvfuzz.fuzz.harness.writer import GuardedLayout
from kvfuzz.fuzz.targets.flashinfer import (
    CUDA_ONLY,
    FlashInferAppendPagedKvCache,
    FlashInferBatchDecode,
    FlashInferBatchPrefill,
    layout_for,
    page_list_tensors,
    window_left,
)
from kvfuzz.fuzz.targets.registry import BUILTIN, get_target

LAYOUTS = [FlashInferLayout(kl, c) for kl in ("NHD", "HND") for c in (True, False)]
I32 = torch.int32


def decode_batch(seq_lens=(16, 1, 9), page_size=8, num_heads=28, num_kv_heads=4, seed=0, **kw) -> Batch:
    """Decode sequences with pages handed out in reverse (so page ids are not positions)."""
    pages = [-(-s // page_size) for s in seq_lens]
    total = sum(pages) + 2
    ids = list(range(total))[::-1]
    width = max(pages)
    table, k = [], 0
    for p in pages:
        row = ids[k:k + p]
        k += p
        table.append(row + [0] * (width - p))
    return Batch(query_lens=[1] * len(seq_lens), ctx_lens=[s - 1 for s in seq_lens], num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_size=64, block_size=page_size, num_blocks=total, block_table=table,
                 seed=seed, **kw)


def prefill_batch(seed=0, **kw) -> Batch:
    return Batch(query_lens=[3, 1, 5], ctx_lens=[5, 7, 0], num_heads=4, num_kv_heads=2, head_size=64, block_size=4,
                 num_blocks=8, block_table=[[0, 1, 0], [2, 3, 0], [4, 5, 0]], seed=seed, **kw)


def cpu_call(target, batch):
    """The target's call for ``batch`` on the CPU: the metadata and cache FlashInfer would get (not run)."""
    data = make_batch_data(batch)
    cache = materialize(batch, data, target.layout(batch), Contract.UNIFIED.cached_lens(batch), Poison.NAN)
    return data, cache, target.build_call(batch, data, cache)


# ---- metadata ------------------------------------------------------------------------------------------
def test_page_lists_edges_boundary_one_token_and_gqa_7():
    b = decode_batch(seq_lens=(16, 1, 9), page_size=8)  # 16 ends on a page boundary; 1 token; GQA 28/4 = 7
    assert b.gqa_ratio == 7
    indptr, indices, last = page_list_tensors(b, b.seq_lens, "cpu")
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == [0, 2, 3, 5]
    assert last.tolist() == [8, 1, 1]  # full last page is page_size, never 0
    assert indices.tolist() == [b.block_table[0][0], b.block_table[0][1], b.block_table[1][0], b.block_table[2][0],
                                b.block_table[2][1]]
    plan = make_plan("decode", indptr, indices, last, 28, 4, 64, 8)
    assert plan.kv_lens().tolist() == list(b.seq_lens)  # flashinfer get_seq_lens gives the lengths back
    assert check_plan(plan) == []


def test_page_list_tail_is_page_ids_out_of_reach():
    b = decode_batch(seq_lens=(5,), page_size=4, csr_tail=(-1, 4 * 3))
    _, indices, _ = page_list_tensors(b, b.seq_lens, "cpu")
    assert indices[-2:].tolist() == [-1, 3]  # slots -1 and the pool size as page ids: still out of range
    assert indices.numel() == 2 + 2


def test_window_left_is_w_minus_1():
    assert window_left(decode_batch(sliding_window=5)) == 4
    assert window_left(decode_batch()) == -1


def test_token_slots_put_the_current_token_at_last_page_len_minus_1():
    b = decode_batch(seq_lens=(16, 1, 9), page_size=8)
    plan = make_plan("decode", *page_list_tensors(b, b.seq_lens, "cpu"), 28, 4, 64, 8)
    seq, page, off = token_slots(plan)
    assert seq.tolist() == [0, 1, 2]
    assert off.tolist() == [7, 0, 0] == [x - 1 for x in plan.last_page_len.tolist()]
    assert page.tolist() == [b.block_table[0][1], b.block_table[1][0], b.block_table[2][1]]


# ---- layouts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.name)
@pytest.mark.parametrize("guarded", [False, True])
def test_layout_round_trip_and_the_argument_flashinfer_gets(layout, guarded):
    b = decode_batch(seq_lens=(11, 3), page_size=4, num_heads=4, num_kv_heads=2)
    lay = GuardedLayout(layout) if guarded else layout
    kc, vc = lay.allocate(b)
    kc.zero_(), vc.zero_()  # torch.empty may hold NaN, which torch.equal never matches
    page = layout.page_shape(4, 2, 64)
    assert kc.shape == vc.shape == (b.num_blocks, *page)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(b.num_blocks * 4, generator=g)[:13]
    k, v = torch.randn(13, 2, 64, generator=g).half(), torch.randn(13, 2, 64, generator=g).half()
    lay.write(kc, vc, slots, k, v)
    gk, gv = lay.gather(kc, vc, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    arg = layout.paged_kv_cache(kc, vc)
    if layout.combined:
        assert isinstance(arg, torch.Tensor) and arg.shape == (b.num_blocks, 2, *page)
    else:
        assert isinstance(arg, tuple)
    uk, uv = unpack_paged_kv_cache(arg, layout.kv_layout)
    assert torch.equal(uk, kc) and torch.equal(uv, vc)
    assert uk.data_ptr() == kc.data_ptr() and uv.data_ptr() == vc.data_ptr()
    assert layout.dims(uk) == (b.num_blocks, 4, 2, 64)
    # where FlashInfer reads token p of a page: NHD [page, off, h], HND [page, h, off]
    blk, off = int(slots[0]) // 4, int(slots[0]) % 4
    got = uk[blk, off] if layout.kv_layout == "NHD" else uk[blk, :, off]
    assert torch.equal(got, k[0])


def test_layout_rejects_views_that_are_not_one_5d_tensor():
    lay = FlashInferLayout("NHD", True)
    with pytest.raises(ValueError):
        lay.paged_kv_cache(torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8))
    with pytest.raises(ValueError):
        FlashInferLayout("NDH")


# ---- targets' calls on CPU (metadata, not kernels) ---------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_decode_call_is_clean_under_every_check(seed):
    t = FlashInferBatchDecode()
    b = decode_batch(seed=seed, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0)
    data, cache, call = cpu_call(t, b)
    kw = call.kwargs
    assert isinstance(call.layout, FlashInferLayout) and call.layout == layout_for(b)
    assert kw["kv_data_type"] == torch.float8_e4m3fn and kw["k_scale"] == 0.5 and kw["v_scale"] == 2.0
    plan = make_plan("decode", kw["indptr"], kw["indices"], kw["last_page_len"], kw["num_qo_heads"],
                     kw["num_kv_heads"], kw["head_dim"], kw["page_size"], q_data_type=kw["q_data_type"],
                     kv_data_type=kw["kv_data_type"], kv_layout=call.layout.kv_layout)
    assert check_plan(plan) == []
    assert check_run(plan, kw["q"], kw["paged_kv_cache"]) == []
    k, v = data.new_kv(b)
    # the logical tokens handed over, quantized with run()'s scales: the codes the cache holds
    assert check_current_tokens(plan, kw["paged_kv_cache"], k, v, kw["k_scale"], kw["v_scale"]) == []
    assert len(check_current_tokens(plan, kw["paged_kv_cache"], k * 2, v, kw["k_scale"], kw["v_scale"])) == 3


def test_decode_target_refuses_prefill_and_prefill_call_is_clean():
    with pytest.raises(ValueError, match="decode sequences only"):
        cpu_call(FlashInferBatchDecode(), prefill_batch())
    b = prefill_batch(seed=3)
    data, cache, call = cpu_call(FlashInferBatchPrefill(), b)
    kw = call.kwargs
    assert kw["causal"] is True and kw["qo_indptr"].tolist() == [0, 3, 4, 9]
    plan = make_plan("prefill", kw["paged_kv_indptr"], kw["paged_kv_indices"], kw["paged_kv_last_page_len"], 4, 2, 64,
                     4, qo_indptr=kw["qo_indptr"], q_data_type=kw["q_data_type"], kv_layout=call.layout.kv_layout)
    assert check_plan(plan) == [] and check_run(plan, kw["q"], kw["paged_kv_cache"]) == []
    assert check_current_tokens(plan, kw["paged_kv_cache"], *data.new_kv(b)) == []


def test_append_call_leaves_out_padding_and_is_clean():
    b = prefill_batch(seed=2)
    t = FlashInferAppendPagedKvCache()
    data = make_batch_data(b)
    cache = materialize(b, data, GuardedLayout(t.layout(b)), b.ctx_lens, Poison.NAN)
    cache = attrs.evolve(cache, layout=t.layout(b))
    call = t.build_call(b, data, cache)
    kw = call.kwargs
    assert kw["_inputs"].num_padding == 0 and kw["append_key"].shape[0] == b.num_tokens
    assert kw["positions"].tolist() == [5, 6, 7, 7, 0, 1, 2, 3, 4]
    assert kw["batch_indices"].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    args = {k: v for k, v in kw.items() if not k.startswith("_")}
    assert check_append(**args) == []


def test_targets_say_why_not_on_cpu():
    for name in ("flashinfer.batch_decode", "flashinfer.batch_decode_tc", "flashinfer.batch_prefill",
                 "flashinfer.append_paged_kv_cache"):
        assert name in BUILTIN
        t = get_target(name)
        for a in (t.availability(), t.installed()):
            assert not a.ok and "CUDA only" in a.reason and a.reason == CUDA_ONLY
    assert FlashInferBatchDecode.capabilities.decode_only
    assert FlashInferAppendPagedKvCache.capabilities.contract is Contract.WRITER


def test_the_decode_paths_declare_the_group_sizes_their_kernels_dispatch():
    """The CUDA-core decode: 0.7.2.post1's DISPATCH_GQA_GROUP_SIZE (1, 2, 3, 4, 6, 8, 16; 7 raised on the H100);
    the tensor-core decode (use_tensor_cores=True, the prefill kernels): every group size up to 16 (the groups past
    16 kvfuzz draws, 24, 32 and 64, are not declared: not yet run on a GPU)."""
    from kvfuzz.fuzz.targets.flashinfer import FlashInferBatchDecodeTC
    from kvfuzz.strategies.configs import GQA_RATIOS

    cuda_core, tc = FlashInferBatchDecode.capabilities, FlashInferBatchDecodeTC.capabilities
    assert cuda_core.gqa_ratios == (1, 2, 3, 4, 6, 8, 16)
    assert set(GQA_RATIOS) - set(cuda_core.gqa_ratios) == {7, 24, 32, 64}
    assert {r for r in GQA_RATIOS if r <= 16} <= set(tc.gqa_ratios) == set(range(1, 17))
    assert attrs.evolve(tc, gqa_ratios=cuda_core.gqa_ratios) == cuda_core  # nothing else differs
    b = decode_batch(num_heads=28, num_kv_heads=4)  # group size 7
    assert tc.accepts(b) and cuda_core.outside(b) == ["GQA group size 7"]
    assert FlashInferBatchDecodeTC.wrapper_kwargs == {"use_tensor_cores": True}
    assert not FlashInferBatchDecode.wrapper_kwargs
    assert FlashInferBatchDecodeTC.checked_kernel == FlashInferBatchDecode.checked_kernel


# ---- each check: a violating call fires it, the correct one does not -------------------------------------
def good_decode_plan(**kw):
    args = dict(indptr=torch.tensor([0, 2, 3, 5], dtype=I32), indices=torch.tensor([5, 4, 3, 2, 1], dtype=I32),
                last_page_len=torch.tensor([8, 1, 1], dtype=I32), num_qo_heads=28, num_kv_heads=4, head_dim=64,
                page_size=8)
    args.update(kw)
    return make_plan("decode", *(args.pop(k) for k in ("indptr", "indices", "last_page_len", "num_qo_heads",
                                                        "num_kv_heads", "head_dim", "page_size")), **args)


def checks(vs):
    return {v.check for v in vs}


@pytest.mark.parametrize("change, check", [
    (dict(indices=torch.tensor([5, 4, 3, 2, 1])), Check.INDEX_DTYPE),  # int64 ids with int32 indptr
    (dict(indptr=torch.tensor([0, 2, 1, 5], dtype=I32)), Check.KV_INDPTR),  # decreasing
    (dict(indptr=torch.tensor([0, 2, 5], dtype=I32)), Check.KV_INDPTR),  # N entries, not N + 1
    (dict(indptr=torch.tensor([0, 2, 3, 6], dtype=I32)), Check.KV_INDPTR),  # past kv_indices
    (dict(last_page_len=torch.tensor([0, 1, 1], dtype=I32)), Check.LAST_PAGE_LEN),  # full page given as 0
    (dict(last_page_len=torch.tensor([9, 1, 1], dtype=I32)), Check.LAST_PAGE_LEN),  # > page_size
    (dict(indptr=torch.tensor([0, 2, 2, 5], dtype=I32), last_page_len=torch.tensor([8, 1, 1], dtype=I32)),
     Check.LAST_PAGE_LEN),  # no pages but a last page length
    (dict(indptr=torch.tensor([0, 2, 2, 5], dtype=I32), last_page_len=torch.tensor([8, 0, 1], dtype=I32)),
     Check.SEQ_LEN_GE_QUERY_LEN),  # an empty decode sequence
    (dict(num_qo_heads=30), Check.SHAPES),  # heads not a multiple of kv heads
])
def test_plan_checks_fire(change, check):
    assert check_plan(good_decode_plan()) == []
    found = check_plan(good_decode_plan(**change))
    assert check in checks(found), found
    assert all(v.is_error and v.fix for v in found)


def test_prefill_plan_checks_fire():
    ok = dict(qo_indptr=torch.tensor([0, 3, 4, 9], dtype=I32), q_data_type="float16")
    lists = (torch.tensor([0, 2, 4, 6], dtype=I32), torch.arange(6, dtype=I32), torch.tensor([4, 4, 1], dtype=I32))
    assert check_plan(make_plan("prefill", *lists, 4, 2, 64, 4, **ok)) == []
    more_rows = dict(ok, qo_indptr=torch.tensor([0, 3, 4, 15], dtype=I32))  # 11 rows > kv_len 5 + ... for seq 2
    assert Check.SEQ_LEN_GE_QUERY_LEN in checks(check_plan(make_plan("prefill", *lists, 4, 2, 64, 4, **more_rows)))
    back = dict(ok, qo_indptr=torch.tensor([0, 3, 2, 9], dtype=I32))
    assert Check.QUERY_START_LOC in checks(check_plan(make_plan("prefill", *lists, 4, 2, 64, 4, **back)))
    short = dict(ok, qo_indptr=torch.tensor([0, 3, 9], dtype=I32))
    assert Check.QUERY_START_LOC in checks(check_plan(make_plan("prefill", *lists, 4, 2, 64, 4, **short)))


def decode_run_args(layout=FlashInferLayout("NHD", True), dtype=torch.float16, pages=8, page_size=8, heads=4, d=64,
                    rows=3, q_heads=28):
    b = Batch(query_lens=[1], ctx_lens=[0], num_heads=heads, num_kv_heads=heads, head_size=d, block_size=page_size,
              num_blocks=pages, block_table=[[0]], dtype="float16")
    kc, vc = layout.allocate(b)
    kc.zero_(), vc.zero_()
    return torch.zeros(rows, q_heads, d, dtype=dtype), layout.paged_kv_cache(kc, vc)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.name)
def test_run_checks_fire(layout):
    plan = good_decode_plan(kv_layout=layout.kv_layout, q_data_type=torch.float16)
    q, cache = decode_run_args(layout)
    assert check_run(plan, q, cache) == []
    cases = [
        (decode_run_args(layout, page_size=16), Check.PLAN_RUN),  # page size of the cache != planned
        (decode_run_args(layout, heads=2), Check.PLAN_RUN),
        (decode_run_args(layout, d=128), Check.PLAN_RUN),
        (decode_run_args(layout, rows=4), Check.PLAN_RUN),  # q rows != batch size
        (decode_run_args(layout, dtype=torch.bfloat16), Check.PLAN_RUN),
        (decode_run_args(layout, pages=4), Check.KV_INDICES_RANGE),  # page id 5 of a 4-page cache
    ]
    for (q2, c2), check in cases:
        assert check in checks(check_run(plan, q2, c2)), check
    assert checks(check_run(None, q, cache)) == {Check.PLAN_RUN}
    fp8_plan = good_decode_plan(kv_layout=layout.kv_layout, q_data_type=torch.float16, kv_data_type="float8_e4m3fn")
    assert Check.PLAN_RUN in checks(check_run(fp8_plan, q, cache))  # an fp16 cache where fp8 was planned
    assert checks(check_run(plan, q, torch.zeros(8, 8, 4, 64))) == {Check.SHAPES}  # a lone 4-D tensor


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.name)
def test_current_token_check_fires_on_a_decode_never_appended(layout):
    b = decode_batch(seq_lens=(16, 1, 9), page_size=8, num_heads=28, num_kv_heads=4, seed=0)
    data = make_batch_data(b)
    k, v = data.new_kv(b)
    plan = make_plan("decode", *page_list_tensors(b, b.seq_lens, "cpu"), 28, 4, 64, 8, kv_layout=layout.kv_layout)
    full = materialize(b, data, layout, b.seq_lens, Poison.NAN)
    assert check_current_tokens(plan, layout.paged_kv_cache(full.key_cache, full.value_cache), k, v) == []
    ctx_only = materialize(b, data, layout, b.ctx_lens, Poison.STALE)  # the seeds' bug: current token not written
    found = check_current_tokens(plan, layout.paged_kv_cache(ctx_only.key_cache, ctx_only.value_cache), k, v)
    assert checks(found) == {Check.UNIFIED} and [v.seq for v in found] == [0, 1, 2]
    assert [v.position for v in found] == [15, 0, 8]
    assert "append_paged_kv_cache" in found[0].message
    assert checks(check_current_tokens(plan, layout.paged_kv_cache(full.key_cache, full.value_cache), k[:2],
                                       v[:2])) == {Check.PREFILL_ROWS}


def append_args(**kw):
    lay = FlashInferLayout("HND", True)
    b = prefill_batch()
    kc, vc = lay.allocate(b)
    a = dict(append_key=torch.zeros(9, 2, 64, dtype=torch.float16), append_value=torch.zeros(9, 2, 64,
                                                                                          dtype=torch.float16),
             batch_indices=torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2], dtype=I32),
             positions=torch.tensor([5, 6, 7, 7, 0, 1, 2, 3, 4], dtype=I32), paged_kv_cache=lay.paged_kv_cache(kc, vc),
             kv_indices=torch.tensor([0, 1, 2, 3, 4, 5], dtype=I32), kv_indptr=torch.tensor([0, 2, 4, 6], dtype=I32),
             kv_last_page_len=torch.tensor([4, 4, 1], dtype=I32), kv_layout="HND")
    a.update(kw)
    return a


@pytest.mark.parametrize("change, check", [
    (dict(positions=torch.tensor([5, 6, 7, 7, 0, 1, 2, 3, 4])), Check.INDEX_DTYPE),  # int64 positions
    (dict(kv_indptr=torch.tensor([0, 2, 4, 6])), Check.INDEX_DTYPE),  # int64: csrc/page.cu reads int32
    (dict(append_key=torch.zeros(9, 2, 64, dtype=torch.bfloat16)), Check.KV_CACHE_DTYPE),
    (dict(append_key=torch.zeros(9, 1, 64, dtype=torch.float16)), Check.SHAPES),
    (dict(positions=torch.tensor([5, 6, 8, 7, 0, 1, 2, 3, 4], dtype=I32)), Check.APPEND_POSITIONS),  # past kv_len
    (dict(batch_indices=torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 3], dtype=I32)), Check.APPEND_POSITIONS),
    (dict(kv_indices=torch.tensor([0, 1, 2, 3, 4, 8], dtype=I32)), Check.KV_INDICES_RANGE),
    (dict(kv_last_page_len=torch.tensor([4, 0, 1], dtype=I32)), Check.LAST_PAGE_LEN),
    (dict(positions=torch.tensor([5, 6, 7], dtype=I32)), Check.SHAPES),
])
def test_append_checks_fire(change, check):
    assert check_append(**append_args()) == []
    assert check in checks(check_append(**append_args(**change)))


def test_new_checks_have_fixes():
    for c in (Check.LAST_PAGE_LEN, Check.PLAN_RUN, Check.APPEND_POSITIONS):
        assert FIX[c] and c.memory_unsafe


# ---- the guard, over a stand-in flashinfer (its run() computes nothing: tests/support/flashinfer_standin.py) -----
def test_guard_wraps_plan_and_run_and_remembers_the_plan_per_wrapper():
    fi = standin_flashinfer()
    original_plan = fi.BatchDecodeWithPagedKVCacheWrapper.plan
    q, cache = decode_run_args()
    lists = (torch.tensor([0, 2, 3, 5], dtype=I32), torch.tensor([5, 4, 3, 2, 1], dtype=I32),
             torch.tensor([8, 1, 1], dtype=I32))
    with guard(mode="record") as g, fguard.flashinfer_guard(fi) as ok:
        assert ok
        good = fi.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
        other = fi.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
        good.plan(*lists, 28, 4, 64, 8, q_data_type=torch.float16)
        other.plan(*lists, 28, 4, 64, 16, q_data_type=torch.float16)  # planned for pages of 16
        good.run(q, cache)
        assert g.records == []
        other.run(q, cache)  # the cache's pages are 8
        assert [r.kernel for r in g.records] == ["flashinfer.BatchDecodeWithPagedKVCacheWrapper.run"]
        assert Check.PLAN_RUN in g.records[0].checks
        bad_lists = (lists[0], lists[1], torch.tensor([0, 1, 1], dtype=I32))
        good.plan(*bad_lists, 28, 4, 64, 8)
        assert Check.LAST_PAGE_LEN in g.records[-1].checks
        assert g.calls["flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan"] == 3
        assert fi.calls.count("decode.run") == 2  # the stand-in ran: record mode never stops a call
    with fguard.flashinfer_guard(fi):
        early = fi.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
        early.plan(*lists, 28, 4, 64, 16)  # planned while no guard was active: run() is not judged
        with guard(mode="record") as g2:
            early.run(q, cache)
        assert g2.records == [] and g2.unchecked["flashinfer.BatchDecodeWithPagedKVCacheWrapper.run"] == 1
    assert fi.BatchDecodeWithPagedKVCacheWrapper.plan is original_plan and not fguard.installed()


def test_guard_with_new_kv_fails_a_decode_whose_token_was_never_appended_and_raise_mode_stops_it():
    fi = standin_flashinfer()
    b = decode_batch(seq_lens=(16, 1, 9), page_size=8)
    data = make_batch_data(b)
    k, v = data.new_kv(b)
    lay = FlashInferLayout("NHD", True)
    lists = page_list_tensors(b, b.seq_lens, "cpu")
    ctx_only = materialize(b, data, lay, b.ctx_lens, Poison.ZEROS)
    full = materialize(b, data, lay, b.seq_lens, Poison.ZEROS)
    with guard(mode="raise") as g, fguard.flashinfer_guard(fi):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
        w.plan(*lists, 28, 4, 64, 8, q_data_type=torch.float16)
        q = data.query
        with g.new_kv(k, v):
            w.run(q, lay.paged_kv_cache(full.key_cache, full.value_cache))
            with pytest.raises(CallerContractError, match="unified invariant"):
                w.run(q, lay.paged_kv_cache(ctx_only.key_cache, ctx_only.value_cache))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            w.run(q, lay.paged_kv_cache(ctx_only.key_cache, ctx_only.value_cache))  # without new_kv: not checked
    assert fi.calls.count("decode.run") == 2 and g.stopped == 1


def test_guard_checks_prefill_and_append_through_the_stand_in():
    fi = standin_flashinfer()
    with guard(mode="record") as g, fguard.flashinfer_guard(fi):
        w = fi.BatchPrefillWithPagedKVCacheWrapper(None, "HND")
        lists = (torch.tensor([0, 2, 4, 6], dtype=I32), torch.arange(6, dtype=I32),
                 torch.tensor([4, 4, 1], dtype=I32))
        w.plan(torch.tensor([0, 3, 4, 15], dtype=I32), *lists, 4, 2, 64, 4, causal=True)
        assert g.records[-1].checks == (Check.SEQ_LEN_GE_QUERY_LEN,)
        fi.append_paged_kv_cache(**append_args())
        n = len(g.records)
        fi.append_paged_kv_cache(**append_args(positions=torch.tensor([5, 6, 7, 7, 0, 1, 2, 3, 4])))
        assert len(g.records) == n + 1 and g.records[-1].kernel == "flashinfer.append_paged_kv_cache"
    assert fi.calls == ["prefill.plan", "append", "append"]


def test_guard_passes_calls_through_without_an_active_guard_and_install_needs_flashinfer():
    fi = standin_flashinfer()
    with fguard.flashinfer_guard(fi):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(None)
        w.plan(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0]), 1, 1, 64, 8)  # bad, but unguarded
        assert fi.calls == ["decode.plan"]
    try:
        import flashinfer  # noqa: F401
    except Exception:
        assert fguard.install() is False and not fguard.installed()


# ---- the harness with the targets' calls, the kernel replaced by a CPU model (marked as such) -----------------
class _AppendModel(FlashInferAppendPagedKvCache):
    """NOT FlashInfer: append_paged_kv_cache's documented effect written with the layout, to test that the writer
    harness (guard blocks, element offsets, the 5-D views) reads this target's calls right."""

    name = "test.flashinfer_append_model"

    def run(self, call):
        kw = call.kwargs
        lay = call.layout
        ptr, idx = kw["kv_indptr"].long(), kw["kv_indices"].long()
        ps = lay.dims(call.key_cache)[1]
        pos, seq = kw["positions"].long(), kw["batch_indices"].long()
        slots = idx[ptr[seq] + pos // ps] * ps + pos % ps
        kc, vc = unpack_paged_kv_cache(kw["paged_kv_cache"], lay.kv_layout)
        lay.write(kc, vc, slots, kw["append_key"], kw["append_value"])
        return call.key_cache


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_writer_harness_reads_the_append_calls(seed, kv_cache_dtype):
    from kvfuzz.contracts.model.example import Example
    from kvfuzz.fuzz.harness.writer import check_writer_example

    b = prefill_batch(seed=seed, kv_cache_dtype=kv_cache_dtype, k_scale=0.5 if kv_cache_dtype != "auto" else 1.0)
    t = _AppendModel()
    t.availability = lambda: __import__("kvfuzz.fuzz.targets.base", fromlist=["Availability"]).Availability(True)
    check_writer_example(t, Example(b, Poison.NAN))  # passes: every token at its slot, nothing else touched


class _AppendModelOffByOne(_AppendModel):
    """NOT FlashInfer: a broken writer (each row one slot too far), which the harness must catch."""

    name = "test.flashinfer_append_model_off_by_one"

    def run(self, call):
        call.kwargs["positions"] = call.kwargs["positions"] + 1
        return super().run(call)


def test_writer_harness_catches_a_broken_append():
    from kvfuzz.contracts.checks.failures import KernelMismatch
    from kvfuzz.contracts.model.example import Example
    from kvfuzz.fuzz.harness.writer import check_writer_example

    t = _AppendModelOffByOne()
    t.availability = lambda: __import__("kvfuzz.fuzz.targets.base", fromlist=["Availability"]).Availability(True)
    with pytest.raises(KernelMismatch):
        check_writer_example(t, Example(prefill_batch(seed=0), Poison.NAN))


def test_the_plugin_installs_the_flashinfer_hooks_only_where_flashinfer_is_installed(monkeypatch):
    """--kvfuzz-guard wraps FlashInfer's plan()/run() for the session when flashinfer is importable, and
    imports nothing when it is not (this CPU machine)."""
    import importlib.machinery
    import importlib.util

    from kvfuzz.fuzz.guard import flashinfer as fi_guard
    from kvfuzz.fuzz.guard.plugin import _install_flashinfer

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert _install_flashinfer() is False and not fi_guard.installed()
    m = standin_flashinfer()
    m.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer", m)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: m.__spec__ if name == "flashinfer" else None)
    original = m.BatchDecodeWithPagedKVCacheWrapper.plan
    try:
        assert _install_flashinfer() is True and fi_guard.installed()
        assert m.BatchDecodeWithPagedKVCacheWrapper.plan is not original
    finally:
        fi_guard.uninstall()
    assert not fi_guard.installed() and m.BatchDecodeWithPagedKVCacheWrapper.plan is original
