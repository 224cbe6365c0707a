"""vLLM's TRITON_MLA decode (``decode_attention_fwd(..., is_mla=True)`` over the 576/512 latent cache) as the
target ``vllm.triton_mla_decode``: the latent model (Batch.value_head_size, LatentLayout, the fp64 reference with
the value a prefix of the key row), the guard's reading of the latent call, the real interpreted kernel against
the reference, two planted broken callers caught, and a short property run."""

import json
import math

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from support import ROOT, available, batch_of, kvfuzz

from kvfuzz.contracts.caches.layouts import LatentLayout, LayoutError
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.failures import CallerContractViolation, KernelMismatch
from kvfuzz.contracts.checks.invariants import UNIFIED
from kvfuzz.contracts.checks.reference import reference_attention
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.guard.signatures import build_call
from kvfuzz.fuzz.harness.attention import check_example
from kvfuzz.fuzz.targets.registry import get_target, registered
from kvfuzz.fuzz.targets.vllm_mla import DEEPSEEK_SM_SCALE, VllmTritonMlaDecode
from kvfuzz.strategies.batches import examples
from kvfuzz.strategies.limits import Limits

NAME = "vllm.triton_mla_decode"


def latent(lens, *, num_heads=16, dtype="float32", **kw):
    """A small latent (576/512) decode batch with DeepSeek's softmax scale."""
    return batch_of(lens, num_heads=num_heads, num_kv_heads=1, head_size=576, value_head_size=512, dtype=dtype,
                    sm_scale=DEEPSEEK_SM_SCALE, **kw)


# ---- the latent model (no kernel runs) ------------------------------------------------------------------

def test_the_target_is_registered_and_declares_the_backends_latent_decode():
    assert NAME in registered()
    c = get_target(NAME).capabilities
    assert c.contract is Contract.UNIFIED and c.decode_only
    assert (c.head_sizes, c.value_head_size) == ((576,), 512)
    assert all(bs % 16 == 0 for bs in c.block_sizes)  # TritonMLABackend.supports_block_size
    assert set(c.kv_cache_dtypes) == {"auto", "fp8", "fp8_e4m3"} and not c.features
    assert "bfloat16" not in c.dtypes or not VllmTritonMlaDecode().interpreted


def test_a_latent_batch_is_validated():
    b = latent([(1, 5)])
    assert b.head_size_v == 512 and b.to_dict()["value_head_size"] == 512
    assert "value_head_size" not in attrs.evolve(b, value_head_size=None).to_dict()  # old dicts unchanged
    with pytest.raises(ValueError, match="value_head_size 576 must be in"):
        attrs.evolve(b, value_head_size=576)
    with pytest.raises(ValueError, match="needs num_kv_heads == 1"):
        attrs.evolve(b, num_kv_heads=2)
    with pytest.raises(ValueError, match="one fp8 scale"):
        attrs.evolve(b, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=1.0)
    c = VllmTritonMlaDecode.capabilities
    assert c.accepts(b)
    assert c.outside(attrs.evolve(b, value_head_size=None)) == ["values of their own (a latent-cache kernel)"]


def test_the_values_are_the_key_rows_first_dims_in_data_and_cache():
    for kw in ({}, dict(kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.5, dtype="float16")):
        b = latent([(1, 20), (1, 3)], num_heads=2, **kw)
        d = make_batch_data(b)
        assert d.values.shape == (25, 1, 512) and torch.equal(d.values, d.keys[..., :512])
        assert torch.equal(d.cache_values.float(), d.cache_keys[..., :512].float())
        cs = materialize(b, d, LatentLayout(), b.seq_lens, Poison.NAN)
        assert cs.key_cache.shape == (b.num_blocks, 16, 1, 576) and cs.value_cache.shape[-1] == 512
        assert cs.value_cache.data_ptr() == cs.key_cache.data_ptr()  # one buffer
        k, v = cs.layout.gather(cs.key_cache, cs.value_cache, cs.written_slots)
        assert torch.equal(k.float(), d.cache_keys.float()) and torch.equal(v, k[..., :512])
    with pytest.raises(LayoutError):
        LatentLayout().allocate(attrs.evolve(b, value_head_size=None))


def test_the_reference_attends_over_the_latent_rows_with_the_query_in_the_latent_space():
    b = latent([(1, 20), (1, 0), (1, 33)], num_heads=4)
    d = make_batch_data(b)
    ref = reference_attention(b, d)
    assert ref.shape == (3, 4, 512)
    for i, s0 in enumerate(b.seq_start_loc[:-1]):  # naive: softmax(scale * q.K^T) @ K[:, :512]
        k = d.keys[s0 : s0 + b.seq_lens[i], 0].double()
        p = torch.softmax(d.query[i].double() @ k.T * DEEPSEEK_SM_SCALE, dim=-1)
        torch.testing.assert_close(ref[i], p @ k[:, :512], rtol=1e-12, atol=1e-12)


def test_the_guard_reads_the_values_where_the_mla_kernel_does():
    b = latent([(1, 20), (1, 3)], num_heads=4)
    d = make_batch_data(b)
    cs = materialize(b, d, LatentLayout(), b.seq_lens, Poison.NAN)
    kw = VllmTritonMlaDecode().build_call(b, d, cs).kwargs
    call = build_call("decode_attention_fwd", kw)
    assert call.value_cache.shape[-1] == 512 and call.value_cache.data_ptr() == kw["k_buffer"].data_ptr()
    assert "is_mla" in call.name("value_cache")
    # is_mla with a v_buffer that is not the key row's prefix: the kernel ignores it; the guard checks k_buffer
    other = dict(kw, v_buffer=torch.zeros_like(kw["v_buffer"]))
    assert build_call("decode_attention_fwd", other).value_cache.data_ptr() == kw["k_buffer"].data_ptr()
    # without is_mla the kernel reads v_buffer, and so does the guard
    plain = build_call("decode_attention_fwd", dict(other, is_mla=False))
    assert plain.value_cache is other["v_buffer"]


def test_strategies_draw_latent_mqa_batches_and_undeclared_ones_keep_the_latent_row():
    from hypothesis import strategies as st

    from kvfuzz.strategies.batches import undeclared_examples

    caps = VllmTritonMlaDecode.capabilities
    limits = Limits(max_num_seqs=2, max_ctx_len=20, max_num_heads=16)

    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(examples(caps, limits), undeclared_examples(caps, ("float32",), limits)))
    def prop(example):
        b = example.batch
        assert (b.num_kv_heads, b.head_size, b.value_head_size) == (1, 576, 512) and b.v_scale == b.k_scale
        assert all(q == 1 for q in b.query_lens)

    prop()


# ---- the real kernel, interpreted ---------------------------------------------------------------------------

@pytest.mark.kernel
@pytest.mark.parametrize("dtype, kv_cache_dtype, num_heads, block_size", [
    ("float32", "auto", 16, 16),     # the grouped MLA kernel, 4 splits (two empty for seq_len 2)
    ("float16", "fp8_e4m3", 8, 32),  # fp8 latent cache dequantized with k_scale
    ("float32", "auto", 1, 64),      # one head: decode_attention_fwd takes the MHA kernel (reads v_buffer)
])
def test_the_kernel_agrees_with_the_reference(dtype, kv_cache_dtype, num_heads, block_size):
    t = available(NAME)
    fp8 = dict(k_scale=0.5, v_scale=0.5) if kv_cache_dtype != "auto" else {}
    b = latent([(1, 40), (1, 1)], num_heads=num_heads, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
               block_size=block_size, seed=7, **fp8)
    run = check_example(t, Example(b, Poison.NAN))
    assert run.output.shape == (2, num_heads, 512)
    assert run.path == ("normal" if num_heads == 1 else "grouped,mla") + ",splits=4"


class WrongScale(VllmTritonMlaDecode):
    """A caller that passes ``1 / sqrt(576)`` (the latent row's width) instead of the model's scale."""

    name = "test.mla_wrong_scale"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        call.kwargs["sm_scale"] = 1.0 / math.sqrt(batch.head_size)
        return call


class WrongValueSlice(VllmTritonMlaDecode):
    """A caller that hands the kernel the row's last 512 dims as values and drops ``is_mla`` (so the kernel reads
    ``v_buffer``): ``k_pe`` leaks into the value."""

    name = "test.mla_wrong_value_slice"

    def build_call(self, batch, data, cache):
        call = super().build_call(batch, data, cache)
        call.kwargs["v_buffer"] = cache.key_cache[..., -batch.head_size_v:]
        call.kwargs["is_mla"] = False
        return call


@pytest.mark.kernel
def test_the_wrong_softmax_scale_is_a_kernel_mismatch():
    available(NAME)
    b = latent([(1, 30)], num_heads=16, seed=3)
    with pytest.raises(KernelMismatch) as info:
        check_example(WrongScale(), Example(b, Poison.NAN))
    assert info.value.kind.blame == "kernel"


@pytest.mark.kernel
def test_values_from_the_wrong_slice_of_the_row_are_caught_before_the_mismatch():
    """The guard reads the value cache the kernel reads (``v_buffer`` without ``is_mla``): its new token's value
    is not the row's last 512 dims, so the unified invariant blames the caller; the kernel's output, computed
    anyway, disagrees with the reference."""
    available(NAME)
    b = latent([(1, 30)], num_heads=16, seed=3)
    with pytest.raises(CallerContractViolation) as info:
        check_example(WrongValueSlice(), Example(b, Poison.NAN))
    f = info.value
    assert f.check == UNIFIED.value and "value" in str(f) and f.details["kernel"]["outcome"] == "mismatch"


@pytest.mark.kernel
def test_a_short_property_run_passes():
    """What ``kvfuzz fuzz --target vllm.triton_mla_decode`` checks, in process: examples drawn from the
    declaration (576/512, MQA, decode only), few and small (each interpreted call takes about a second)."""
    t = available(NAME)
    limits = Limits(max_num_seqs=2, max_ctx_len=40, max_num_heads=16, max_spare_blocks=1)

    @settings(max_examples=6, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(examples(t.gate_capabilities(), limits))  # no CUDA-graph pads: live vllm#57017 (test_padding.py)
    def prop(example):
        b = example.batch
        assert (b.num_kv_heads, b.head_size, b.head_size_v) == (1, 576, 512)
        check_example(t, example)

    prop()


@pytest.mark.kernel
def test_kvfuzz_targets_lists_it_and_a_cli_campaign_passes(tmp_path):
    rows = {row["name"]: row for row in json.loads(kvfuzz("targets", "--json").stdout)}
    row = rows[NAME]
    assert row["head_sizes"] == [576] and "latent: values = keys[:512]" in row["contract"]
    assert row["reason"]
    if not row["available"]:
        pytest.skip(f"{NAME} unavailable: {row['reason']}")
    r = kvfuzz("fuzz", "--target", NAME, "--max-examples", "4", "--workers", "1", "--seed", "1",
               "--out", tmp_path, "--baseline", ROOT / "kvfuzz-baseline.toml")  # live vllm#57017 is known
    assert r.returncode == 0, r.stdout + r.stderr
    (stats,) = json.loads((tmp_path / "summary.json").read_text())["targets"]
    assert stats["target"] == NAME and stats["examples"] == 4, stats
    assert all(f["known"] for f in stats["failures"]), stats["failures"]
