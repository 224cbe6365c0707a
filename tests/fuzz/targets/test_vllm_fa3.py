"""FlashAttention 3's paged forward as vLLM's FLASH_ATTN backend calls it (the target ``vllm.flash_attn_varlen``)
and the guard's signature of ``flash_attn_varlen_func``.

FA3 runs on a Hopper GPU only. Here the target's calls go through vLLM's *real* Python wrapper
(vllm/vllm_flash_attn/flash_attn_interface.py) into torch stand-ins for the compiled ops
(tests/support/hopper_standins.py), which check what the extension checks and compute paged attention from
exactly the arguments FA3 would receive: a wrong block table, ``cu_seqlens_q``, ``seqused_k``, window
convention or scheduler metadata fails against kvfuzz's fp64 reference. The real kernel runs in
benchmarks/gpu_hopper.sh on an H100."""

import sys
import types

import attrs
import pytest
import torch
from support import batch_of, hopper_standins, kvfuzz
from support.hopper_standins import StandInFA3

from kvfuzz.contracts.caches.layouts import NHDLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.failures import CallerContractViolation, KernelMismatch, NonFiniteOutput
from kvfuzz.contracts.checks.violations import Check
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.guard import CallerContractError, guard
from kvfuzz.fuzz.guard.signatures import SIGNATURES, build_call, check_kernel_call
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.targets.base import Availability
from kvfuzz.fuzz.targets.registry import FAMILIES, get_target, registered
from kvfuzz.fuzz.targets.vllm_flash_attn import (
    CUDA_GRAPH_MAX_SPLITS,
    FLASH_ATTN_VARLEN_FUNC,
    HOPPER_ONLY,
    SPLIT_CHOICES,
    VllmFlashAttnVarlen,
)

NAME = "vllm.flash_attn_varlen"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-ins replace the compiled ops on a CPU only")


@pytest.fixture
def fa3(monkeypatch):
    return hopper_standins.install_fa3(monkeypatch)


def same_bits(a, b):
    """Equal element for element, NaN poison included."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def batch(lens, *, seed=0, **kw):
    kw = dict(dict(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16", block_size=16), **kw)
    return batch_of(lens, seed=seed, **kw)


# ---- the declaration ---------------------------------------------------------------------------------------

def test_the_target_is_registered_and_declares_what_the_backend_accepts():
    assert NAME in registered() and "kvfuzz.fuzz.targets.vllm_flash_attn" in FAMILIES
    t = get_target(NAME)
    c = t.capabilities
    assert t.checked_kernel is FLASH_ATTN_VARLEN_FUNC and SIGNATURES["flash_attn_varlen_func"] is FLASH_ATTN_VARLEN_FUNC
    assert c.contract is Contract.UNIFIED and not c.decode_only and c.devices == ("cuda",)
    assert set(c.dtypes) == {"float16", "bfloat16"}                         # FlashAttentionBackend.supported_dtypes
    assert all(h % 8 == 0 and h <= 256 for h in c.head_sizes)              # supports_head_size (FA3: <= 256)
    assert all(bs % 16 == 0 for bs in c.block_sizes)                      # get_supported_kernel_block_sizes
    assert c.features == {"sliding_window", "softcap"}  # no ALiBi in FA3 (its fp8 caches: test_vllm_fa3_fp8.py)
    decl = FLASH_ATTN_VARLEN_FUNC.declaration
    assert decl.paths[0].index_dtypes == {torch.int32} and decl.paths[0].reads == {"max_query_len", "max_seq_len"}


@no_cuda
def test_without_cuda_it_says_why_in_one_line():
    assert get_target(NAME).installed() == Availability(False, HOPPER_ONLY)
    r = kvfuzz("targets")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(NAME + "\t"))
    assert line.endswith("no: " + HOPPER_ONLY) and "\n" not in HOPPER_ONLY


def test_split_counts_and_the_ahead_of_time_schedule_are_drawn_from_the_seed():
    seen = {(VllmFlashAttnVarlen.num_splits(batch([(1, 5)], seed=s)),
             VllmFlashAttnVarlen.aot_schedule(batch([(1, 5)], seed=s))) for s in range(16)}
    assert {s for s, _ in seen} == set(SPLIT_CHOICES) and {0, CUDA_GRAPH_MAX_SPLITS} <= set(SPLIT_CHOICES)
    assert {a for _, a in seen} == {True, False}
    assert VllmFlashAttnVarlen().path(batch([(1, 5)], seed=1)) == f"splits={CUDA_GRAPH_MAX_SPLITS},sched=aot,gqa=2"
    assert VllmFlashAttnVarlen().path(batch([(1, 5)], seed=12)) == "splits=heuristic,sched=none,gqa=2"


# ---- the call, as the backend builds it --------------------------------------------------------------------

@no_cuda
def test_the_call_is_built_as_the_backend_builds_it(fa3):
    b = batch([(5, 3), (1, 20)], seed=5, sliding_window=6, softcap=20.0, sinks=True)
    d = make_batch_data(b)
    cs = materialize(b, d, NHDLayout(), b.seq_lens, Poison.NAN)
    kw = StandInFA3().build_call(b, d, cs).kwargs
    k, v = kw["k"], kw["v"]
    nb, bs, hkv, hd = k.shape
    # the strided views of one [NB, Hkv, BS, 2D] buffer: kv_cache.transpose(1, 2).split(D, dim=-1)
    assert k.stride() == (hkv * bs * 2 * hd, 2 * hd, bs * 2 * hd, 1) and v.stride() == k.stride()
    assert v.data_ptr() == k.data_ptr() + hd * k.element_size()
    assert same_bits(k, cs.key_cache) and same_bits(v, cs.value_cache)
    assert kw["window_size"] == [5, 0] and kw["softcap"] == 20.0 and kw["causal"] and kw["fa_version"] == 3
    assert kw["alibi_slopes"] is None and kw["num_splits"] == SPLIT_CHOICES[5 % 4]
    assert kw["block_table"].dtype == kw["cu_seqlens_q"].dtype == kw["seqused_k"].dtype == torch.int32
    for name in ("q_descale", "k_descale", "v_descale"):  # layer._x_scale.expand((num_seqs, num_kv_heads))
        assert kw[name].shape == (2, 2) and kw[name].stride() == (0, 0)
    assert kw["s_aux"].dtype == torch.bfloat16 and kw["s_aux"].shape == (4,)  # the extension takes bf16 only
    made = hopper_standins.SEEN["sched"][kw["scheduler_metadata"].data_ptr()]  # seed 5: aot
    assert (made["batch_size"], made["max_seqlen_q"], made["max_seqlen_k"], made["page_size"]) == (2, 5, 21, 16)
    assert (made["window_size_left"], made["window_size_right"], made["num_splits"]) == (5, 0, kw["num_splits"])
    assert made["has_softcap"] is False  # the builder does not pass it
    assert StandInFA3().build_call(attrs.evolve(b, seed=12), d, cs).kwargs["scheduler_metadata"] is None


def test_a_head_count_of_one_gets_canonical_strides():
    b = batch([(1, 20)], num_heads=2, num_kv_heads=1, head_size=32)
    d = make_batch_data(b)
    cs = materialize(b, d, NHDLayout(), b.seq_lens, Poison.NAN)
    k, _ = VllmFlashAttnVarlen.backend_views(b, cs)
    assert k.stride(2) == 32  # canonicalize_singleton_dim_strides: the size-1 head dim's stride is D
    assert same_bits(k, cs.key_cache)


# ---- end to end: the real wrapper, the stand-in op, kvfuzz's reference ---------------------------------------

@no_cuda
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 12])  # every split choice, with and without the aot schedule
@pytest.mark.parametrize("features", [{}, dict(sliding_window=5), dict(softcap=3.0), dict(dtype="bfloat16")])
def test_the_backend_call_through_the_real_wrapper_agrees_with_the_reference(fa3, seed, features):
    b = batch([(1, 30), (7, 12), (1, 0), (16, 0)], seed=seed, **features)
    run = check_example(StandInFA3(), Example(b, Poison.NAN))
    assert run.output.shape == (b.num_tokens, 4, 64)
    call = hopper_standins.SEEN["fwd"][-1]
    assert call["num_splits"] == StandInFA3.num_splits(b) and (call["scheduler_metadata"] is not None) == \
        StandInFA3.aot_schedule(b)


class WrongWindow(StandInFA3):
    """A caller with the window off by one: ``(W, 0)`` where FlashAttention means ``(W - 1, 0)``."""

    name = "test.fa3_wrong_window"

    @staticmethod
    def window_size(batch):
        return [-1, -1] if batch.sliding_window is None else [batch.sliding_window, 0]


class StaleSeqLens(StandInFA3):
    """A caller handing ``seqused_k`` the context lengths (the new tokens not counted)."""

    name = "test.fa3_stale_seqused_k"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        call.kwargs["seqused_k"] = torch.tensor(batch.ctx_lens, dtype=torch.int32) + 0
        return call


@no_cuda
def test_a_window_off_by_one_is_a_kernel_mismatch(fa3):
    b = batch([(1, 30), (6, 10)], seed=2, sliding_window=4)
    check_example(StandInFA3(), Example(b, Poison.NAN))
    with pytest.raises(KernelMismatch):
        check_example(WrongWindow(), Example(b, Poison.NAN))


@no_cuda
def test_stale_seqused_k_is_a_caller_violation(fa3):
    b = batch([(1, 30), (6, 10)], seed=2)
    with pytest.raises(CallerContractViolation):
        check_example(StaleSeqLens(), Example(b, Poison.NAN))


# ---- the guard -----------------------------------------------------------------------------------------------

def backend_kwargs(b, cached):
    """The backend's call (no scheduler metadata: no op needed), with the cache holding ``cached`` positions."""
    d = make_batch_data(b)
    cs = materialize(b, d, NHDLayout(), cached, Poison.NAN)

    class NoSched(VllmFlashAttnVarlen):
        name = "test.fa3_no_sched"

        @staticmethod
        def aot_schedule(batch):
            return False

    return d, NoSched().build_call(b, d, cs).kwargs


def test_the_guard_passes_the_backends_call_and_catches_an_unwritten_new_token():
    b = batch([(5, 3), (1, 20)], seed=4)
    d, kw = backend_kwargs(b, b.seq_lens)
    key, value = d.new_kv(b)
    assert check_kernel_call("flash_attn_varlen_func", kw, key=key, value=value) == []
    call = build_call("flash_attn_varlen_func", kw, key, value)
    assert call.k_scale.numel() == 1 and float(call.k_scale) == 1.0  # the expanded descales read as one scale
    d, kw = backend_kwargs(b, b.ctx_lens)  # reshape_and_cache_flash skipped: the new tokens are not in the cache
    vs = check_kernel_call("flash_attn_varlen_func", kw, key=key, value=value)
    assert {v.check for v in vs} == {Check.UNIFIED} and sorted((v.seq, v.position) for v in vs) == [(0, 3), (1, 20)]


def test_the_guard_checks_fa3s_int32_indices_and_max_seqlen_k():
    b = batch([(5, 3), (1, 20)], seed=4)
    _, kw = backend_kwargs(b, b.seq_lens)
    vs = check_kernel_call("flash_attn_varlen_func", dict(kw, block_table=kw["block_table"].long()))
    assert Check.INDEX_DTYPE in {v.check for v in vs}
    vs = check_kernel_call("flash_attn_varlen_func", dict(kw, max_seqlen_k=b.max_seq_len - 1))
    assert Check.MAX_SEQ_LEN in {v.check for v in vs}


def test_an_unpaged_varlen_call_is_read_as_one_token_blocks():
    q = torch.randn(7, 4, 32, dtype=torch.float16)
    k, v = torch.randn(12, 2, 32, dtype=torch.float16), torch.randn(12, 2, 32, dtype=torch.float16)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    args = dict(q=q, k=k, v=v, max_seqlen_q=4, cu_seqlens_q=cu_q, max_seqlen_k=7, cu_seqlens_k=cu_k, causal=True)
    call = build_call("flash_attn_varlen_func", args)
    assert call.block_size == 1 and call.seq_lens.tolist() == [5, 7]
    assert call.block_table.tolist() == [[0, 1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 10, 11]]
    assert check_kernel_call("flash_attn_varlen_func", args) == []
    assert Check.MAX_SEQ_LEN in {v.check for v in check_kernel_call("flash_attn_varlen_func",
                                                                     dict(args, max_seqlen_k=6))}


@no_cuda
def test_the_guard_wraps_flash_attn_varlen_func_where_vllms_tests_import_it(fa3, monkeypatch):
    """test_flash_attn.py does ``from vllm.vllm_flash_attn import flash_attn_varlen_func`` at import time,
    before the guard is on: the guard wraps that name too (here a stand-in test module holds it)."""
    upstream = types.ModuleType("kvfuzz_test_upstream_fa")
    upstream.flash_attn_varlen_func = sys.modules["vllm.vllm_flash_attn"].flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, upstream.__name__, upstream)
    b = batch([(5, 3), (1, 20)], seed=4)
    for cached, fires in ((b.ctx_lens, True), (b.seq_lens, False)):
        d, kw = backend_kwargs(b, cached)
        kw["out"].fill_(7.0)
        key, value = d.new_kv(b)
        with guard("raise") as g, g.new_kv(key, value):
            if fires:
                with pytest.raises(CallerContractError):
                    upstream.flash_attn_varlen_func(**kw)
                assert (kw["out"] == 7.0).all()  # stopped before the kernel ran
            else:
                upstream.flash_attn_varlen_func(**kw)
                assert g.records == [] and g.calls == {"flash_attn_varlen_func": 1} and kw["out"].isfinite().all()
    assert upstream.flash_attn_varlen_func is sys.modules["vllm.vllm_flash_attn"].flash_attn_varlen_func  # undone


def test_an_fp8_call_reads_one_descale_as_the_cache_scale_and_skips_per_head_ones():
    """FA3's fp8 calls (test_flash_attn.py's fp8 queries): an fp8 cache with ``k/v_descale [N, Hkv]``; one value
    throughout is the cache's scale (the new tokens are compared after quantizing with it), per-head values are
    not compared (no error either)."""
    b = batch([(5, 3), (1, 20)], seed=4)
    d, kw = backend_kwargs(b, b.seq_lens)
    key, value = d.new_kv(b)
    fp8 = dict(kw, q=kw["q"].to(torch.float8_e4m3fn), k=kw["k"].to(torch.float8_e4m3fn),
               v=kw["v"].to(torch.float8_e4m3fn))
    assert check_kernel_call("flash_attn_varlen_func", fp8, key=key, value=value) == []
    per_head = torch.tensor([[1.0, 0.5], [1.0, 0.5]])
    call = build_call("flash_attn_varlen_func", dict(fp8, k_descale=per_head, v_descale=per_head), key, value)
    assert call.k_scale is per_head
    assert check_kernel_call("flash_attn_varlen_func", dict(fp8, k_descale=per_head, v_descale=per_head),
                             key=key, value=value) == []


# ---- CUDA-graph padding (vLLM's FULL graphs: FLASH_ATTN declares AttentionCGSupport.ALWAYS for FA3) ----------

def padded(pads=2, seed=1, **kw):
    """A decode batch (block 0 unused, the null block) with ``pads`` CUDA-graph pad sequences."""
    return batch([(1, 30), (1, 5)], seed=seed, num_pad_seqs=pads, spare=1, reverse=True, **kw)


def test_the_target_declares_vllms_padding_and_draws_padded_decode_batches():
    from hypothesis import find, settings

    from kvfuzz.contracts.model.padding import padding
    from kvfuzz.strategies.batches import batches

    c = get_target(NAME).capabilities
    assert c.cuda_graph_padding == "vllm" and "cuda-graph padding (vllm)" in c.states
    assert FLASH_ATTN_VARLEN_FUNC.declaration.trailing_query_rows
    b = find(batches(c), lambda b: b.num_pad_seqs > 0, settings=settings(max_examples=300, database=None))
    assert all(q == 1 for q in b.query_lens)  # vLLM pads uniform decode batches only (FULL_AND_PIECEWISE)
    pad = padding(b, c.cuda_graph_padding)  # pads of seq_len 0 and query_len 0 on the null block
    assert pad.seq_lens()[b.num_seqs:] == (0,) * b.num_pad_seqs and pad.query_start_loc()[-1] == b.num_tokens


@no_cuda
def test_a_padded_batch_is_called_as_a_full_graph_replay(fa3):
    """gpu_model_runner.py's padding through FlashAttentionMetadataBuilder.build and FlashAttentionImpl.forward:
    q/out one row per pad past cu_seqlens_q[-1], pads of query_len 0 and seq_len 0 on the null block, descales and
    the scheduler's batch_size over the padded count, num_splits the FULL graph's 32; the stand-in leaves the pad
    rows alone, and the real rows match the reference."""
    b = padded(pads=2, seed=12)  # seed 12 unpadded: heuristic splits, no schedule; padded: 32 splits, still none
    d = make_batch_data(b)
    cs = materialize(b, d, NHDLayout(), b.seq_lens, Poison.NAN)
    kw = StandInFA3().build_call(b, d, cs).kwargs
    assert kw["q"].shape == kw["out"].shape == (4, 4, 64) and torch.equal(kw["q"][:2], d.query)
    assert kw["cu_seqlens_q"].tolist() == [0, 1, 2, 2, 2] and kw["seqused_k"].tolist() == [31, 6, 0, 0]
    assert kw["block_table"][2:].eq(0).all() and kw["max_seqlen_k"] == 31 and kw["max_seqlen_q"] == 1
    assert kw["num_splits"] == CUDA_GRAPH_MAX_SPLITS and kw["k_descale"].shape == (4, 2)
    b = attrs.evolve(b, seed=1)
    kw = StandInFA3().build_call(b, d, cs).kwargs
    made = hopper_standins.SEEN["sched"][kw["scheduler_metadata"].data_ptr()]
    assert (made["batch_size"], made["num_splits"]) == (4, CUDA_GRAPH_MAX_SPLITS)
    assert made["seqused_k"].tolist() == [31, 6, 0, 0] and made["cu_seqlens_q"].tolist() == [0, 1, 2, 2, 2]
    for poison in (Poison.NAN, Poison.INF):
        run = check_example(StandInFA3(), Example(b, poison))
        assert run.output.shape == (4, 4, 64) and torch.equal(run.output[2:], torch.zeros(2, 4, 64))


class PadNaN(StandInFA3):
    """A kernel writing NaN into the rows past ``cu_seqlens_q[-1]`` (a pad token's row)."""

    name = "test.fa3_pad_nan"

    def run(self, call):
        out = super().run(call)
        out[int(call.kwargs["cu_seqlens_q"][-1]):] = float("nan")
        return out


class PadRowsFromRealSeqs(StandInFA3):
    """A caller handing the pads the real sequences' lengths: not vLLM's padding (seq_len 0)."""

    name = "test.fa3_pad_lens"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        call.kwargs["seqused_k"][batch.num_seqs:] = batch.seq_lens[0]
        return call


@no_cuda
def test_the_pad_oracle_and_the_callers_checks_hold_for_fa3(fa3):
    b = padded(pads=1)
    with pytest.raises(NonFiniteOutput, match="which is a pad row"):
        check_example(PadNaN(), Example(b, Poison.ZEROS))
    check_example(PadNaN(), Example(attrs.evolve(b, num_pad_seqs=0), Poison.ZEROS))  # no pad row: passes
    with pytest.raises(CallerContractViolation) as e:
        check_example(PadRowsFromRealSeqs(), Example(b, Poison.ZEROS))
    assert e.value.check == Check.SEQ_LENS.value


def test_the_guard_takes_vllms_pad_rows_and_still_catches_a_real_violation():
    """The guard on the padded call: the rows past cu_seqlens_q[-1] are pads (``trailing_query_rows``), not a
    caller bug; without the declaration they are one; an unwritten new token of a real sequence still is."""
    b = padded(pads=3, seed=4)
    d, kw = backend_kwargs(b, b.seq_lens)
    key, value = d.new_kv(b)
    assert kw["q"].shape[0] == 5 and kw["cu_seqlens_q"].tolist() == [0, 1, 2, 2, 2, 2]
    assert check_kernel_call("flash_attn_varlen_func", kw, key=key, value=value) == []
    from kvfuzz.contracts.calls.call_checks import check_call

    call = build_call("flash_attn_varlen_func", kw, key, value)
    strict = attrs.evolve(call, declaration=attrs.evolve(call.declaration, trailing_query_rows=False))
    assert [v.check for v in check_call(strict, vacuity=False) if v.is_error] == [Check.QUERY_START_LOC]
    d, kw = backend_kwargs(b, b.ctx_lens)  # the new tokens not in the cache
    vs = check_kernel_call("flash_attn_varlen_func", kw, key=key, value=value)
    assert {v.check for v in vs} == {Check.UNIFIED} and sorted(v.seq for v in vs) == [0, 1]
