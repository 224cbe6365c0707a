"""Cache-writer targets (vllm.reshape_and_cache, vllm.cpu_reshape_and_cache) and their property
(kvfuzz.fuzz.harness.writer): the real kernels pass, deliberately broken writers are caught by the right
check, reproducers are written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support import available

from kvfuzz.contracts.caches.cpu_layout import CpuAttnLayout
from kvfuzz.contracts.caches.layouts import NHDLayout
from kvfuzz.contracts.caches.materialize import materialize
from kvfuzz.contracts.checks.failures import KernelCrash, KernelMismatch
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.data import make_batch_data
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.contracts.model.writer import writer_inputs
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.campaign.store.reproducers import write_reproducer
from kvfuzz.fuzz.harness import properties
from kvfuzz.fuzz.harness.writer import SLOT_CONTENTS, UNTOUCHED, _storage_elements, slot_element_offsets
from kvfuzz.fuzz.targets.cache_writers import VllmCpuReshapeAndCache, VllmReshapeAndCacheFlash
from kvfuzz.strategies import Limits

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("one_torch_thread")]

TARGETS = [VllmReshapeAndCacheFlash, VllmCpuReshapeAndCache]




def mixed_batch(dtype="float16", seed=0, head_size=64, block_size=16) -> Batch:
    """Prefill with context, decode, prefill without context; permuted blocks; block 7 is spare (the last
    block of the cache, owned by no sequence)."""
    return Batch(query_lens=[5, 1, 17], ctx_lens=[3, 20, 0], num_heads=4, num_kv_heads=2, head_size=head_size,
                 block_size=block_size, num_blocks=8, block_table=[[5, 0, 4], [1, 3, 4], [6, 2, 4]], dtype=dtype,
                 seed=seed)


def seed_with_padding(min_pad=1) -> int:
    """A batch seed whose writer call has at least ``min_pad`` padding rows (slot -1)."""
    for s in range(100):
        b = mixed_batch(seed=s)
        if writer_inputs(b, make_batch_data(b)).num_padding >= min_pad:
            return s
    raise AssertionError("no seed with padding")


# ---- the writer inputs and the slot -> element map -------------------------------------------------------
def test_writer_inputs_insert_padding_rows_with_slot_minus_one():
    counts = set()
    for s in range(20):
        b = mixed_batch(seed=s)
        data = make_batch_data(b)
        inp = writer_inputs(b, data)
        pad = inp.token < 0
        counts.add(inp.num_padding)
        assert (inp.slot_mapping[pad] == -1).all() and inp.slot_mapping.dtype == torch.int64
        key, value = data.new_kv(b)
        assert torch.equal(inp.key[~pad], key) and torch.equal(inp.value[~pad], value)
        assert torch.equal(inp.slot_mapping[~pad], b.slot_mapping())
        assert torch.equal(inp.token[~pad], torch.arange(b.num_tokens))
        again = writer_inputs(b, data)
        assert torch.equal(again.slot_mapping, inp.slot_mapping) and torch.equal(again.key, inp.key)
    assert counts == {0, 1, 2, 3}


def test_slot_element_offsets_nhd_multi_digit():
    """fp16 probes are int16: a cache larger than 2**15 elements needs two probe digits."""
    kc_full = torch.empty((10, 32, 2, 256), dtype=torch.float16)
    assert kc_full.numel() > 2**15
    kc, vc = kc_full[1:9], kc_full.clone()[1:9]
    slots = torch.tensor([0, 5, 77, 255])
    k_off, v_off = slot_element_offsets(NHDLayout(), kc, vc, slots)
    blk, off = slots // 32, slots % 32
    h, d = torch.arange(2), torch.arange(256)
    exp = (kc.storage_offset() + blk[:, None, None] * kc.stride(0) + off[:, None, None] * kc.stride(1)
           + h[None, :, None] * kc.stride(2) + d[None, None, :])
    assert torch.equal(k_off, exp) and torch.equal(v_off, exp)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slot_element_offsets_cpu_layout_agree_with_the_op(dtype):
    t = available(VllmCpuReshapeAndCache)
    b = mixed_batch(dtype=dtype)
    layout = t.layout(b)
    data = make_batch_data(b)
    cache = materialize(b, data, layout, b.seq_lens, Poison.ZEROS)
    slots = b.slot_mapping()
    k_off, v_off = slot_element_offsets(layout, cache.key_cache, cache.value_cache, slots)
    store = _storage_elements(cache.key_cache)  # key and value caches share one storage
    key, value = data.new_kv(b)
    assert torch.equal(store[k_off], key) and torch.equal(store[v_off], value)
    assert isinstance(layout, CpuAttnLayout)


# ---- the real kernels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", TARGETS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_real_writer_keeps_the_writer_contract(cls, dtype):
    t = available(cls)
    if dtype not in t.capabilities.dtypes:
        pytest.skip(f"{cls.name} does not declare {dtype} here")
    seed = seed_with_padding(2)
    for poison in (Poison.NAN, Poison.STALE):
        run = properties.check(t, Example(mixed_batch(dtype=dtype, seed=seed), poison))
        assert run.call.kwargs["_inputs"].num_padding >= 2
        assert run.output.shape == run.reference.shape and run.output.shape[0] == 2  # key, value caches
        assert torch.equal(run.output.view(torch.uint8), run.reference.view(torch.uint8))


def test_triton_writer_wide_rows_take_several_tiles():
    t = available(VllmReshapeAndCacheFlash)
    b = Batch(query_lens=[3, 1], ctx_lens=[0, 9], num_heads=8, num_kv_heads=4, head_size=256, block_size=16,
              num_blocks=3, block_table=[[2], [0]], dtype="float32", seed=seed_with_padding())
    run = properties.check(t, Example(b, Poison.NAN))
    assert run.path.endswith("2 tiles/row")  # Hkv * D = 1024 > 512: tile_i > 0 is exercised


# ---- deliberately broken writers ---------------------------------------------------------------------
def _slot_kw(call) -> str:
    return "slot_mapping_ptr" if "slot_mapping_ptr" in call.kwargs else "slot_mapping"


def broken(cls, how):
    """A subclass of a real writer target that breaks the contract in one way."""

    class Broken(cls):
        name = f"{cls.name}.broken_{how}"

        def run(self, call):
            kw, inp = _slot_kw(call), call.kwargs["_inputs"]
            sm = call.kwargs[kw].clone()
            kc = call.key_cache  # NHD [NB, BS, Hkv, D]; CPU layout [NB, Hkv, BS, D]
            nslots = kc.shape[0] * (kc.shape[1] if isinstance(call.layout, NHDLayout) else kc.shape[2])
            if how == "shift":  # every token one slot late
                call.kwargs[kw] = torch.where(sm >= 0, sm + 1, sm)
            elif how == "drop":  # the last real token is not written
                sm[int(torch.nonzero(sm >= 0)[-1])] = -1
                call.kwargs[kw] = sm
            elif how == "pad-to-last":  # slot -1 taken Python-style: the cache's last slot
                call.kwargs[kw] = torch.where(sm < 0, nslots - 1, sm)
            elif how == "raise":
                raise RuntimeError("broken writer")
            out = super().run(call)
            if how == "pad-before-start":  # slot -1 taken C-style: the row just before the cache
                st, row = _storage_elements(call.key_cache), call.key_cache.shape[-1]
                start = call.key_cache.storage_offset()
                st[start - row : start] = inp.key[inp.token < 0][0, 0]
            elif how == "clobber-context":  # a padding row also lands on slot 0 of sequence 0's context
                ctx_slot = torch.tensor([self._ctx_slot])
                call.layout.write(call.key_cache, call.value_cache, ctx_slot, inp.key[inp.token < 0][:1],
                                  inp.value[inp.token < 0][:1])
            return out

    Broken.__name__ = f"Broken{cls.__name__}_{how}"
    return Broken


@pytest.mark.parametrize("cls", TARGETS)
@pytest.mark.parametrize("how, check, where", [
    ("shift", SLOT_CONTENTS, "belongs to no sequence"),
    ("drop", SLOT_CONTENTS, None),
    ("pad-to-last", UNTOUCHED, "slot 127 (block 7) belongs to no sequence"),
    ("pad-before-start", UNTOUCHED, "before the cache"),
    ("clobber-context", UNTOUCHED, "a context position: sequence 0 position 0"),
])
def test_broken_writer_is_caught(cls, how, check, where):
    available(cls)
    t = broken(cls, how)()
    b = mixed_batch(dtype="float32", seed=seed_with_padding())
    t._ctx_slot = int(b.slots(torch.tensor([0]), torch.tensor([0]))[0])
    with pytest.raises(KernelMismatch) as info:
        properties.check(t, Example(b, Poison.ZEROS))
    f = info.value
    assert f.check == check and f.kind.blame == "kernel", f.message
    if check == SLOT_CONTENTS:
        c = f.details["slot_contents"]
        if how == "drop":
            assert c["bad_tokens"] == 1 and c["token"] == b.num_tokens - 1 and c["seq"] == 2
            assert f.details["untouched"] is None
        else:  # every token moved: the first one is reported, and the slots it wrongly wrote
            assert c["bad_tokens"] == b.num_tokens and (c["seq"], c["position"]) == (0, 3)
            assert c["slot"] == int(b.slot_mapping()[0]) and c["block"] == 5
            assert where in f.details["untouched"]["place"]
    else:
        assert where in f.details["untouched"]["place"], f.message
        assert f.details["untouched"]["changed_elements"] > 0


@pytest.mark.parametrize("cls", TARGETS)
def test_raising_writer_is_a_kernel_crash(cls):
    available(cls)
    with pytest.raises(KernelCrash) as info:
        properties.check(broken(cls, "raise")(), Example(mixed_batch(dtype="float32"), Poison.NAN))
    assert "broken writer" in info.value.message


def test_reproducer_of_a_writer_finding(tmp_path):
    t = broken(VllmCpuReshapeAndCache, "drop")()
    available(VllmCpuReshapeAndCache)
    example = Example(mixed_batch(dtype="bfloat16", seed=seed_with_padding()), Poison.NAN)
    run = properties.prepare(t, example)
    with pytest.raises(KernelMismatch) as info:
        properties.check(t, example, run=run)
    d = write_reproducer(tmp_path, t, example, info.value, run)
    case = json.loads((d / "case.json").read_text())
    assert case["check"] == SLOT_CONTENTS and case["details"]["slot_contents"]["bad_tokens"] == 1
    tensors = load_file(str(d / "tensors.safetensors"))
    assert {"key", "value", "key_cache", "value_cache", "output", "reference"} <= set(tensors)
    assert tensors["output"].shape == tensors["reference"].shape
    assert not torch.equal(tensors["output"].view(torch.int16), tensors["reference"].view(torch.int16))
    d2 = write_reproducer(tmp_path / "norun", t, example, info.value, None)  # crash-journal path: no run
    assert "key_cache" in load_file(str(d2 / "tensors.safetensors"))


# ---- short campaigns stay quiet on the real kernels ------------------------------------------------------
@pytest.mark.parametrize("cls, n", [(VllmReshapeAndCacheFlash, 8), (VllmCpuReshapeAndCache, 20)])
def test_short_campaign_on_real_writers(tmp_path, cls, n):
    t = available(cls)
    cfg = CampaignConfig(out=tmp_path, max_examples=n, seed=3, limits=Limits(max_num_seqs=3, max_ctx_len=40,
                                                                               max_query_len=12))
    stats = fuzz_target(t, cfg)
    assert stats.failures == {}, [f.message for f in stats.failures.values()]
    assert stats.examples == n
