"""The counter-based generator (contracts/model/counter_rng.py) and make_batch_data drawn with it: a known-answer
test against an independent pure-Python implementation of the documented construction, its distribution (the
Irwin–Hall distribution of 4 uniforms, scaled to unit variance), streams and seeds, and the guarantees
make_batch_data keeps (fp8 exactness, the ValueError, chunking and device independence on the CPU). The CPU/GPU
equality itself is in tests/contracts/test_counter_rng_cuda.py (CUDA only)."""

import math
import struct

import attrs
import pytest
import torch

from kvfuzz.contracts.model import counter_rng
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import make_batch_data

M32, M64 = 0xFFFFFFFF, (1 << 64) - 1


# ---- the oracle: the module docstring's construction in Python integers ----------------------------------------
def oracle_keys(seed):
    z = (seed + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return z & M32, z >> 32


def lowbias32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def signed(w, bits=32):
    return w - (1 << bits) if w >= 1 << (bits - 1) else w


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def oracle_words(seed, stream, index):
    k0, k1 = oracle_keys(seed & M64)
    c = stream * 2**28 + index
    return lowbias32(c ^ k0), lowbias32(c ^ k1)


def oracle_normal(seed, stream, index):
    x0, x1 = ((signed(w) >> 10) + (w & 0x3FF) * 4096 for w in oracle_words(seed, stream, index))  # >>: floor
    z = x0 - x1
    return f32(f32(z) * f32(math.sqrt(3) * 2**-22))  # z and the scale are exact in float32, their product rounds once


def test_the_first_outputs_are_the_documented_construction():
    for seed, stream in ((0, counter_rng.QUERY), (12345, counter_rng.KEYS), (2**31 - 1, counter_rng.VALUES),
                         (-7, counter_rng.SINKS), (2**70 + 3, 15)):
        got = counter_rng.normal(seed, [(stream, 64)]).tolist()
        assert got == [oracle_normal(seed, stream, j) for j in range(64)], (seed, stream)


def test_the_known_answer_test_fails_on_a_planted_change(monkeypatch):
    """Every constant the oracle checks: a different one gives different numbers."""
    want = [oracle_normal(5, 1, j) for j in range(32)]
    assert counter_rng.normal(5, [(1, 32)]).tolist() == want
    for name, value in (("_M1", counter_rng._int32(0x7FEB352F)), ("_M2", counter_rng._int32(0x846CA68D)),
                        ("SCALE", counter_rng.SCALE * (1 + 2**-20))):
        with monkeypatch.context() as m:
            m.setattr(counter_rng, name, value)
            m.setattr(counter_rng, "_CONSTANTS", {})
            assert counter_rng.normal(5, [(1, 32)]).tolist() != want, name
    with monkeypatch.context() as m:
        m.setattr(counter_rng, "keys", lambda seed: (counter_rng._int32(oracle_keys(seed + 1)[0]), 0))
        assert counter_rng.normal(5, [(1, 32)]).tolist() != want


def test_streams_are_laid_end_to_end_and_chunking_changes_nothing(monkeypatch):
    counts = [(counter_rng.QUERY, 1000), (counter_rng.KEYS, 70_000), (counter_rng.VALUES, 70_000),
              (counter_rng.SINKS, 3)]
    whole = counter_rng.normal(9, counts)
    parts = whole.split([n for _, n in counts])
    for (s, n), p in zip(counts, parts):  # each stream alone draws the same numbers
        assert torch.equal(p, counter_rng.normal(9, [(s, n)]))
    assert [p.item() for p in parts[1][[0, 65535, 65536, 69_999]]] == [oracle_normal(9, 1, j)
                                                                      for j in (0, 65535, 65536, 69_999)]
    monkeypatch.setattr(counter_rng, "CHUNK", 777)  # chunks that split streams at odd places
    assert torch.equal(counter_rng.normal(9, counts), whole)


def test_the_distribution_is_irwin_hall_of_four_with_unit_variance():
    n = 1 << 18
    x = counter_rng.normal(2024, [(counter_rng.KEYS, n)]).double()
    assert abs(x.mean().item()) < 5 / math.sqrt(n)
    assert abs(x.var().item() - 1) < 0.015
    kurtosis = ((x - x.mean()) ** 4).mean().item() / x.var().item() ** 2
    assert abs(kurtosis - 2.7) < 0.05  # Irwin–Hall of 4: 3 - 6/(5*4); a normal's is 3
    assert x.abs().max().item() <= 2 * math.sqrt(3)
    # Kolmogorov–Smirnov distance to the Irwin–Hall CDF of s = x / sqrt(3) + 2 on [0, 4]
    s = (x / math.sqrt(3) + 2).sort().values

    def cdf(t):
        return sum((-1) ** k * math.comb(4, k) * torch.clamp(t - k, min=0) ** 4 for k in range(5)) / 24

    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = torch.maximum(i / n - cdf(s), cdf(s) - (i - 1) / n).max().item()
    assert d < 1.63 / math.sqrt(n)  # 99% KS critical value
    # neighbours are uncorrelated, and so are the two halves of a word
    assert abs(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1].item()) < 5 / math.sqrt(n)


def test_the_resolution_is_fine_no_coarse_lattice():
    """Values lie on a lattice of step sqrt(3) * 2**-22 and fill it: no coarser grid, few repeats."""
    n = 1 << 16
    x = counter_rng.normal(77, [(counter_rng.QUERY, n)]).double()
    step = math.sqrt(3) * 2**-22
    units = x / step
    # on the lattice, but for the product's one float32 rounding (half an ulp of x, relative 2**-24)
    assert bool(((units - units.round()).abs() <= units.abs() * 2**-23).all())
    odd = (units.round().long() % 2 == 1).double().mean().item()
    assert 0.45 < odd < 0.55  # both parities: a lattice of step 2 (a dropped low bit) would show 0 or 1
    assert x.unique().numel() > n - 400  # ~260 repeats expected by chance on 2**24 points at these densities
    words = counter_rng.normal(77, [(counter_rng.QUERY, 4096)])
    assert words.unique().numel() >= 4096 - 3


def test_streams_and_seeds_differ():
    a = counter_rng.normal(1, [(counter_rng.KEYS, 4096)])
    for seed, stream in ((1, counter_rng.VALUES), (2, counter_rng.KEYS), (1 + 2**32, counter_rng.KEYS)):
        other = counter_rng.normal(seed, [(stream, 4096)])
        assert (a != other).float().mean() > 0.99
        assert abs(torch.corrcoef(torch.stack([a, other]))[0, 1].item()) < 0.08
    assert torch.equal(a, counter_rng.normal(1, [(counter_rng.KEYS, 4096)]))  # and the same seed repeats


def test_many_seeds_keep_no_memory_per_seed(monkeypatch):
    """A campaign draws a new seed per example: the constants cache holds the construction's fixed constants,
    not a seed's keys (it had grown by two 0-dim tensors a seed, ~0.9 KiB, without bound)."""
    monkeypatch.setattr(counter_rng, "_CONSTANTS", {})
    counter_rng.normal(0, [(counter_rng.KEYS, 8)])
    counter_rng.below(0, counter_rng.DOMINANT, torch.ones(4, dtype=torch.int64))
    fixed = len(counter_rng._CONSTANTS)
    assert 0 < fixed <= 16
    for seed in range(1, 2001):
        counter_rng.normal(seed, [(counter_rng.KEYS, 8)])
        counter_rng.below(seed, counter_rng.DOMINANT, torch.ones(4, dtype=torch.int64))
    assert len(counter_rng._CONSTANTS) == fixed


def test_below_draws_uniform_integers_under_each_bound():
    bounds = torch.tensor([1, 2, 7, 1000, 2**31] * 400, dtype=torch.int64)
    got = counter_rng.below(3, counter_rng.DOMINANT, bounds)
    assert got.dtype == torch.int64 and bool(((got >= 0) & (got < bounds)).all())
    want = [((oracle_words(3, counter_rng.DOMINANT, j)[0] & 0x7FFFFFFF) * int(b)) >> 31
            for j, b in enumerate(bounds.tolist())]
    assert got.tolist() == want
    assert got[bounds == 2].float().mean().item() == pytest.approx(0.5, abs=0.08)
    assert counter_rng.below(3, counter_rng.DOMINANT, torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_bad_streams_raise_before_allocating():
    with pytest.raises(ValueError, match="streams are 0..15"):
        counter_rng.normal(0, [(16, 4)])
    with pytest.raises(ValueError, match="at most"):
        counter_rng.normal(0, [(0, 2**28 + 1)])


# ---- make_batch_data ---------------------------------------------------------------------------------------------
def shared_batch(**kw) -> Batch:
    """Sequence 1 shares sequence 0's first two blocks; sequence 2 shares one (as tests/contracts/test_csr.py)."""
    return Batch(**{**dict(query_lens=[3, 1, 2], ctx_lens=[40, 33, 20], num_heads=2, num_kv_heads=1, head_size=32,
                           block_size=16, num_blocks=12, block_table=[[0, 1, 2, 0], [0, 1, 3, 0], [0, 4, 0, 0]],
                           seed=5), **kw})


def test_make_batch_data_draws_each_tensor_from_its_stream(make_batch):
    b = make_batch([(3, 5), (1, 9)], num_heads=4, num_kv_heads=2, head_size=8, seed=31)
    d = make_batch_data(b)
    nkv = sum(b.seq_lens) * 2 * 8
    assert torch.equal(d.keys.flatten(), counter_rng.normal(31, [(counter_rng.KEYS, nkv)]))
    assert torch.equal(d.values.flatten(), counter_rng.normal(31, [(counter_rng.VALUES, nkv)]))
    assert torch.equal(d.query.flatten(), counter_rng.normal(31, [(counter_rng.QUERY, 4 * 4 * 8)]))
    more_queries = make_batch_data(make_batch([(3, 5), (4, 6)], num_heads=4, num_kv_heads=2, head_size=8, seed=31))
    assert torch.equal(more_queries.keys, d.keys)  # the keys do not depend on how many queries there are
    s = make_batch_data(attrs.evolve(b, sinks=True)).sinks
    assert s.dtype == torch.float32 and torch.equal(s, 2 * counter_rng.normal(31, [(counter_rng.SINKS, 4)]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_make_batch_data_is_the_same_on_cpu_whatever_the_chunk(dtype, monkeypatch):
    b = shared_batch(dtype=dtype, value_range="dominant", sinks=True)
    d = make_batch_data(b)
    monkeypatch.setattr(counter_rng, "CHUNK", 1000)
    e = make_batch_data(b, "cpu")
    for f in attrs.fields(type(d)):
        assert torch.equal(getattr(d, f.name), getattr(e, f.name)), f.name
    assert d.query.dtype == d.keys.dtype == d.values.dtype == b.torch_dtype and d.keys.device.type == "cpu"


def test_value_ranges_shape_the_draw():
    b = shared_batch()
    normal, large = make_batch_data(b), make_batch_data(attrs.evolve(b, value_range="large"))
    assert torch.equal(large.keys, 4 * normal.keys) and torch.equal(large.query, 4 * normal.query)
    equal = make_batch_data(attrs.evolve(b, value_range="equal"))
    for i, (s, n) in enumerate(zip(b.seq_start_loc, b.seq_lens)):
        assert bool((equal.keys[s:s + n] == equal.keys[s]).all()), i
    dom = make_batch_data(attrs.evolve(b, value_range="dominant"))
    changed = (dom.keys != normal.keys).flatten(1).any(1)
    starts = torch.tensor(b.seq_start_loc[:-1])
    at = starts + counter_rng.below(b.seed, counter_rng.DOMINANT, torch.tensor(b.seq_lens))
    dst, src = b.shared_prefix_rows()
    want = torch.zeros(len(changed), dtype=torch.bool)
    want[at] = True
    want[dst] = want[src]  # a dominant position in a shared block is shared
    assert torch.equal(changed, want)
    assert torch.equal(dom.keys[changed], 16 * normal.keys[changed])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_extreme_values_are_the_normal_draw_times_64_finite_with_scores_of_thousands(dtype):
    """"extreme": queries and keys x64 exactly (a power of two: the same bits on every device), values as drawn;
    every product q_i k_i within fp16's range, the scaled scores' standard deviation ~4096 and the largest past
    1e4; the same bits on a second draw."""
    from kvfuzz.contracts.model.space import EXTREME_FACTOR

    b = shared_batch(dtype=dtype, num_heads=4, num_kv_heads=2)
    normal, ext = make_batch_data(b), make_batch_data(attrs.evolve(b, value_range="extreme"))
    assert EXTREME_FACTOR == 64.0
    assert torch.equal(ext.query, (64 * normal.query.float()).to(b.torch_dtype))
    assert torch.equal(ext.keys, (64 * normal.keys.float()).to(b.torch_dtype))
    assert torch.equal(ext.values, normal.values)
    assert all(bool(torch.isfinite(x).all()) for x in (ext.query, ext.keys, ext.values))
    assert float(ext.query.abs().max()) * float(ext.keys.abs().max()) <= torch.finfo(torch.float16).max
    s = torch.einsum("qhd,khd->qhk", ext.query.double()[:3], ext.keys.double()[:43].repeat_interleave(2, 1))
    s = s * b.scale
    assert 3000 < float(s.std()) < 5500 and float(s.abs().max()) > 1e4
    again = make_batch_data(attrs.evolve(b, value_range="extreme"))
    assert all(torch.equal(getattr(ext, f), getattr(again, f)) for f in ("query", "keys", "values"))


@pytest.mark.parametrize("dtype,kv,scale", [("float16", "auto", 1.0), ("bfloat16", "auto", 1.0),
                                            ("float32", "fp8_e4m3", 0.5), ("float16", "fp8_e5m2", 2.0)])
def test_shifted_values_lower_every_logit_of_a_row_by_the_same_amount(dtype, kv, scale):
    """"shifted": the query's last dimension a power of two Q, every key's -128 (exact in every dtype and fp8
    through these scales), the rest the normal draw: every scaled logit past -34,657 (flashinfer#4401's sentinel)
    and at least 40,000 below its normal value, the same shift for every key of a row (softmax unchanged)."""
    from kvfuzz.contracts.model.data import shifted_query

    b = shared_batch(dtype=dtype, num_heads=4, num_kv_heads=2, kv_cache_dtype=kv, k_scale=scale)
    sb = attrs.evolve(b, value_range="shifted")
    normal, sh = make_batch_data(b), make_batch_data(sb)
    q = shifted_query(sb)
    assert math.log2(q) == int(math.log2(q)) and 40000 <= q * 128 * sb.scale < 80000
    assert torch.equal(sh.query[..., :-1], normal.query[..., :-1]) and bool((sh.query[..., -1] == q).all())
    assert torch.equal(sh.keys[..., :-1], normal.keys[..., :-1]) and bool((sh.keys[..., -1] == -128).all())
    s = torch.einsum("qhd,khd->qhk", sh.query.double()[:3], sh.keys.double()[:43].repeat_interleave(2, 1))
    rest = torch.einsum("qhd,khd->qhk", sh.query.double()[:3, :, :-1],
                        sh.keys.double()[:43, :, :-1].repeat_interleave(2, 1))
    assert float(s.max() * b.scale) < -34657
    assert torch.allclose(s - rest, torch.full_like(s, -128 * q))  # one shift for every key of a row


def test_extreme_values_saturate_an_fp8_e4m3_cache():
    """Keys x64 over k_scale 3/64 pass e4m3's largest value 448: the codes saturate there (vLLM's
    scaled_fp8_quant clamps), and the logical keys are still exactly the dequantized codes."""
    b = shared_batch(dtype="float16", kv_cache_dtype="fp8_e4m3", k_scale=3 / 64, value_range="extreme")
    d = make_batch_data(b)
    codes = d.cache_keys.float()
    assert bool((codes.abs() == 448).any()) and float(codes.abs().max()) == 448
    assert torch.equal((codes * b.k_scale).to(torch.float16), d.keys)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_keys_are_the_exact_dequantized_codes(kv):
    b = shared_batch(dtype="bfloat16", kv_cache_dtype=kv, k_scale=3 / 64, v_scale=0.375, value_range="large")
    d = make_batch_data(b)
    assert d.cache_keys.dtype == b.fp8_dtype
    assert torch.equal((d.cache_keys.float() * b.k_scale).to(torch.bfloat16), d.keys)
    assert torch.equal((d.cache_values.float() * b.v_scale).to(torch.bfloat16), d.values)
    plain = make_batch_data(attrs.evolve(b, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0))
    assert not torch.equal(d.keys, plain.keys)  # quantized: not the plain draw
    assert (d.keys.float() - plain.keys.float()).abs().max() < 0.3 * plain.keys.float().abs().max()


def test_a_scale_that_does_not_dequantize_exactly_raises():
    with pytest.raises(ValueError, match="not exact in torch.float16"):
        make_batch_data(shared_batch(dtype="float16", kv_cache_dtype="fp8_e4m3", k_scale=0.1))
