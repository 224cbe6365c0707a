"""FlashMLA's dense decode as vLLM's FLASHMLA backend calls it (the target ``vllm.flashmla_decode``) and the guard's
signatures of ``flash_mla_with_kvcache`` / ``flash_mla_with_kvcache_fp8``.

FlashMLA runs on a Hopper GPU only. Here the target's calls go through vLLM's *real* Python interface
(vllm/third_party/flashmla/flash_mla_interface.py) into a torch stand-in for ``_flashmla_C.dense_decode_fwd``
(tests/support/hopper_standins.py) that checks what the extension checks and computes latent attention from the
arguments it receives, against kvfuzz's fp64 reference. The real kernel runs in benchmarks/gpu_hopper.sh."""

import sys
import types

import attrs
import pytest
import torch
from support import batch_of, hopper_standins
from support.hopper_standins import StandInFA3, StandInFlashMla

from kvfuzz.contracts.caches.layouts import LatentLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.failures import KernelMismatch
from kvfuzz.contracts.checks.violations import Check
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.guard import CallerContractError, guard
from kvfuzz.fuzz.guard.signatures import SIGNATURES, build_call, check_kernel_call
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.targets.base import Availability
from kvfuzz.fuzz.targets.registry import get_target, registered
from kvfuzz.fuzz.targets.vllm_mla import (
    DEEPSEEK_SM_SCALE,
    FLASH_MLA_WITH_KVCACHE,
    FLASH_MLA_WITH_KVCACHE_FP8,
    FLASHMLA_HOPPER_ONLY,
)

NAME = "vllm.flashmla_decode"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in replaces the compiled op on a CPU only")


@pytest.fixture
def mla(monkeypatch):
    return hopper_standins.install_flashmla(monkeypatch)


def latent(lens, *, num_heads=16, dtype="bfloat16", **kw):
    return batch_of(lens, num_heads=num_heads, num_kv_heads=1, head_size=576, value_head_size=512, dtype=dtype,
                    block_size=64, sm_scale=DEEPSEEK_SM_SCALE, **kw)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def test_the_target_is_registered_and_declares_the_backends_dense_decode():
    assert NAME in registered()
    t = get_target(NAME)
    c = t.capabilities
    assert t.checked_kernel is FLASH_MLA_WITH_KVCACHE
    assert SIGNATURES["flash_mla_with_kvcache"] is FLASH_MLA_WITH_KVCACHE
    assert SIGNATURES["flash_mla_with_kvcache_fp8"] is FLASH_MLA_WITH_KVCACHE_FP8
    assert c.contract is Contract.UNIFIED and c.decode_only and c.devices == ("cuda",)
    assert (c.head_sizes, c.value_head_size, c.block_sizes) == ((576,), 512, (64,))  # block size 64 only
    assert set(c.dtypes) == {"float16", "bfloat16"} and c.kv_cache_dtypes == ("auto",) and not c.features
    assert FLASH_MLA_WITH_KVCACHE.declaration.value_head_size_may_differ
    assert FLASH_MLA_WITH_KVCACHE.declaration.paths[0].index_dtypes == {torch.int32}


@pytest.mark.skipif(torch.cuda.is_available(), reason="says why without CUDA")
def test_without_cuda_it_says_why():
    assert get_target(NAME).installed() == Availability(False, FLASHMLA_HOPPER_ONLY)


def test_hopper_installed_names_the_missing_files_then_the_device(tmp_path, monkeypatch):
    """The installed() check FA3 and FlashMLA share (triton_runtime.hopper_installed), its branches past "no CUDA"
    with a pretend device: the vllm files it lacks, then a GPU that is not SM 9.x, then ready (not loaded)."""
    import importlib.util
    import types

    from kvfuzz.fuzz.targets import triton_runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    fake = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "vllm" else None)
    files = ("_flashmla_C.abi3.so", "third_party/flashmla/flash_mla_interface.py")
    a = triton_runtime.hopper_installed(files, "no cuda", "FlashMLA", "vllm._flashmla_C")
    assert not a.ok and a.reason.startswith(f"the installed vllm lacks {', '.join(files)} ")
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes(b"")
    a = triton_runtime.hopper_installed(files, "no cuda", "FlashMLA", "vllm._flashmla_C")
    assert a == Availability(False, "FlashMLA needs a Hopper GPU (SM 9.x); this one is SM 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    a = triton_runtime.hopper_installed(files, "no cuda", "FlashMLA", "vllm._flashmla_C")
    assert a.ok and a.device == "cuda" and a.reason.startswith("CUDA (SM 9.x); vllm._flashmla_C: ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert triton_runtime.hopper_installed(files, "no cuda", "FlashMLA", "x") == Availability(False, "no cuda")


@no_cuda
def test_the_call_is_built_as_forward_mqa_builds_it(mla):
    b = latent([(1, 70), (1, 3)], num_heads=8)
    d = make_batch_data(b)
    cs = materialize(b, d, LatentLayout(), b.seq_lens, Poison.NAN)
    t = StandInFlashMla()
    kw = t.build_call(b, d, cs).kwargs
    assert kw["q"].shape == (2, 1, 8, 576) and kw["k_cache"] is cs.key_cache and kw["k_cache"].shape[1:] == (64, 1, 576)
    assert kw["head_dim_v"] == 512 and kw["causal"] and kw["is_fp8_kvcache"] is False
    assert kw["softmax_scale"] == DEEPSEEK_SM_SCALE
    assert kw["block_table"].dtype == kw["cache_seqlens"].dtype == torch.int32
    assert type(kw["tile_scheduler_metadata"]).__name__ == "FlashMLASchedMeta"
    assert not kw["tile_scheduler_metadata"].have_initialized  # fresh: FlashMLA fills it on the first call
    assert t.build_call(b, d, cs).kwargs["tile_scheduler_metadata"] is not kw["tile_scheduler_metadata"]
    with pytest.raises(ValueError, match="decode sequences only"):
        t.build_call(latent([(2, 5)]), d, cs)


@no_cuda
@pytest.mark.parametrize("dtype, num_heads", [("bfloat16", 16), ("float16", 1), ("bfloat16", 128)])
def test_the_backend_call_through_the_real_interface_agrees_with_the_reference(mla, dtype, num_heads):
    b = latent([(1, 130), (1, 0), (1, 64)], num_heads=num_heads, dtype=dtype, seed=3)
    run = check_example(StandInFlashMla(), Example(b, Poison.NAN))
    assert run.output.shape == (3, num_heads, 512)
    seen = hopper_standins.SEEN["mla"][-1]
    assert seen["q"].shape == (3, 1, num_heads, 576) and seen["head_size_v"] == 512


class WrongScale(StandInFlashMla):
    """A caller leaving ``softmax_scale`` to FlashMLA's default, ``1 / sqrt(576)``, instead of the model's."""

    name = "test.flashmla_default_scale"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        call.kwargs["softmax_scale"] = None
        return call


@no_cuda
def test_the_default_softmax_scale_is_a_kernel_mismatch(mla):
    b = latent([(1, 90)], num_heads=16, seed=3)
    with pytest.raises(KernelMismatch):
        check_example(WrongScale(), Example(b, Poison.NAN))


# ---- the guard -------------------------------------------------------------------------------------------------

def mla_kwargs(b, cached, poison=Poison.NAN):
    """forward_mqa's arguments without a scheduler object (the guard does not read it)."""
    d = make_batch_data(b)
    cs = materialize(b, d, LatentLayout(), cached, poison)
    q = d.query.view(b.num_seqs, -1, b.num_heads, 576)
    kw = dict(q=q, k_cache=cs.key_cache, block_table=b.block_table_tensor(), cache_seqlens=b.seq_lens_tensor(),
              head_dim_v=512, tile_scheduler_metadata=None, softmax_scale=b.scale, causal=True)
    return d, kw


def test_the_guard_reads_the_latent_call_and_catches_an_unwritten_decode_token():
    b = latent([(1, 70), (1, 3)], num_heads=8, dtype="float16")
    d, kw = mla_kwargs(b, b.seq_lens)
    key, value = d.new_kv(b)
    call = build_call("flash_mla_with_kvcache", kw, key, value)
    assert call.query.shape == (2, 8, 576) and call.query_start_loc.tolist() == [0, 1, 2]
    assert call.value_cache.shape[-1] == 512 and call.value_cache.data_ptr() == kw["k_cache"].data_ptr()
    assert check_kernel_call("flash_mla_with_kvcache", kw, key=key, value=value) == []
    d, kw = mla_kwargs(b, b.ctx_lens)
    vs = check_kernel_call("flash_mla_with_kvcache", kw, key=key, value=value)
    assert {v.check for v in vs} == {Check.UNIFIED}
    assert sorted((v.seq, v.position) for v in vs) == [(0, 70), (1, 3)]
    vs = check_kernel_call("flash_mla_with_kvcache", dict(kw, block_table=kw["block_table"].long()))
    assert Check.INDEX_DTYPE in {v.check for v in vs}


def test_the_guard_reads_spec_decode_queries_and_refuses_sparse_calls():
    """test_flashmla.py's ``s_q = 2``: two query rows per sequence, the last two of its cache_seqlens."""
    b = latent([(2, 40), (2, 7)], num_heads=4, dtype="float16")
    d = make_batch_data(b)
    cs = materialize(b, d, LatentLayout(), b.seq_lens, Poison.NAN)
    kw = dict(q=d.query.view(2, 2, 4, 576), k_cache=cs.key_cache, block_table=b.block_table_tensor(),
              cache_seqlens=b.seq_lens_tensor(), head_dim_v=512, tile_scheduler_metadata=None, causal=True)
    call = build_call("flash_mla_with_kvcache", kw)
    assert call.query.shape == (4, 4, 576) and call.query_start_loc.tolist() == [0, 2, 4]
    assert check_kernel_call("flash_mla_with_kvcache", kw) == []
    with pytest.raises(ValueError, match="sparse"):
        build_call("flash_mla_with_kvcache", dict(kw, indices=torch.zeros(2, 2, 64, dtype=torch.int32)))


def test_the_fp8_variant_reads_descale_k_as_the_cache_scale():
    b = latent([(1, 20)], num_heads=4, dtype="float16")
    _, kw = mla_kwargs(b, b.seq_lens)
    fp8 = dict(kw, k_cache=kw["k_cache"].to(torch.float8_e4m3fn), descale_k=torch.tensor([0.5]),
               descale_q=torch.tensor([1.0]), num_splits=None)
    call = build_call("flash_mla_with_kvcache_fp8", fp8)
    assert float(call.k_scale) == 0.5 and call.key_cache.dtype == torch.float8_e4m3fn


@no_cuda
def test_the_guard_wraps_flash_mla_with_kvcache_where_vllms_tests_import_it(mla, monkeypatch):
    """test_flashmla.py imports ``flash_mla_with_kvcache`` from vllm.v1.attention.ops.flashmla at import time."""
    upstream = types.ModuleType("kvfuzz_test_upstream_flashmla")
    upstream.flash_mla_with_kvcache = sys.modules["vllm.v1.attention.ops.flashmla"].flash_mla_with_kvcache
    monkeypatch.setitem(sys.modules, upstream.__name__, upstream)
    b = latent([(1, 70), (1, 3)], num_heads=8)
    for cached, fires in ((b.ctx_lens, True), (b.seq_lens, False)):
        d, kw = mla_kwargs(b, cached)
        kw["tile_scheduler_metadata"] = mla.get_mla_metadata()[0]
        key, value = d.new_kv(b)
        n_calls = len(hopper_standins.SEEN["mla"])
        with guard("raise") as g, g.new_kv(key, value):
            if fires:
                with pytest.raises(CallerContractError):
                    upstream.flash_mla_with_kvcache(**kw)
                assert len(hopper_standins.SEEN["mla"]) == n_calls  # stopped before the kernel ran
            else:
                out, _ = upstream.flash_mla_with_kvcache(**kw)
                assert g.records == [] and g.calls == {"flash_mla_with_kvcache": 1} and out.isfinite().all()


@no_cuda
def test_the_guard_checks_calls_made_under_the_callers_torch_defaults(mla):
    """test_flashmla.py sets torch's default device to the GPU and its default dtype to bf16 before its calls; the
    guard's checks then ran with bf16 sample positions (rounded past the end) and could not check a call (765
    on an H100). The checks keep CPU and float32; the caller's defaults are back afterwards. (The meta device
    stands in for the GPU here: a check tensor made there could not be read.)"""
    b = latent([(1, 70), (1, 3)], num_heads=8)
    d, kw = mla_kwargs(b, b.ctx_lens)
    kw["tile_scheduler_metadata"] = mla.get_mla_metadata()[0]
    key, value = d.new_kv(b)
    dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("meta"), guard("record") as g:
            g.report("flash_mla_with_kvcache", lambda: check_kernel_call(
                "flash_mla_with_kvcache", kw, key=key, value=value), "test")
            assert torch.get_default_dtype() == torch.bfloat16 and torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_dtype(dtype)
    assert not g.unchecked and g.calls == {"flash_mla_with_kvcache": 1}
    assert {v.check for r in g.records for v in r.violations} == {Check.UNIFIED}


@no_cuda
def test_the_gpu_smoke_script_passes_its_cases_through_the_stand_ins(mla, monkeypatch, capsys, tmp_path):
    """benchmarks/hopper_smoke.py (what benchmarks/gpu_hopper.sh runs first on an H100), its targets swapped for
    the stand-in ones: every fixed case is a valid example that passes."""
    import importlib.util
    import json

    from support import ROOT

    hopper_standins.install_fa3(monkeypatch)
    spec = importlib.util.spec_from_file_location("kvfuzz_hopper_smoke", ROOT / "benchmarks" / "hopper_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    stand_ins = {"vllm.flash_attn_varlen": StandInFA3(), "vllm.flashmla_decode": StandInFlashMla()}
    monkeypatch.setattr(smoke, "get_target", stand_ins.__getitem__)
    monkeypatch.setattr(sys, "argv", ["hopper_smoke.py", str(tmp_path / "smoke.json")])
    smoke.main()
    rows = json.loads((tmp_path / "smoke.json").read_text())
    assert len(rows) == sum(map(len, smoke.CASES.values())) and {r["verdict"] for r in rows} == {"pass"}, rows
    padded = [r["pad_rows"] for r in rows if "pad_rows" in r]  # the CUDA-graph padded cases (FA3: one fp8)
    expected = sum(b.num_pad_seqs > 0 for cases in smoke.CASES.values() for b in cases)
    assert expected == 5 and len(padded) == expected and all("finite True" in p for p in padded), padded
    assert capsys.readouterr().out.count("available") == 2


# ---- CUDA-graph padding (vLLM's FULL graphs: FlashMLAMetadataBuilder declares AttentionCGSupport.UNIFORM_BATCH) --

def test_the_target_declares_vllms_padding_and_draws_padded_decode_batches():
    from hypothesis import find, settings

    from kvfuzz.contracts.model.padding import padding
    from kvfuzz.strategies.batches import batches

    c = get_target(NAME).capabilities
    assert c.cuda_graph_padding == "vllm" and "cuda-graph padding (vllm)" in c.states
    assert FLASH_MLA_WITH_KVCACHE.declaration.empty_decode_rows
    assert FLASH_MLA_WITH_KVCACHE_FP8.declaration.empty_decode_rows
    b = find(batches(c), lambda b: b.num_pad_seqs > 0, settings=settings(max_examples=300, database=None))
    pad = padding(b, c.cuda_graph_padding)  # one query row of seq_len 0 per pad
    assert pad.seq_lens()[b.num_seqs:] == (0,) * b.num_pad_seqs
    assert pad.query_start_loc(row_per_seq=True)[-1] == b.num_tokens + b.num_pad_seqs


def padded_latent(pads=2, **kw):
    """Two decode sequences (block 0 unused: the null block) and ``pads`` CUDA-graph pads."""
    return latent([(1, 70), (1, 3)], num_heads=8, num_pad_seqs=pads, spare=1, reverse=True, **kw)


@no_cuda
def test_a_padded_batch_is_called_as_forward_mqa_calls_it_under_a_full_graph(mla):
    """One query row per pad (split_decodes_and_prefills counts the query_len-0 pads as decodes), cache_seqlens 0
    and a null-block row each, get_mla_metadata on the padded seq_lens; the stand-in writes zero pad rows and the
    real rows match the reference under every poison of the null block."""
    b = padded_latent(pads=2, seed=3)
    d = make_batch_data(b)
    cs = materialize(b, d, LatentLayout(), b.seq_lens, Poison.NAN)
    kw = StandInFlashMla().build_call(b, d, cs).kwargs
    assert kw["q"].shape == (4, 1, 8, 576) and torch.equal(kw["q"][:2].reshape(2, 8, 576), d.query)
    assert kw["cache_seqlens"].tolist() == [71, 4, 0, 0] and kw["block_table"][2:].eq(0).all()
    for poison in (Poison.NAN, Poison.INF):
        run = check_example(StandInFlashMla(), Example(b, poison))
        assert run.output.shape == (4, 8, 512) and not run.output[2:].any()
    assert hopper_standins.SEEN["mla"][-1]["seqlens_k"].tolist() == [71, 4, 0, 0]


class PadRowNaN(StandInFlashMla):
    """FlashMLA as if it divided an empty softmax sum for a seq_len-0 row (vllm#57017's defect, in this kernel)."""

    name = "test.flashmla_pad_nan"

    def run(self, call):
        out = super().run(call)
        out[call.kwargs["cache_seqlens"] == 0] = float("nan")
        return out


class RealSeqLenZero(StandInFlashMla):
    """A caller that hands a real sequence seq_len 0: a pad's value, on a row that is not a pad."""

    name = "test.flashmla_real_zero"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        call.kwargs["cache_seqlens"][0] = 0
        return call


@no_cuda
def test_the_pad_oracle_and_the_callers_checks_hold_for_flashmla(mla):
    from kvfuzz.contracts.checks.failures import CallerContractViolation, NonFiniteOutput

    b = padded_latent(pads=1)
    with pytest.raises(NonFiniteOutput, match="which is a pad row"):
        check_example(PadRowNaN(), Example(b, Poison.ZEROS))
    check_example(PadRowNaN(), Example(attrs.evolve(b, num_pad_seqs=0), Poison.ZEROS))  # no pad row: passes
    with pytest.raises(CallerContractViolation) as e:  # seq_len 0 is accepted on pad rows only
        check_example(RealSeqLenZero(), Example(b, Poison.ZEROS))
    assert e.value.check == Check.SEQ_LENS.value


@no_cuda
def test_the_guard_takes_a_seq_len_0_row_as_a_pad_and_still_catches_a_real_violation(mla):
    """``empty_decode_rows``: FlashMLA's call has no query_start_loc (row i is sequence i), so a pad is a query row
    of seq_len 0, which the guard accepts by the declaration and rejects without it; a real sequence whose new token
    is not in the cache is still a violation."""
    from kvfuzz.contracts.calls.call_checks import check_call

    b = padded_latent(pads=2, dtype="float16")
    d = make_batch_data(b)
    cs = materialize(b, d, LatentLayout(), b.seq_lens, Poison.NAN)
    kw = StandInFlashMla().build_call(b, d, cs).kwargs
    call = build_call("flash_mla_with_kvcache", kw)
    assert call.query_start_loc.tolist() == [0, 1, 2, 3, 4] and call.seq_lens.tolist() == [71, 4, 0, 0]
    assert not [v for v in check_call(call, vacuity=False) if v.is_error]
    strict = attrs.evolve(call, declaration=attrs.evolve(call.declaration, empty_decode_rows=False))
    found = [v for v in check_call(strict, vacuity=False) if v.is_error]
    assert [(v.check, v.seq) for v in found] == [(Check.SEQ_LEN_GE_QUERY_LEN, 2), (Check.SEQ_LEN_GE_QUERY_LEN, 3)]
    # vLLM's new tokens are num_tokens_padded rows (a pad token's own key too: a pad owns a query row here)
    key, value = (torch.cat([t, torch.zeros_like(t[:2])]) for t in d.new_kv(b))
    assert check_kernel_call("flash_mla_with_kvcache", kw, key=key, value=value) == []
    cs = materialize(b, d, LatentLayout(), b.ctx_lens, Poison.NAN)  # the new tokens not written
    kw = dict(kw, k_cache=cs.key_cache)
    vs = check_kernel_call("flash_mla_with_kvcache", kw, key=key, value=value)
    assert {v.check for v in vs} == {Check.UNIFIED}
    assert sorted((v.seq, v.position) for v in vs) == [(0, 70), (1, 3)]
