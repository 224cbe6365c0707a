"""The fp64 reference and its envelope (kvfuzz.contracts.checks.reference) against a slow oracle that computes
them one query token at a time over exactly the keys that token sees (a slice, no mask, no padding), from
the formulas of docs/tolerance.md written out again. Drawn batches mix decodes and prefills of very uneven
lengths (so the batched computation pads a lot), empty contexts, GQA ratios, every feature and fp8 scales,
under every chunk budget (kvfuzz.contracts.checks.reference_chunks: the CPU's, the GPU's, and budgets that
cut sequences into many blocks). Padding must not leak: poison in one sequence changes no other sequence's
rows. The layout covers every query row once, within its budget; the reference reads no device tensor back
to the host (it runs on the meta device)."""

import math
from unittest import mock

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import batch_of

import kvfuzz.contracts.checks.reference as reference
import kvfuzz.contracts.checks.reference_chunks as chunks
from kvfuzz.contracts.checks.reference import ENVELOPE_TERMS, FLASH_ATTENTION, Numerics, ulp
from kvfuzz.contracts.model.batch import VALUE_RANGES, Batch
from kvfuzz.contracts.model.data import BatchData, make_batch_data
from kvfuzz.strategies.batches import KV_SCALES, SOFTCAPS

F64 = torch.float64


def per_token(batch: Batch, data: BatchData,
              numerics: Numerics = FLASH_ATTENTION) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(reference, envelope terms)``, each fp64 ``[num_tokens, num_heads, head_size]`` on the CPU: query token
    ``j`` of sequence ``i`` (position ``p = ctx_len + j``) over its visible keys ``lo .. p`` only, query head
    ``h`` reading kv head ``h // gqa_ratio``; the envelope for a kernel of ``numerics``."""
    H, D, g, dt = batch.num_heads, batch.head_size, batch.gqa_ratio, batch.torch_dtype
    tiny, u = torch.finfo(dt).tiny, torch.finfo(dt).eps / 2
    query, keys, values = (x.cpu().to(F64) for x in (data.query, data.keys, data.values))
    kv_head = torch.arange(H) // g
    slopes = None if batch.alibi_slopes is None else torch.tensor(batch.alibi_slopes, dtype=F64)
    sink = None if data.sinks is None else data.sinks.cpu().to(F64)
    ref = torch.empty((batch.num_tokens, H, D), dtype=F64)
    terms = {name: torch.empty_like(ref) for name in ENVELOPE_TERMS}
    for i in range(batch.num_seqs):
        for j in range(batch.query_lens[i]):
            tok, p = batch.query_start_loc[i] + j, batch.ctx_lens[i] + j
            lo = 0 if batch.sliding_window is None else max(0, p - batch.sliding_window + 1)
            rows = slice(batch.seq_start_loc[i] + lo, batch.seq_start_loc[i] + p + 1)
            q, k, v = query[tok], keys[rows][:, kv_head], values[rows][:, kv_head]  # [H, D], [n, H, D]
            s = torch.einsum("hd,nhd->hn", q, k) * batch.scale
            if batch.softcap is not None:
                s = batch.softcap * torch.tanh(s / batch.softcap)
            if slopes is not None:
                s = s + slopes[:, None] * (torch.arange(lo, p + 1) - p).to(F64)[None, :]
            m = s.amax(-1) if sink is None else torch.maximum(s.amax(-1), sink)  # [H]
            e = torch.exp(s - m[:, None])
            total = e.sum(-1) if sink is None else e.sum(-1) + torch.exp(sink - m)
            pr = e / total[:, None]  # [H, n]
            o = torch.einsum("hn,nhd->hd", pr, v)
            ref[tok] = o
            # the envelope, docs/tolerance.md: ds in units of u32, then the five terms
            ds = reference.DOT_LAMBDA * math.sqrt(D) * batch.scale * torch.einsum("hd,nhd->hn", q.abs(), k.abs())
            ds = ds + reference.LOGIT_ULPS * s.abs()
            dm = reference.LOGIT_ULPS * m.abs()  # the row max's part of every ds_k
            if batch.softcap is not None:
                ds = ds + 2 * reference.SOFTCAP_ULPS * batch.softcap
                if numerics.tanh_approx:  # tanh.approx: a relative error on each capped logit and the row max
                    ds = ds + reference.TANH_APPROX_ULPS * s.abs()
                    dm = dm + reference.TANH_APPROX_ULPS * m.abs()
            pv = torch.einsum("hn,nhd->hd", pr.clamp_min(tiny), v.abs())
            row = (pr * ds).sum(-1) + dm * pr.sum(-1)  # what multiplies |o_d|
            if sink is not None:
                row = row + torch.exp(sink - m) / total * reference.LOGIT_ULPS * (sink.abs() + m.abs())
            logits = torch.einsum("hn,nhd->hd", pr * ds, v.abs()) + dm[:, None] * pv + row[:, None] * o.abs()
            t = {"probabilities": u * pv, "logits": reference.FP32_UNIT * logits,
                 "accumulation": reference.FP32_UNIT * (p - lo + 1 + 2) * (pv + o.abs())}
            y = o.abs() + t["probabilities"] + t["logits"] + t["accumulation"]
            if numerics.v_scale_after_output and batch.fp8_dtype is not None and batch.v_scale != 1.0:
                # rounded in the value codes' units, then times v_scale in fp32 and rounded again
                first = batch.v_scale * 0.5 * ulp(y / batch.v_scale, dt)
                first = first + 2 * reference.FP32_UNIT * (y + first)
                t["output"] = first + 0.5 * ulp(y + first, dt)
            else:
                t["output"] = 0.5 * ulp(y, dt)
            t["underflow"] = reference.FP32_TINY * (2 * v.abs().sum(0) + 2 * (p - lo + 1) + 1)
            for name in ENVELOPE_TERMS:
                terms[name][tok] = t[name]
    return ref, terms


@st.composite
def ragged_batches(draw) -> Batch:
    """Up to 6 sequences, each a decode, a short prefill or a long one (contexts 0 .. 300): padding to the
    longest sequence is up to ~100x the real work."""
    lens = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["decode", "prefill", "long"]))
        q = 1 if kind == "decode" else draw(st.integers(1, 24))
        lens.append((q, draw(st.integers(0, 300 if kind == "long" else 12))))
    hkv, g = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4]))
    kv_cache_dtype = draw(st.sampled_from(["auto", "fp8_e4m3", "fp8_e5m2"]))
    scales = {} if kv_cache_dtype == "auto" else {"k_scale": draw(st.sampled_from(KV_SCALES)),
                                                   "v_scale": draw(st.sampled_from(KV_SCALES))}
    return batch_of(lens, num_heads=hkv * g, num_kv_heads=hkv, head_size=draw(st.sampled_from([8, 16, 64])),
                    dtype=draw(st.sampled_from(["float16", "bfloat16", "float32"])), kv_cache_dtype=kv_cache_dtype,
                    sliding_window=draw(st.none() | st.integers(1, 40)), alibi=draw(st.booleans()),
                    sinks=draw(st.booleans()), softcap=draw(st.none() | st.sampled_from(SOFTCAPS)),
                    sm_scale=draw(st.none() | st.sampled_from([1.0, 0.3])),
                    value_range=draw(st.sampled_from(VALUE_RANGES)), seed=draw(st.integers(0, 2**16)), **scales)


def assert_matches(batch: Batch, data: BatchData, expect: tuple[torch.Tensor, dict[str, torch.Tensor]],
                   numerics: Numerics = FLASH_ATTENTION) -> None:
    """The module's reference, envelope and terms (for ``numerics``) equal ``expect`` to fp64 rounding: relative
    1e-12 (the reference also absolute 1e-12 of the largest |value|, as its sums cancel; the terms are sums of
    non-negative parts)."""
    ref_e, terms_e = expect
    ref, env = reference.reference_and_envelope(batch, data, numerics)
    terms = reference.envelope_terms(batch, data, numerics)
    shape = (batch.num_tokens, batch.num_heads, batch.head_size)
    for x in (ref, env, *terms.values()):
        assert x.shape == shape and x.dtype == F64 and x.device == data.query.device
    atol = 1e-12 * float(data.values.abs().max())
    torch.testing.assert_close(ref.cpu(), ref_e, rtol=1e-12, atol=atol)
    torch.testing.assert_close(reference.reference_attention(batch, data).cpu(), ref_e, rtol=1e-12, atol=atol)
    assert tuple(terms) == ENVELOPE_TERMS
    for name in ENVELOPE_TERMS:
        torch.testing.assert_close(terms[name].cpu(), terms_e[name], rtol=1e-12, atol=0, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(env.cpu(), sum(terms_e.values()), rtol=1e-12, atol=0)


#: Chunk budgets the batched reference is checked under (it uses chunks.CPU on the CPU): the CPU's and the GPU's,
#: none (no two blocks share a chunk, sequences cut into blocks of a few rows), and small chunks padded freely.
BUDGETS = {"cpu": chunks.CPU, "gpu": chunks.GPU, "none": chunks.Budget(1, 0),
           "small": chunks.Budget(2**11, 2**30)}


#: Every combination of the declared numerics' knobs (kvfuzz.contracts.checks.reference.Numerics).
NUMERICS = [Numerics(tanh_approx=t, v_scale_after_output=v) for t in (False, True) for v in (False, True)]


@settings(max_examples=100, deadline=None)
@given(ragged_batches(), st.sampled_from(sorted(BUDGETS)), st.sampled_from(NUMERICS))
def test_reference_and_envelope_equal_the_per_token_oracle(b, budget, numerics):
    d = make_batch_data(b)
    with mock.patch.object(chunks, "CPU", BUDGETS[budget]):
        assert_matches(b, d, per_token(b, d, numerics), numerics)


@settings(max_examples=100, deadline=None)
@given(ragged_batches(), st.sampled_from(sorted(BUDGETS)))
def test_layout_covers_every_query_row_once_within_its_budget(b, budget):
    """Blocks: consecutive rows of one sequence, in query order, each seeing exactly the key span of its rows
    (causal, the window). Chunks: within the budget unless one block, blocks in query order, and index
    tensors that say the same."""
    with mock.patch.object(chunks, "CPU", BUDGETS[budget]):
        layout = chunks.layout(b, torch.device("cpu"))
    blocks = [blk for c in layout for blk in c.blocks]
    assert sorted(blk.row0 for blk in blocks) == [blk.row0 for blk in chunks.blocks(b, BUDGETS[budget].elements)]
    rows = sorted(r for blk in blocks for r in range(blk.row0, blk.row0 + blk.rows))
    assert rows == list(range(b.num_tokens))
    for blk in blocks:
        i = max(i for i in range(b.num_seqs) if b.query_start_loc[i] <= blk.row0)
        assert blk.row0 + blk.rows <= b.query_start_loc[i + 1]  # one sequence
        assert blk.pos0 == b.ctx_lens[i] + blk.row0 - b.query_start_loc[i]
        first = blk.pos0 if b.sliding_window is None else blk.pos0 - b.sliding_window + 1  # its first row's
        assert blk.key0 == (0 if b.sliding_window is None else max(0, first))
        assert blk.key_row0 == b.seq_start_loc[i] + blk.key0 and blk.keys >= blk.rows
    for c in layout:
        assert [blk.row0 for blk in c.blocks] == sorted(blk.row0 for blk in c.blocks)
        assert c.whole == (len(layout) == 1)
        assert (c.rows, c.keys) == (max(x.rows for x in c.blocks), max(x.keys for x in c.blocks))
        if len(c.blocks) > 1:
            assert chunks.size(b, len(c.blocks), c.rows, c.keys) <= BUDGETS[budget].elements
            expect = [(j, t, blk.row0 + t) for j, blk in enumerate(c.blocks) for t in range(blk.rows)]
            assert list(zip(c.block.tolist(), c.row.tolist(), c.token.tolist())) == expect
            assert c.pos0.tolist() == [x.pos0 for x in c.blocks]
            assert c.last_key.tolist() == [x.keys - 1 for x in c.blocks]
        else:
            assert c.block is None and c.token is None


@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_runs_on_the_meta_device(budget):
    """On the meta device every op runs without data: ``.item()``, ``.tolist()`` or ``bool()`` of a device
    tensor (a host synchronization on CUDA) raises there, and so does mixing in a tensor made on the CPU. Torch's
    meta kernels import triton: on a machine without CUDA it comes up interpreted, as kvfuzz's Triton targets need
    it (imported plainly, a later Triton test in the same process could not run)."""
    from kvfuzz.fuzz.targets.triton_runtime import prepare_triton_runtime

    prepare_triton_runtime()
    b = batch_of([(1, 200), (12, 0), (1, 0), (3, 60)], num_heads=4, num_kv_heads=2, head_size=16,
                 sliding_window=9, alibi=True, sinks=True, softcap=4.0, seed=1)
    d = make_batch_data(b).to("meta")
    with mock.patch.object(chunks, "CPU", BUDGETS[budget]):
        ref, env = reference.reference_and_envelope(b, d)
        terms = reference.envelope_terms(b, d)
    for x in (ref, env, *terms.values()):
        assert x.device.type == "meta" and x.dtype == F64 and x.shape == (b.num_tokens, 4, 16)


@pytest.mark.parametrize("lens, kw", [
    ([(1, 0)], dict(num_heads=1, num_kv_heads=1)),  # one key
    ([(40, 0), (1, 0), (1, 300), (3, 1)], dict(num_heads=8, num_kv_heads=2, sliding_window=1, sinks=True)),
    ([(1, 250), (24, 0), (1, 0), (7, 90)], dict(num_heads=6, num_kv_heads=3, alibi=True, softcap=4.0,
                                               kv_cache_dtype="fp8_e4m3", k_scale=3 / 64, v_scale=2.0)),
    ([(5, 3), (1, 40), (17, 0)], dict(num_heads=4, num_kv_heads=1, sliding_window=7, dtype="bfloat16")),
])
@pytest.mark.parametrize("numerics", NUMERICS, ids=str)
def test_edges_equal_the_per_token_oracle(lens, kw, numerics):
    b = batch_of(lens, head_size=32, seed=3, **kw)
    d = make_batch_data(b)
    assert_matches(b, d, per_token(b, d, numerics), numerics)


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 6e4])
def test_padding_does_not_leak(poison, budget, monkeypatch):
    """Sequences of very different lengths, one of them (each in turn) filled with ``poison`` (queries, keys and
    values): every other sequence's reference and envelope are unchanged. A batched computation that read past
    a sequence's keys, or a padded row or key of another sequence, would carry the poison over."""
    monkeypatch.setattr(chunks, "CPU", BUDGETS[budget])
    b = batch_of([(1, 200), (12, 0), (1, 0), (3, 60), (1, 5)], num_heads=4, num_kv_heads=2, head_size=16,
                 dtype="float16", sinks=True, alibi=True, seed=5)
    clean = make_batch_data(b)
    ref, env = reference.reference_and_envelope(b, clean)
    assert torch.isfinite(ref).all() and torch.isfinite(env).all()
    for i in range(b.num_seqs):
        q0, q1, k0, k1 = b.query_start_loc[i], b.query_start_loc[i + 1], b.seq_start_loc[i], b.seq_start_loc[i + 1]
        d = attrs.evolve(clean, query=clean.query.clone(), keys=clean.keys.clone(), values=clean.values.clone())
        for x, (a, z) in ((d.query, (q0, q1)), (d.keys, (k0, k1)), (d.values, (k0, k1))):
            x[a:z] = poison
        r, e = reference.reference_and_envelope(b, d)
        others = torch.ones(b.num_tokens, dtype=torch.bool)
        others[q0:q1] = False
        torch.testing.assert_close(r[others], ref[others], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(e[others], env[others], rtol=1e-12, atol=0)
        assert not torch.equal(r[~others], ref[~others])  # the poison does reach its own sequence


def test_the_oracle_sees_a_window_that_is_one_key_off():
    """The comparison can fail: the same batch with the window one key wider or narrower differs from the
    oracle's answer (the off-by-one a mask can have)."""
    b = batch_of([(6, 20), (1, 33), (9, 0)], num_heads=4, num_kv_heads=2, head_size=16, sliding_window=5, seed=2)
    d = make_batch_data(b)
    expect = per_token(b, d)
    assert_matches(b, d, expect)
    for w in (4, 6):
        with pytest.raises(AssertionError):
            assert_matches(attrs.evolve(b, sliding_window=w), d, expect)
