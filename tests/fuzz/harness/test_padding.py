"""The CUDA-graph padding state (kvfuzz.contracts.model.padding): the padded call as each engine builds it, the pad
oracles, planted pad defects found and shrunk by a default campaign, and the real kernels that declare the state."""

import tempfile
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis.database import InMemoryExampleDatabase
from support import SUPPORT, available

from kvfuzz import Batch, Example, Poison
from kvfuzz.contracts.checks.failures import KernelMismatch, NonFiniteOutput
from kvfuzz.contracts.checks.oracles import Oracle, check_cache_unchanged, check_pad_rows
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.padding import Padding, padding
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.engine import fuzz_target
from kvfuzz.fuzz.harness.properties import check_example
from kvfuzz.fuzz.targets import get_target
from kvfuzz.strategies.batches import batches

PLANTED = SUPPORT / "planted_padding.py"


def _decode_batch(pads=2, **kw):
    args = dict(query_lens=[1, 1], ctx_lens=[5, 20], num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                num_blocks=5, block_table=[[1, 2], [3, 4]], num_pad_seqs=pads, dtype="float32")
    return Batch(**{**args, **kw})


def test_vllm_pads_have_seq_len_0_query_len_0_and_the_null_block():
    pad = padding(_decode_batch(), "vllm")
    assert pad.seq_lens() == (6, 21, 0, 0)
    assert pad.query_start_loc() == (0, 1, 2, 2, 2)  # the last real value repeated
    assert pad.block_table()[2:] == ((0, 0), (0, 0))
    assert pad.num_rows == 4 and pad.query(torch.zeros(2, 4, 32)).shape == (4, 4, 32)


def test_sglang_pads_read_token_slot_0_once():
    pad = padding(_decode_batch(), "sglang")
    assert pad.seq_lens() == (6, 21, 1, 1) and pad.query_start_loc() == (0, 1, 2, 3, 4)
    indptr, indices = pad.token_slots(torch.tensor([0, 6, 27]), torch.arange(30))  # 3 csr_tail entries
    assert indptr.tolist() == [0, 6, 27, 28, 29]
    assert indices[27:29].tolist() == [0, 0] and indices[29:].tolist() == [27, 28, 29]


def test_no_pads_is_the_batch_itself_and_pads_need_a_convention():
    b = _decode_batch(pads=0)
    pad = padding(b, None)
    assert pad.seq_lens() == b.seq_lens and pad.query_start_loc() == b.query_start_loc
    with pytest.raises(ValueError, match="no padding convention"):
        padding(_decode_batch(), None)
    with pytest.raises(ValueError, match="unknown padding convention"):
        Padding(b, "trtllm")
    with pytest.raises(ValueError, match="num_pad_seqs must be >= 0"):
        _decode_batch(pads=-1)


def test_num_pad_seqs_round_trips_and_is_absent_from_unpadded_dicts():
    b = _decode_batch(pads=3)
    assert Batch.from_dict(b.to_dict()) == b and "cuda_graph_pads=3" in b.summary()
    assert "num_pad_seqs" not in _decode_batch(pads=0).to_dict()


def test_only_a_declaring_target_accepts_pads():
    caps = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float32",), head_sizes=(32,),
                        block_sizes=(16,))
    assert not caps.accepts(_decode_batch()) and "CUDA-graph pad sequences" in caps.outside(_decode_batch())
    padded = attrs.evolve(caps, cuda_graph_padding="vllm")
    assert padded.accepts(_decode_batch()) and padded.states[-1:] == ("cuda-graph padding (vllm)",)
    with pytest.raises(ValueError, match="unknown cuda_graph_padding"):
        attrs.evolve(caps, cuda_graph_padding="eager")


@settings(max_examples=60, deadline=None)
@given(batch=batches(get_target(f"{PLANTED}:PaddedTorch").capabilities))
def test_strategies_draw_pads_after_decode_batches_only(batch):
    assert 0 <= batch.num_pad_seqs <= 3
    assert not batch.num_pad_seqs or all(q == 1 for q in batch.query_lens)


@settings(max_examples=30, deadline=None)
@given(batch=batches(get_target("vllm.cpu_attention").capabilities))
def test_strategies_draw_no_pads_for_a_target_that_declares_none(batch):
    assert batch.num_pad_seqs == 0


def test_the_pad_oracle_names_the_pad_row_and_says_it_is_one():
    b = _decode_batch(pads=2)
    out = torch.zeros(4, 4, 32)
    assert check_pad_rows(b, out) is None
    out[3, 1, 5] = float("nan")
    fail = check_pad_rows(b, out)
    assert (fail.oracle, fail.token, fail.seq, fail.head, fail.dim) == (Oracle.PAD_FINITE, 3, 3, 1, 5)
    assert "output row 3, which is a pad row (pad sequence 3" in fail.message()
    out[0] = float("nan")  # a real row is not the pad oracle's: check_finite's
    assert check_pad_rows(b, out).token == 3


def test_a_changed_cache_is_found():
    before = torch.zeros(3, 16, 2, 8, dtype=torch.int16)
    after = before.clone()
    assert check_cache_unchanged(before, after) is None
    after[2, 5, 1, 3] = 1
    fail = check_cache_unchanged(before, after)
    assert (fail.oracle, fail.token, fail.position, fail.bad_rows) == (Oracle.PAD_WRITES, 2, 5, 1)


def test_the_correct_kernel_passes_with_pads_under_every_poison():
    t = get_target(f"{PLANTED}:PaddedTorch")
    for poison in Poison:
        run = check_example(t, Example(_decode_batch(pads=3), poison))
        assert run.output.shape[0] == 5 and torch.equal(run.output[2:], torch.zeros(3, 4, 32))


def test_nan_in_a_pad_row_fails_and_real_rows_still_pass():
    with pytest.raises(NonFiniteOutput, match="which is a pad row") as e:
        check_example(get_target(f"{PLANTED}:PadRowNaN"), Example(_decode_batch(pads=1), Poison.ZEROS))
    assert e.value.check == Oracle.PAD_FINITE.value and e.value.details["oracle"]["token"] == 2
    check_example(get_target(f"{PLANTED}:PadRowNaN"), Example(_decode_batch(pads=0), Poison.ZEROS))


def _campaign(name, max_examples=300):
    config = CampaignConfig(out=Path(tempfile.mkdtemp()), max_examples=max_examples, seed=0,
                            database=InMemoryExampleDatabase(), stop_at_first_failure=True)
    return fuzz_target(get_target(f"{PLANTED}:{name}"), config)


def test_a_default_campaign_finds_a_nan_pad_row_and_shrinks_it_to_one_sequence_and_one_pad():
    stats = _campaign("PadRowNaN")
    (record,) = stats.failures.values()
    batch = Example.from_dict(record.example).batch
    assert record.check == Oracle.PAD_FINITE.value
    assert (batch.num_seqs, batch.num_pad_seqs) == (1, 1)
    assert "output row 1, which is a pad row (pad sequence 1" in record.message


def test_a_default_campaign_finds_real_rows_wrong_only_with_pads():
    stats = _campaign("LastSeqTakesTrailingRows")
    assert stats.failures
    for record in stats.failures.values():  # a wrong real row (a mismatch, or NaN where it attends to nothing)
        batch = Example.from_dict(record.example).batch
        assert batch.num_pad_seqs >= 1 and record.check != Oracle.PAD_FINITE.value
        with pytest.raises((KernelMismatch, NonFiniteOutput)):
            check_example(get_target(f"{PLANTED}:LastSeqTakesTrailingRows"), Example(batch, Poison.ZEROS))
        check_example(get_target(f"{PLANTED}:LastSeqTakesTrailingRows"),
                      Example(attrs.evolve(batch, num_pad_seqs=0), Poison.ZEROS))  # right without the pads


def test_the_correct_kernel_passes_a_default_campaign():
    stats = _campaign("PaddedTorch", max_examples=100)
    assert stats.examples == 100 and not stats.failures


@pytest.mark.parametrize("name", ["vllm.unified_attention", "sglang.decode_attention_fwd"])
def test_the_real_kernels_keep_real_rows_and_pad_rows_finite(name):
    """Interpreted Triton on CPU: a hand-written padded decode batch, its null block / slot 0 poisoned or not."""
    available(name)
    t = get_target(name)
    for table, poison in (([[1, 2], [3, 4]], Poison.NAN), ([[1, 2], [3, 0]], Poison.INF)):
        run = check_example(t, Example(_decode_batch(pads=3, block_table=table), poison))
        assert run.output.shape[0] == 5 and bool(torch.isfinite(run.output[2:]).all())


def test_vllm_decode_attention_fwd_pads_as_triton_mla_and_a_pad_row_is_nan_vllm_57017():
    """vLLM's TRITON_MLA pads FULL-graph decode batches with seq_len-0, null-block rows, one query row each
    (forward_mqa); decode_attention_fwd's stage 2 divides an empty softmax sum there (vllm#57017, live upstream).
    The call carries the pads; the guard takes a seq_len-0 row of this decode kernel as a pad, not a caller bug;
    the pad-row oracle fails on the kernel, whatever the poison; the real rows and the unpadded batch pass; the
    shipped baseline knows it only while the batch without pads passes."""
    from support import ROOT

    from kvfuzz.fuzz.campaign.store.baseline import classify, load_baseline

    name = "vllm.decode_attention_fwd"
    available(name)
    t = get_target(name)
    mla = get_target("vllm.triton_mla_decode")
    assert t.capabilities.cuda_graph_padding == "vllm" == mla.capabilities.cuda_graph_padding
    b = _decode_batch(pads=2, dtype="float16")
    example = Example(b, Poison.ZEROS)
    with pytest.raises(NonFiniteOutput) as info:
        check_example(t, example)
    f = info.value
    assert f.check == Oracle.PAD_FINITE.value and "which is a pad row" in str(f)
    assert classify(load_baseline(ROOT / "kvfuzz-baseline.toml"), t, example, f) == "vllm-57017-decode"
    check_example(t, Example(attrs.evolve(b, num_pad_seqs=0), Poison.NAN))
    # the guard: the padded call's seq_len-0 rows are pads by the declaration, and a caller bug without it
    from kvfuzz.contracts.calls.call_checks import check_call
    from kvfuzz.contracts.checks.violations import Check
    from kvfuzz.fuzz.harness.attention import prepare
    from kvfuzz.fuzz.harness.caller import checked_signature

    call = checked_signature(t).build_call(prepare(t, example).call.kwargs)
    assert call.declaration.empty_decode_rows and not [v for v in check_call(call, vacuity=False) if v.is_error]
    strict = attrs.evolve(call, declaration=attrs.evolve(call.declaration, empty_decode_rows=False))
    found = [v for v in check_call(strict, vacuity=False) if v.is_error]
    assert [(v.check, v.seq) for v in found] == [(Check.SEQ_LEN_GE_QUERY_LEN, 2), (Check.SEQ_LEN_GE_QUERY_LEN, 3)]


def test_the_relations_check_a_padded_example_without_its_pads():
    from kvfuzz.fuzz.harness.relations import RELATIONS

    t = get_target(f"{PLANTED}:PadRowNaN")  # NaN in pad rows: no relation sees them
    for name in ("batch-order", "block-relocation", "determinism"):
        RELATIONS[name].check(t, Example(_decode_batch(pads=2), Poison.NAN))


def test_a_padded_call_that_writes_the_null_block_is_found():
    with pytest.raises(KernelMismatch, match="changed the paged cache") as e:
        check_example(get_target(f"{PLANTED}:PadWritesNullBlock"), Example(_decode_batch(pads=1), Poison.ZEROS))
    assert e.value.check == Oracle.PAD_WRITES.value and e.value.details["oracle"]["token"] == 0  # block 0
    check_example(get_target(f"{PLANTED}:PadWritesNullBlock"), Example(_decode_batch(pads=0), Poison.ZEROS))


def test_a_changed_big_cache_is_found_by_its_block_digests(monkeypatch):
    import kvfuzz.contracts.checks.oracles as oracles

    monkeypatch.setattr(oracles, "DIGEST_SLICE_ELEMENTS", 3 * 16 * 2 * 8)  # three blocks a slice: several slices
    kv = torch.randn(7, 2, 16, 2, 8, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    # [blocks, k/v, slots, heads, dim]: v is not contiguous
    for cache in (kv[:, 0], kv[:, 1], kv[:, 1].to(torch.float8_e4m3fn), kv[:, 0].float()):
        before = oracles.block_digests(cache)
        assert before.shape == (7,) and oracles.check_cache_digests(before, cache) is None
        after = cache.clone()
        after[5, 3, 1, 2] = 100.0  # no randn value (1.5 was one in 1 of ~30 unseeded fp8 draws: a flaky test)
        fail = oracles.check_cache_digests(before, after)
        assert (fail.oracle, fail.token, fail.bad_rows, fail.bad_elements) == (Oracle.PAD_WRITES, 5, 1, -1)
        assert "1 blocks, first block 5" in fail.message() and "digests" in fail.message()
        swapped = cache.clone()  # two elements of one block exchanged: the weights tell them apart
        swapped[4, 0, 0, 0], swapped[4, 0, 0, 1] = cache[4, 0, 0, 1], cache[4, 0, 0, 0]
        if not torch.equal(swapped.view(torch.uint8), cache.view(torch.uint8)):
            assert oracles.check_cache_digests(before, swapped).token == 4


def test_a_padded_big_cache_call_that_writes_the_null_block_is_found_without_a_copy(monkeypatch):
    import kvfuzz.fuzz.harness.padding as padding_harness

    monkeypatch.setattr(padding_harness, "is_big", lambda k, v: True)  # the snapshot of a big-cache example
    with pytest.raises(KernelMismatch, match="changed the paged cache: 1 blocks, first block 0") as e:
        check_example(get_target(f"{PLANTED}:PadWritesNullBlock"), Example(_decode_batch(pads=1), Poison.ZEROS))
    assert e.value.check == Oracle.PAD_WRITES.value
    check_example(get_target(f"{PLANTED}:PaddedTorch"), Example(_decode_batch(pads=2), Poison.NAN))
