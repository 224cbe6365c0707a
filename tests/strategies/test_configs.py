"""Compile-aware generation: kernel configurations, pinned strategies whose examples replay unchanged in the
free strategy, rotation that covers the declared space, and campaigns whose pinned failures widen across
configurations to the smallest trigger."""

import random
import tempfile
from pathlib import Path

import pytest
from hypothesis.control import BuildContext
from hypothesis.database import InMemoryExampleDatabase
from hypothesis.errors import InvalidArgument
from hypothesis.internal.conjecture.data import ConjectureData

from kvfuzz.contracts.model.batch import FEATURES
from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.example import Example
from kvfuzz.fuzz.bench.mutants import get_mutant, smallest_trigger
from kvfuzz.fuzz.bench.paged_torch import batch_size
from kvfuzz.fuzz.campaign import chunks, engine
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.records import TargetStats
from kvfuzz.strategies.batches import choice, examples
from kvfuzz.strategies.configs import KernelConfig, config_for, round_length
from kvfuzz.strategies.limits import Limits

CAPS = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float32", "float16", "bfloat16"),
                    head_sizes=(32, 64, 80, 128, 256), block_sizes=(16, 32, 64),
                    kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"), fp8_head_sizes=(64, 128),
                    features=("sliding_window", "alibi", "sinks", "softcap"), exclusive=(("alibi", "sinks"),),
                    fp8_gqa_ratios=(1, 2, 4))
LIMITS = Limits()


def _draw(data: ConjectureData, strategy):
    with BuildContext(data, wrapped_test=lambda: None):
        return data.draw(strategy)


def test_a_pinned_example_replays_unchanged_in_the_free_strategy():
    """The property compile-aware generation rests on: the pinned draw makes the same choices as the free one,
    so the database entry of a failure found inside one configuration replays (and shrinks) in all of them."""
    free = examples(CAPS, LIMITS)
    for k in range(3 * round_length(CAPS, LIMITS, seed=7)):
        cfg = config_for(CAPS, LIMITS, seed=7, index=k)
        pinned = examples(CAPS, LIMITS, pin=cfg)
        for j in range(4):
            data = ConjectureData(random=random.Random(100 * k + j))
            e = _draw(data, pinned)
            b = e.batch
            assert (b.dtype, b.num_heads, b.num_kv_heads, b.head_size, b.kv_cache_dtype, b.block_size) == (
                cfg.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.kv_cache_dtype, cfg.block_size)
            assert set(b.features) == set(cfg.features)
            assert b.sliding_window == (None if cfg.sliding_window is None
                                        else max(cfg.sliding_window, CAPS.min_sliding_window))
            assert CAPS.accepts(b)
            assert _draw(ConjectureData.for_choices(data.choices), free) == e


def test_one_round_of_configurations_covers_every_declared_value():
    n = round_length(CAPS, LIMITS, seed=3)
    configs = [config_for(CAPS, LIMITS, seed=3, index=k) for k in range(n)]
    assert {c.dtype for c in configs} == set(CAPS.dtypes)
    assert {c.head_size for c in configs} == set(CAPS.head_sizes)
    assert {c.block_size for c in configs} == set(CAPS.block_sizes)
    assert {c.kv_cache_dtype for c in configs} == set(CAPS.kv_cache_dtypes)
    for f in FEATURES:
        assert any(f in c.features for c in configs) and any(f not in c.features for c in configs), f
    for c in configs:  # inside the declaration: fp8 head sizes and group sizes, exclusive pairs
        assert c.head_size in CAPS.head_sizes_for(c.kv_cache_dtype)
        assert CAPS.fp8_accepts_gqa(c.kv_cache_dtype, c.num_heads // c.num_kv_heads)
        assert CAPS.combinable(c.features)
    # deterministic in (seed, index); another seed, another order
    assert configs == [config_for(CAPS, LIMITS, seed=3, index=k) for k in range(n)]
    assert configs != [config_for(CAPS, LIMITS, seed=4, index=k) for k in range(n)]


def test_runtime_fields_stay_free_inside_a_pinned_chunk_and_the_round_counts_only_the_pinned_ones():
    """FlashInfer compiles per dtype, head size and window/soft cap on or off, not per heads, page size or window
    size: a configuration leaving those free keeps the compiled ones, draws the others (and still replays in the
    free strategy), and a round needs only as many configurations as the longest pinned dimension."""
    free = frozenset({"heads", "block_size", "window"})
    caps = Capabilities(contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16", "bfloat16"),
                        head_sizes=(64, 128, 256), block_sizes=(1, 16, 5, 64, 8, 32, 3),
                        kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"), features=("sliding_window", "softcap"),
                        gqa_ratios=(1, 2, 3, 4, 8, 16), metadata="csr")
    n = round_length(caps, LIMITS, seed=5, free=free)
    assert n < round_length(caps, LIMITS, seed=5) and n >= 3  # 3 head sizes, 3 cache dtypes: not 7 block sizes
    configs = [config_for(caps, LIMITS, seed=5, index=k, free=free) for k in range(n)]
    assert {c.head_size for c in configs} == set(caps.head_sizes) and {c.dtype for c in configs} == set(caps.dtypes)
    assert all(c.free == free for c in configs)
    windowed = next(c for c in configs if "sliding_window" in c.features)
    assert "H* " in windowed.summary() and "BS*" in windowed.summary() and "sliding_window=*" in windowed.summary()
    plain = examples(caps, LIMITS)
    seen = {"heads": set(), "block": set(), "window": set()}
    for j in range(40):
        data = ConjectureData(random=random.Random(j))
        b = _draw(data, examples(caps, LIMITS, pin=windowed)).batch
        assert (b.dtype, b.head_size, b.kv_cache_dtype, set(b.features)) == (
            windowed.dtype, windowed.head_size, windowed.kv_cache_dtype, set(windowed.features))
        assert caps.accepts(b)
        seen["heads"].add((b.num_heads, b.num_kv_heads)), seen["block"].add(b.block_size)
        seen["window"].add(b.sliding_window)
        assert _draw(ConjectureData.for_choices(data.choices), plain).batch == b
    assert all(len(v) > 1 for v in seen.values()), seen
    with pytest.raises(ValueError, match="free fields"):
        KernelConfig("float16", 4, 2, 64, "auto", 16, free=("head_size",))


def test_a_flashinfer_chunk_leaves_its_runtime_fields_free():
    from kvfuzz.fuzz.targets import get_target

    t = get_target("flashinfer.batch_decode")
    pinned = CampaignConfig(out=Path(tempfile.mkdtemp()), pin_configs=True)
    assert t.runtime_fields == {"heads", "block_size", "window"}
    assert chunks.chunk_config(t, pinned, 2) == config_for(t.capabilities, pinned.limits, 0, 2, free=t.runtime_fields)
    assert chunks.chunk_config(get_mutant("mutant.gqa_modulo"), pinned, 2).free == frozenset()


def test_bad_pins_are_rejected():
    with pytest.raises(InvalidArgument, match="not one of"):
        choice((16, 32), 48)
    with pytest.raises(ValueError, match="group size"):
        KernelConfig("float16", 10, 2, 64, "auto", 16)
    with pytest.raises(ValueError, match="sliding_window"):
        KernelConfig("float16", 4, 2, 64, "auto", 16, features=("sliding_window",))


def _pinned_campaign(mutant: str, seed: int = 0) -> TargetStats:
    config = CampaignConfig(out=Path(tempfile.mkdtemp()), max_examples=1000, seed=seed,
                                   database=InMemoryExampleDatabase(), stop_at_first_failure=True,
                                   pin_configs=True, structural_shrink=0,  # widening alone
                                   chunk_examples=200,  # several configurations within the 1000 examples
                                   steer=False)  # a configuration per chunk: steered chunks keep the one before
    return engine.fuzz_target(get_mutant(mutant), config), config


@pytest.mark.parametrize("mutant", ["mutant.gqa_modulo", "mutant.scale_ignored"])
def test_a_failure_found_in_one_configuration_widens_to_the_smallest_trigger(mutant):
    """The chunk is pinned to a configuration with many heads and a large head size; widening shrinks the
    failure across configurations to the mutant's smallest trigger (sequences, tokens, heads, head size,
    blocks), and the campaign database keeps only the widened example."""
    stats, config = _pinned_campaign(mutant)
    (record,) = stats.failures.values()
    got, want = batch_size(Example.from_dict(record.example).batch), batch_size(smallest_trigger(mutant))
    keys = ("seqs", "tokens", "kv_tokens", "heads", "kv_heads", "head_size", "blocks")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    first = config_for(get_mutant(mutant).capabilities, config.limits, config.seed, 0)
    assert (first.num_heads, first.head_size) != (want["heads"], want["head_size"])  # widening did the work
    key = f"kvfuzz:{mutant}:None".encode()
    assert len(list(config.database.fetch(key))) == 1
    assert not list(config.database.fetch(key + b".secondary"))


def test_chunks_are_pinned_on_cuda_and_free_on_cpu_by_default():
    cpu = get_mutant("mutant.gqa_modulo")
    config = CampaignConfig(out=Path(tempfile.mkdtemp()))
    assert chunks.pins_configs(cpu, config) is (cpu.device == "cuda")
    assert chunks.examples_per_chunk(cpu, config) == (chunks.PINNED_CHUNK_EXAMPLES if cpu.device == "cuda"
                                                      else chunks.CHUNK_EXAMPLES)
    pinned = CampaignConfig(out=config.out, pin_configs=True)
    assert chunks.chunk_config(cpu, pinned, 5) == config_for(cpu.capabilities, pinned.limits, 0, 5)
    assert chunks.chunk_config(cpu, pinned, -1) == config_for(cpu.capabilities, pinned.limits, 0, 0)  # warm-up
    assert chunks.chunk_config(cpu, CampaignConfig(out=config.out, pin_configs=True, undeclared=True),
                               0) is None


def test_default_workers(monkeypatch):
    from kvfuzz.fuzz.campaign import config
    from kvfuzz.fuzz.campaign.config import MAX_CPU_WORKERS, MAX_WORKERS_PER_GPU, default_workers, usable_cpus

    # CPU: one worker per usable core, at most MAX_CPU_WORKERS, whatever this machine has
    assert default_workers(0, cpus=1) == 1 and default_workers(0, cpus=2) == 2
    assert default_workers(0, cpus=64) == MAX_CPU_WORKERS
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert usable_cpus() == 3 and default_workers(0) == 3  # the affinity mask, not the machine's cores
    # on CUDA too: a taskset of 16 cores on a 64-core host with four GPUs is a 16-core one-GPU machine
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(config.os, "cpu_count", lambda: 64)
    assert default_workers(1, mps=True) == 14 and default_workers(1) == MAX_WORKERS_PER_GPU
    monkeypatch.delattr(config.os, "sched_getaffinity")
    monkeypatch.setattr(config.os, "cpu_count", lambda: None)
    assert usable_cpus() == 1  # neither an affinity mask nor a core count: one
    monkeypatch.undo()
    assert default_workers(1, cpus=16) == MAX_WORKERS_PER_GPU
    assert default_workers(8, cpus=128) == 8 * MAX_WORKERS_PER_GPU
    assert default_workers(4, cpus=8) == 4  # one per GPU at least
    assert default_workers(2, cpus=12) == 6
