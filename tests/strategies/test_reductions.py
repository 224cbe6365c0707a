"""The structural shrink: its moves (kvfuzz.strategies.reductions) and its loop (kvfuzz.fuzz.campaign.reduce),
on their own and inside a campaign."""

import tempfile
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis.database import InMemoryExampleDatabase
from support import available

from kvfuzz.contracts.checks.failures import Finding, KernelMismatch
from kvfuzz.contracts.checks.oracles import Oracle
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.mutants import OFFSET_BITS, get_mutant, smallest_trigger
from kvfuzz.fuzz.bench.paged_torch import small_batch as _batch
from kvfuzz.fuzz.campaign import engine
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.records import Quiet, TargetStats
from kvfuzz.fuzz.campaign.reduce import reduce_failure
from kvfuzz.fuzz.harness import properties
from kvfuzz.strategies.batches import batches
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.reductions import coarse_reductions, max_num_blocks, reductions, reexpress, size_key

CAPS = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float16", "float32"),
                    head_sizes=(24, 32, 64, 256), block_sizes=(8, 16, 32), kv_cache_dtypes=("auto", "fp8_e4m3"),
                    fp8_head_sizes=(64, 256), features=("sliding_window", "alibi"))
# CSR metadata and shared prefix blocks: the tail's slots and shared rows must survive every move
CSR_CAPS = attrs.evolve(CAPS, contract=Contract.PREFIX, metadata="csr", shared_prefix_blocks=True)
LIMITS = Limits()


def _offsets(batch: Batch) -> list[int]:
    """Element offset of every used block, in table order."""
    stride = batch.block_size * batch.num_kv_heads * batch.head_size
    return [b * stride for i, row in enumerate(batch.block_table) for b in row[: batch.blocks_needed(i)]]


@settings(max_examples=150, deadline=None)
@given(batches(CAPS, LIMITS))
def test_every_candidate_is_a_smaller_batch_inside_the_declaration(batch):
    _check_candidates(batch, CAPS)


@settings(max_examples=100, deadline=None)
@given(batches(CSR_CAPS, LIMITS))
def test_candidates_keep_csr_tails_and_shared_prefixes_valid(batch):
    for cand in _check_candidates(batch, CSR_CAPS):
        slots = cand.num_blocks * cand.block_size
        assert all(v == -1 or 0 <= v <= slots for v in cand.csr_tail)


def _check_candidates(batch: Batch, caps: Capabilities) -> list[Batch]:
    cands = reductions(batch, caps, LIMITS)
    assert len(set(cands)) == len(cands)
    keys = [size_key(c) for c in cands]
    assert keys == sorted(keys)  # smallest first
    for c in cands:
        Batch.from_dict(c.to_dict())  # valid (the constructor validates tables, lengths, sharing)
        assert size_key(c) < size_key(batch)
        assert caps.accepts(c)
        assert c.num_blocks <= max_num_blocks(c, LIMITS)
        assert (c.dtype, c.kv_cache_dtype, c.value_range, c.seed) == (batch.dtype, batch.kv_cache_dtype,
                                                                       batch.value_range, batch.seed)
    return cands


@settings(max_examples=100, deadline=None)
@given(batches(CAPS, LIMITS))
def test_reexpressing_at_a_smaller_block_size_keeps_every_token_in_its_slot(batch):
    import torch

    from kvfuzz.contracts.model.batch import positions

    for bs in (b for b in CAPS.block_sizes if batch.block_size % b == 0):
        small = reexpress(batch, bs)
        seq, pos = positions(batch.seq_lens)
        assert torch.equal(small.slots(seq, pos), batch.slots(seq, pos))
        assert small.num_blocks * small.block_size == batch.num_blocks * batch.block_size
    with pytest.raises(ValueError, match="does not divide"):
        reexpress(_batch([1], [0], block_size=8), 16 if batch.block_size else 3)


def test_a_smaller_head_size_scales_block_ids_to_keep_their_element_offsets():
    big = _batch([1], [0], head_size=256, block_size=32, table=[[8]], num_blocks=9)
    cands = reductions(big, CAPS, LIMITS)
    scaled = [c for c in cands if c.head_size == 32 and c.block_table == ((64,),)]
    assert scaled and scaled[0].num_blocks == 65
    assert any(c.head_size == 32 and c.block_table == ((8,),) for c in cands)  # and the ids kept
    for c in cands:
        if c.head_size < big.head_size and c.block_table != big.block_table:
            assert min(_offsets(c)) >= min(_offsets(big))
    # head size 24 would need block 86, past what the strategies draw (max_num_blocks): not offered scaled
    assert not any(c.head_size == 24 and c.block_table != ((8,),) for c in cands)
    # the default-scale multiple is kept: half the default stays half the default
    half = attrs.evolve(big, sm_scale=0.5 / 256**0.5)
    (c32,) = [c for c in reductions(half, CAPS, LIMITS) if c.head_size == 32 and c.block_table == ((64,),)]
    assert c32.sm_scale == pytest.approx(0.5 / 32**0.5)


def test_fewer_kv_heads_scale_block_ids_too():
    b = _batch([1], [0], heads=(4, 4), head_size=32, block_size=32, table=[[16]], num_blocks=17)
    assert any(c.num_kv_heads == 1 and c.block_table == ((64,),) for c in reductions(b, CAPS, LIMITS))


def test_a_shorter_sequence_at_a_smaller_block_size_keeps_a_non_consecutive_pair():
    b = _batch([1], [64], block_size=32, table=[[2, 1, 0]], num_blocks=3)
    cands = reductions(b, CAPS, LIMITS)
    # half the context at half the block size, the same ids: the pair (2, 1) still comes first
    assert any(c.block_size == 16 and c.ctx_lens == (32,) and c.block_table == ((2, 1, 0),) for c in cands)
    # and re-expressed: every token in its slot (block 2 of 32 = blocks 4 and 5 of 16)
    assert any(c.block_size == 16 and c.ctx_lens == (32,) and c.block_table[0][:3] == (4, 5, 2) for c in cands)
    b = _batch([1], [16], block_size=8, table=[[2, 1, 0]], num_blocks=3)
    assert any(c.ctx_lens == (8,) and c.block_table[0][:2] == (2, 1) for c in reductions(b, CAPS, LIMITS))


def _overflows(example: Example) -> Finding | None:
    """A stand-in kernel defect: a used block past 2**OFFSET_BITS elements."""
    if max(_offsets(example.batch)) >= 1 << OFFSET_BITS:
        return KernelMismatch(Oracle.AGREEMENT.value, "a block past the offset word")
    return None


def test_reduce_reaches_the_smallest_overflow_and_keeps_the_signature():
    start = Example(_batch([1, 1, 1], [0, 0, 64], heads=(4, 4), head_size=256, block_size=32,
                           table=[[8, 0, 0], [7, 0, 0], [4, 5, 6]], num_blocks=9), Poison.NAN)
    sig = _overflows(start).signature
    befores = []
    out = reduce_failure(start, sig, _overflows, get_mutant("mutant.int32_offset_overflow").capabilities,
                         before=lambda: befores.append(1))
    assert out.finding is not None and not out.out_of_time and 1 <= out.taken <= out.tried
    assert befores == [1]  # once, before the first candidate
    assert size_key(out.example.batch) == size_key(smallest_trigger("mutant.int32_offset_overflow"))
    # a candidate failing another way is never taken
    other = reduce_failure(start, ("non-finite output", Oracle.FINITE.value), _overflows, CAPS)
    assert other.finding is None and other.example == start and other.tried > 0
    # no time: nothing run
    none = reduce_failure(start, sig, _overflows, CAPS, seconds=-1, before=lambda: befores.append(2))
    assert none.out_of_time and none.tried == 0 and none.example == start and befores == [1]
    # skipped candidates are not run
    ran = []
    skipped = reduce_failure(start, sig, lambda e: ran.append(e), CAPS, skip=lambda e: True)
    assert ran == [] and skipped.tried == 0


class _Events(Quiet):
    def __init__(self):
        self.events = []

    def begin(self, target, example):
        self.events.append(("begin", example))

    def seen(self, record):
        self.events.append(("seen", record))

    def failure(self, record):
        self.events.append(("failure", record))


def _campaign(mutant: str, seed: int, structural_shrink: float, listener=None):
    config = CampaignConfig(out=Path(tempfile.mkdtemp()), max_examples=2000, duration=60, seed=seed,
                                   database=InMemoryExampleDatabase(), stop_at_first_failure=True,
                                   pin_configs=False, structural_shrink=structural_shrink)
    stats = TargetStats(mutant)
    campaign = engine.Campaign(get_mutant(mutant), config, listener or engine._Counting(stats, 0.0, lambda s: None))
    chunk = 0
    while not campaign.ledger.records() and chunk < 40:
        campaign.run_chunk(chunk, 25)
        chunk += 1
    return campaign, config


@pytest.mark.kernel
@pytest.mark.parametrize("mutant,seed", [("mutant.int32_offset_overflow", 2),
                                         ("mutant.contiguous_blocks", 1)])
def test_a_campaign_shrinks_a_zoo_mutant_to_its_smallest_trigger(mutant, seed):
    """Hypothesis alone stops at D256 with 4 heads (int32_offset_overflow, seed 2; on seed 0 the first failure
    is a kernel mismatch whose one-sequence form reads NaN from the poisoned block 0, another signature, so it
    stays at two sequences) and at block size 32 with 64 context tokens (contiguous_blocks, seed 1: on seed 0 the
    engine's error/bound guidance now leads Hypothesis to the smallest trigger by itself); the structural passes
    (first, on the failure as found, and after Hypothesis's) reach the smallest trigger, and only its reproducer is
    left."""
    events = _Events()
    campaign, config = _campaign(mutant, seed, 60.0, events)
    records = [r for kind, r in events.events if kind == "failure"]
    assert records
    smallest = size_key(smallest_trigger(mutant))
    best = min(records, key=lambda r: size_key(Example.from_dict(r.example).batch))
    assert size_key(Example.from_dict(best.example).batch) <= smallest
    # each signature: reported seen (unshrunk, structurally shrunk first where that pass took a candidate, then
    # Hypothesis-shrunk) before its candidates ran, and one reproducer directory left, the final one
    for r in records:
        seen = [x.stage for kind, x in events.events if kind == "seen" and x.signature == r.signature]
        assert seen in (["unshrunk", "hypothesis"], ["unshrunk", "structural", "hypothesis"]) and r.stage == "final"
    dirs = sorted(p.name for p in config.out.iterdir() if p.is_dir() and p.name.startswith(mutant))
    assert dirs == sorted(Path(r.reproducer).name for r in records)
    # the reproducer says what the structural shrink did, from where
    import json

    details = json.loads((Path(best.reproducer) / "case.json").read_text())["details"]
    first, after = details["structural_first"], details["structural_shrink"]  # before and after Hypothesis's
    assert first["taken"] + after["taken"] >= 1 and not first["out_of_time"] and not after["out_of_time"]
    assert first["from"] != Example.from_dict(best.example).batch.summary()
    assert set(details["shrink_seconds"]) == {"structural_first", "hypothesis", "structural"}


@pytest.mark.kernel
def test_the_structural_shrink_can_be_turned_off():
    campaign, config = _campaign("mutant.int32_offset_overflow", 0, 0.0)
    records = campaign.ledger.records()
    assert records
    assert all(size_key(Example.from_dict(r.example).batch)
               > size_key(smallest_trigger("mutant.int32_offset_overflow")) for r in records)


@pytest.mark.kernel
def test_a_real_kernels_finding_reduces_to_its_minimal_case():
    """vLLM's CPU op (docs/findings.md, Finding 1: NaN in the unused tail of its last token group reaches the output),
    started from three sequences, four heads and head size 64: the structural shrink alone reaches the README's
    minimal case (one decode sequence, ctx_len 0, one head, the smallest head size, one block)."""
    target = available("vllm.cpu_attention")

    def attempt(e):
        try:
            properties.check(target, e)
        except Finding as f:
            return f
        return None

    start = Example(_batch([5, 1, 3], [3, 20, 0], heads=(4, 2), head_size=64, block_size=32, dtype="float16",
                           num_blocks=5), Poison.NAN)
    found = attempt(start)
    assert found is not None and found.signature == ("non-finite output", Oracle.FINITE.value)
    out = reduce_failure(start, found.signature, attempt, target.capabilities)
    b = out.example.batch
    assert out.finding is not None and out.finding.signature == found.signature
    assert (b.num_seqs, b.query_lens, b.ctx_lens, b.num_heads, b.num_kv_heads, b.num_blocks) == (
        1, (1,), (0,), 1, 1, 1)
    assert b.head_size == min(target.capabilities.head_sizes)


def _serving_batch(min_seqs: int, seed: int = 0) -> Batch:
    """A serving-tier batch of at least ``min_seqs`` sequences (the tier's own draw, at its sizes)."""
    import random

    from hypothesis.control import BuildContext
    from hypothesis.errors import StopTest
    from hypothesis.internal.conjecture.data import ConjectureData

    from kvfuzz.strategies.serving import serving_batches
    from kvfuzz.strategies.tiers import tier_limits

    caps = attrs.evolve(CAPS, fp8_head_sizes=(), kv_cache_dtypes=("auto",), features=())
    strategy = serving_batches(caps, tier_limits("serving", LIMITS))
    for i in range(1000):
        data = ConjectureData(random=random.Random(f"{seed}:{i}"))
        try:
            with BuildContext(data, wrapped_test=None):
                batch = data.draw(strategy)
        except StopTest:
            continue
        if batch.num_seqs >= min_seqs and sum(q >= 4 and c >= 384 for q, c in zip(batch.query_lens,
                                                                                   batch.ctx_lens)) == 1:
            return batch
    raise AssertionError("no serving batch of that size drawn")


@pytest.mark.parametrize("seed", [0, 1])
def test_the_structural_first_moves_take_a_serving_batch_to_its_one_trigger_in_a_few_runs(seed):
    """A serving-sized failure (20+ sequences, one of them a prefill chunk of >= 4 tokens after >= 384 cached keys:
    the trigger) shrinks with the coarse moves to that one sequence, its lengths halved and snapped toward the
    trigger's edge, in a few dozen runs: at 60-140 ms a serving example (an H100), seconds, inside any grace."""
    start = Example(_serving_batch(20, seed), Poison.NAN)
    runs = []

    def attempt(e):
        runs.append(e)
        hit = any(q >= 4 and c >= 384 for q, c in zip(e.batch.query_lens, e.batch.ctx_lens))
        return KernelMismatch(Oracle.AGREEMENT.value, "planted") if hit else None

    sig = attempt(start).signature
    runs.clear()
    out = reduce_failure(start, sig, attempt, CAPS, moves=coarse_reductions)
    b = out.example.batch
    assert b.num_seqs == 1 and b.query_lens[0] >= 4 and b.ctx_lens[0] >= 384 and not out.out_of_time
    assert b.ctx_lens[0] < 2 * 384 and b.query_lens[0] < 2 * 4  # halved and snapped to the trigger's edge
    # to one sequence: about 2 log2(n) runs (a half, then the other half, ...); the lengths: a few more each
    to_one = next(i for i, e in enumerate(runs, 1) if e.batch.num_seqs == 1 and attempt(e))
    assert to_one <= 2 * start.batch.num_seqs.bit_length() + 2, (to_one, start.batch.num_seqs)
    assert out.tried <= 80, out.tried


def test_coarse_moves_drop_halves_first_then_one_at_a_time_then_halve_and_snap():
    b = _batch([1, 1, 1, 1], [40, 17, 0, 64], block_size=16)
    cands = list(coarse_reductions(b, CAPS, LIMITS))
    seqs = [c.num_seqs for c in cands]
    assert seqs[:2] == [2, 2] and seqs[2:6] == [3, 3, 3, 3]  # either half dropped, then each one
    assert all(n == 4 for n in seqs[6:])  # then the lengths, every sequence at once first
    assert cands[6].ctx_lens == (20, 8, 0, 32) and cands[6].query_lens == b.query_lens  # contexts halved
    assert any(c.ctx_lens == (32, 16, 0, 64) for c in cands)  # snapped down to the block size (16)
    assert any(c.ctx_lens == (0, 0, 0, 64) for c in cands)  # to the widest tile (64) that changes them
    for c in cands:
        Batch.from_dict(c.to_dict())
        assert size_key(c) < size_key(b) and CAPS.accepts(c) and c.head_size == b.head_size
    assert list(coarse_reductions(_batch([1], [0]), CAPS, LIMITS)) == []  # nothing smaller in the same shape
