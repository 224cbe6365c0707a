"""What each kernel needs of its caller, declared as data (kvfuzz.contracts.calls.declaration, next to the signatures
in kvfuzz.fuzz.guard.signatures), and the guard's errors-versus-warnings rule that reads it (issue 19).

The false-positive patterns of vLLM's own kernel tests, reproduced on CPU with the real kernels (Triton's
interpreter): int64 ``req_to_token``/``b_seq_len`` into ``decode_attention_fwd``, key and value head sizes
that differ (MLA), random shared block tables in a read-only unified call, ``max_seq_len`` passed as the longest
context to ``context_attention_fwd``. Each is checked twice: the guard accepts the call (no error; the right
warning, with its category), and the kernel really computes the right thing on that path (it agrees with the
int32 call, or with an fp64 reference) — the claim the declaration makes. The true positives stay errors.
"""

import math

import pytest
import torch
from support import available

from kvfuzz.contracts.caches.layouts import NHDLayout, VllmPagedLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.calls.declaration import KernelDeclaration, KernelPath
from kvfuzz.contracts.checks.violations import Category, Check, Severity, violation
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.guard import KvfuzzGuardWarning, guard
from kvfuzz.fuzz.guard.signatures import SIGNATURES, check_kernel_call


def _errors(vs):
    return [v for v in vs if v.is_error]


def _warnings(vs):
    return {(v.check, v.category) for v in vs if not v.is_error}


# ---- the declarations themselves ------------------------------------------------------------------------
def test_every_signature_declares_its_paths_with_sources():
    for name, sig in SIGNATURES.items():
        decl = sig.declaration
        assert any(p.taken_on is None for p in decl.paths), name
        assert all(p.source for p in decl.paths), name
    assert SIGNATURES["decode_attention_fwd"].declaration.value_head_size_may_differ
    assert not SIGNATURES["unified_attention"].declaration.value_head_size_may_differ
    assert not any(sig.declaration.writes_cache for sig in SIGNATURES.values())  # attention kernels only read


def test_a_declaration_rejects_what_it_cannot_mean():
    with pytest.raises(ValueError, match="reads"):
        KernelPath("p", reads=frozenset({"max_seqlen"}))
    with pytest.raises(ValueError, match="at least one path"):
        KernelDeclaration(paths=(KernelPath("rocm only", taken_on=lambda call, arch: (True, "")),))
    with pytest.raises(ValueError, match="needs a Category"):
        violation(Check.BLOCK_SHARING, "x", severity=Severity.WARNING)
    with pytest.raises(ValueError, match="needs a Category"):
        violation(Check.BLOCK_SHARING, "x", category=Category.REALISM)


# ---- decode_attention_fwd: int64 indices, MLA head sizes, random pools ----------------------------------
def _decode_call(*, index_dtype, d_qk=64, d_v=32, page_size=4, seed=0):
    """vLLM's test_triton_decode_attention.py pattern, small: pages drawn with torch.randint (sequences may
    share them), ``b_seq_len = torch.full(...)`` (int64), value head size != key head size."""
    g = torch.Generator().manual_seed(seed)
    b, h_q, h_kv, seq_len, cache_size, splits = 3, 4, 2, 21, 64, 4
    n_pages = -(-seq_len // page_size)
    req_to_page = torch.randint(0, cache_size // page_size, (b, n_pages), generator=g).to(index_dtype)
    q = torch.randn(b, h_q, d_qk, generator=g)
    k = torch.randn(cache_size // page_size, page_size, h_kv, d_qk, generator=g)
    v = torch.randn(cache_size // page_size, page_size, h_kv, d_v, generator=g)
    return dict(q=q, k_buffer=k, v_buffer=v, o=torch.zeros(b, h_q, d_v), lse=torch.zeros(b, h_q),
                req_to_token=req_to_page, b_seq_len=torch.full((b,), seq_len, dtype=index_dtype),
                attn_logits=torch.empty(b, h_q, splits, d_v + 1), num_kv_splits=splits,
                sm_scale=1 / math.sqrt(d_qk), page_size=page_size)


def _decode_reference(kw):
    """fp64 attention of each sequence's one query over its seq_len cached positions."""
    q, k, v = kw["q"].double(), kw["k_buffer"].double(), kw["v_buffer"].double()
    ps, out = kw["page_size"], []
    group = q.shape[1] // k.shape[2]
    for i, n in enumerate(kw["b_seq_len"].tolist()):
        pages = kw["req_to_token"][i].long()
        pos = torch.arange(n)
        ks, vs = k[pages[pos // ps], pos % ps], v[pages[pos // ps], pos % ps]  # [n, Hkv, D]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[i], ks) * kw["sm_scale"]
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vs))
    return torch.stack(out)


@pytest.mark.kernel
def test_decode_attention_fwd_with_int64_indices_and_mla_head_sizes_is_accepted_and_correct():
    available("vllm.decode_attention_fwd")
    from vllm.v1.attention.ops import triton_decode_attention as mod

    outs = {}
    for dt in (torch.int32, torch.int64):
        kw = _decode_call(index_dtype=dt)
        with guard("record") as g:
            mod.decode_attention_fwd(**kw)
        assert g.calls == {"decode_attention_fwd": 1}
        vs = [v for r in g.records for v in r.violations]
        assert _errors(vs) == [], [v.message for v in vs]
        outs[dt] = kw["o"]
        # the claim behind the declaration: the Triton kernel reads int64 indices and Lv != Lk correctly
        assert torch.allclose(kw["o"].double(), _decode_reference(kw), atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[torch.int32], outs[torch.int64])


def test_random_pools_sharing_pages_are_a_realism_warning_for_a_reader():
    kw = _decode_call(index_dtype=torch.int64)
    kw["req_to_token"][1, 5] = kw["req_to_token"][0, 5]  # two sequences' current tokens (position 20) in one page
    vs = check_kernel_call("decode_attention_fwd", kw)
    assert _errors(vs) == [] and (Check.BLOCK_SHARING, Category.REALISM) in _warnings(vs)
    share = next(v for v in vs if v.check is Check.BLOCK_SHARING)
    assert "block sharing warning (realism)" in share.message and "writes nothing" in share.message
    # the same state against a kernel that writes the cache: an error (each write clobbers the others')
    import attrs

    from kvfuzz.contracts.calls.call_checks import check_call
    from kvfuzz.fuzz.guard.signatures import build_call

    call = build_call("decode_attention_fwd", kw)
    call.declaration = attrs.evolve(call.declaration, writes_cache=True)
    errs = _errors(check_call(call))
    assert [v.check for v in errs] == [Check.BLOCK_SHARING] and "clobbers" in errs[0].message


def test_a_page_table_with_a_trailing_unit_dim_is_read_as_the_kernel_reads_it():
    """vLLM's test passes req_to_page of shape [B, pages, 1]: the kernel addresses row b at b * stride(0)."""
    kw = _decode_call(index_dtype=torch.int64)
    flat = check_kernel_call("decode_attention_fwd", kw)
    kw["req_to_token"] = kw["req_to_token"].unsqueeze(-1)
    assert check_kernel_call("decode_attention_fwd", kw) == flat and _errors(flat) == []
    kw["req_to_token"] = kw["req_to_token"].expand(-1, -1, 2)  # a real third dim: not a page table
    assert Check.SHAPES in {v.check for v in _errors(check_kernel_call("decode_attention_fwd", kw))}


def test_value_head_size_may_differ_only_where_declared():
    kw = _decode_call(index_dtype=torch.int32, d_qk=64, d_v=32)
    assert _errors(check_kernel_call("decode_attention_fwd", kw)) == []
    kw["k_buffer"] = kw["k_buffer"][..., :48]  # a key head size other than the query's: still an error
    assert {v.check for v in _errors(check_kernel_call("decode_attention_fwd", kw))} == {Check.SHAPES}


def _unified_args(b, d, cs, *, index_dtype=torch.int32):
    return dict(q=d.query, k=cs.key_cache, v=cs.value_cache, out=torch.full_like(d.query, 7.0),
                cu_seqlens_q=b.query_start_loc_tensor().to(index_dtype), max_seqlen_q=b.max_query_len,
                seqused_k=b.seq_lens_tensor().to(index_dtype), max_seqlen_k=b.max_seq_len, softmax_scale=b.scale,
                causal=True, window_size=(-1, -1), block_table=b.block_table_tensor().to(index_dtype), softcap=0,
                q_descale=None, k_descale=None, v_descale=None)


def test_unified_attention_rejects_a_value_head_size_it_does_not_take(make_batch):
    b = make_batch([(3, 5), (1, 9)], head_size=32)
    d = make_batch_data(b)
    cs = materialize(b, d, NHDLayout(), b.seq_lens, Poison.ZEROS)
    args = _unified_args(b, d, cs)
    args["v"] = torch.zeros(*cs.value_cache.shape[:3], 16)
    assert Check.SHAPES in {v.check for v in _errors(check_kernel_call("unified_attention", args))}


# ---- unified_attention: random shared block tables, int64 indices -----------------------------------------
@pytest.mark.kernel
def test_unified_attention_random_block_tables_and_int64_indices_pass_the_guard(make_batch):
    """vLLM's test_triton_unified_attention.py draws block tables with torch.randint (blocks shared between
    sequences); nothing is written in the call and the reference reads through the same table."""
    available("vllm.unified_attention")
    from vllm.v1.attention.ops import triton_unified_attention as mod

    b = make_batch([(3, 5), (2, 4), (2, 0)], head_size=32, block_size=4, spare=2)
    d = make_batch_data(b)
    cs = materialize(b, d, NHDLayout(), b.seq_lens, Poison.ZEROS)
    g = torch.Generator().manual_seed(3)
    table = torch.randint(0, b.num_blocks, b.block_table_tensor().shape, generator=g, dtype=torch.int32)
    table[1] = table[0]  # certainly shared: both write positions 4..7 of block table[0, 1]
    outs = []
    for dt in (torch.int32, torch.int64):
        args = _unified_args(b, d, cs, index_dtype=dt) | {"block_table": table.to(dt)}
        with guard("record") as gd:
            mod.unified_attention(**args)
        vs = [v for r in gd.records for v in r.violations]
        assert _errors(vs) == [], [v.message for v in vs]
        assert (Check.BLOCK_SHARING, Category.REALISM) in _warnings(vs)
        outs.append(args["out"])
    assert torch.equal(outs[0], outs[1]) and not (outs[0] == 7.0).all()


# ---- chunked_prefill_paged_decode / context_attention_fwd: paths, portability ------------------------------
def _split_kw(make_batch, *, head_size=64, dtype="float16"):
    from kvfuzz.fuzz.targets.vllm_triton import VllmChunkedPrefillPagedDecode

    b = make_batch([(5, 3), (1, 20), (4, 9)], dtype=dtype, head_size=head_size, block_size=16)
    d = make_batch_data(b)
    cs = materialize(b, d, VllmPagedLayout(), Contract.SPLIT.cached_lens(b), Poison.ZEROS)
    return b, VllmChunkedPrefillPagedDecode().build_call(b, d, cs).kwargs


def test_int64_indices_into_chunked_prefill_paged_decode_are_a_portability_warning_naming_the_rocm_path(make_batch):
    b, kw = _split_kw(make_batch)
    kw["block_table"] = kw["block_table"].long()
    vs = check_kernel_call("chunked_prefill_paged_decode", kw)
    assert _errors(vs) == []
    w = next(v for v in vs if v.check is Check.INDEX_DTYPE)
    assert w.category is Category.PORTABILITY
    assert "ROCm gfx90a, gfx942, gfx950" in w.message and "csrc/rocm/attention.cu" in w.message
    # on ROCm, where use_rocm_custom_paged_attention selects the custom kernel: an error
    errs = _errors(check_kernel_call("chunked_prefill_paged_decode", kw, rocm_arch="gfx942"))
    assert [v.check for v in errs] == [Check.INDEX_DTYPE] and "gfx942" in errs[0].message
    # a call the ROCm path would never take (head size 32 on CDNA, 128 needed on RDNA): nothing at all
    b, kw = _split_kw(make_batch, head_size=32)
    kw["block_table"] = kw["block_table"].long()
    assert [v for v in check_kernel_call("chunked_prefill_paged_decode", kw) if v.check is Check.INDEX_DTYPE] == []


def test_max_seq_len_is_judged_by_the_paths_that_read_it(make_batch):
    b, kw = _split_kw(make_batch)
    kw["max_seq_len"] = max(b.ctx_lens)  # the seeds: the longest context
    vs = check_kernel_call("chunked_prefill_paged_decode", kw)
    assert _errors(vs) == [] and (Check.MAX_SEQ_LEN, Category.PORTABILITY) in _warnings(vs)
    assert [v.check for v in _errors(check_kernel_call("chunked_prefill_paged_decode", kw, rocm_arch="gfx90a"))] \
        == [Check.MAX_SEQ_LEN]
    # context_attention_fwd normalizes max_seq_len and passes it to nothing: not reported
    args = dict(q=kw["query"], k=kw["key"], v=kw["value"], o=kw["output"], kv_cache_dtype="auto",
                k_cache=kw["key_cache"], v_cache=kw["value_cache"], b_loc=kw["block_table"].long(),
                b_start_loc=kw["query_start_loc"].long(), b_seq_len=kw["seq_lens"].long(),
                max_seq_len=max(b.ctx_lens), max_input_len=kw["max_query_len"], k_scale=kw["k_scale"],
                v_scale=kw["v_scale"])
    assert check_kernel_call("context_attention_fwd", args) == []
    # ... but max_input_len sizes its grid: understated, it is an error on every platform
    errs = _errors(check_kernel_call("context_attention_fwd", args | {"max_input_len": 2}))
    assert [v.check for v in errs] == [Check.MAX_QUERY_LEN] and "reads it" in errs[0].message


@pytest.mark.kernel
def test_int64_indices_give_context_attention_fwd_the_same_output(make_batch):
    available("vllm.context_attention_fwd")
    from vllm.v1.attention.ops import prefix_prefill as mod

    b, kw = _split_kw(make_batch, dtype="float32", head_size=32)
    outs = []
    for dt in (torch.int32, torch.int64):
        o = torch.full_like(kw["output"], 7.0)
        args = dict(q=kw["query"], k=kw["key"], v=kw["value"], o=o, kv_cache_dtype="auto",
                    k_cache=kw["key_cache"], v_cache=kw["value_cache"], b_loc=kw["block_table"].to(dt),
                    b_start_loc=kw["query_start_loc"].to(dt), b_seq_len=kw["seq_lens"].to(dt),
                    max_seq_len=max(b.ctx_lens), max_input_len=kw["max_query_len"], k_scale=kw["k_scale"],
                    v_scale=kw["v_scale"])
        with guard("raise") as g:
            mod.context_attention_fwd(**args)
        assert g.records == [] and g.calls == {"context_attention_fwd": 1}
        outs.append(o)
    assert torch.equal(outs[0], outs[1]) and not (outs[0] == 7.0).all()


def test_the_seeds_decode_invariant_stays_an_error(make_batch):
    from kvfuzz.fuzz.targets.vllm_triton import VllmChunkedPrefillPagedDecode

    b = make_batch([(5, 3), (1, 20)], dtype="float16", head_size=64, block_size=16)
    d = make_batch_data(b)
    cs = materialize(b, d, VllmPagedLayout(), tuple(b.ctx_lens), Poison.ZEROS)  # decode filled to ctx_len only
    kw = VllmChunkedPrefillPagedDecode().build_call(b, d, cs).kwargs
    errs = _errors(check_kernel_call("chunked_prefill_paged_decode", kw))
    assert [(v.check, v.seq, v.position) for v in errs] == [(Check.DECODE, 1, 20)]


def test_warnings_never_stop_the_kernel_and_carry_their_category(make_batch):
    """In mode "raise" a portability-only call is not stopped: it warns, naming the category."""
    b, kw = _split_kw(make_batch)
    kw["seq_lens"] = kw["seq_lens"].long()
    with guard("raise") as g, pytest.warns(KvfuzzGuardWarning, match=r"index tensor dtype warning \(portability\)"):
        g.check_call("chunked_prefill_paged_decode", kw, "test")
    assert g.stopped == 0 and g.records[0].errors == () and g.calls == {"chunked_prefill_paged_decode": 1}
    assert "index tensor dtype (warning, portability): 1" in g.summary()


def test_an_interleaved_value_cache_still_has_its_keys_checked(make_batch):
    """vLLM's test_prefix_prefill.py interleave_v cases: the value cache cannot be read through the layout,
    but the seeds' missing decode token is missing from the key cache too."""
    from kvfuzz.fuzz.targets.vllm_triton import VllmChunkedPrefillPagedDecode

    b = make_batch([(5, 3), (1, 20)], dtype="float16", head_size=64, block_size=16)
    d = make_batch_data(b)
    for cached, want in ((tuple(b.ctx_lens), [(Check.DECODE, 1, 20)]), (Contract.SPLIT.cached_lens(b), [])):
        cs = materialize(b, d, VllmPagedLayout(), cached, Poison.ZEROS)
        kw = VllmChunkedPrefillPagedDecode().build_call(b, d, cs).kwargs | {"use_interleaved_v_cache": True}
        kw["value_cache"] = torch.zeros_like(kw["value_cache"])  # unreadable as laid out: not judged
        vs = check_kernel_call("chunked_prefill_paged_decode", kw)
        assert [(v.check, v.seq, v.position) for v in _errors(vs)] == want
        assert all(v.check is not Check.VACUITY or "the key" in v.message for v in vs)
