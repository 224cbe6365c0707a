"""Project-wide pytest setup: Hypothesis profiles and shared batch builders.

Profiles (select with ``pytest --hypothesis-profile NAME``): ``dev`` (default; derandomized, so ``make test``
is reproducible), ``ci`` (derandomized, no example database; used automatically when CI is set), ``fuzz``
(random, many examples, for long local runs and HypoFuzz). Their max_examples is the
budget of the contract properties in tests/test_properties.py (real kernels: keep dev/ci small); tests that
need another budget set it explicitly.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None, max_examples=10, derandomize=True)
settings.register_profile("ci", deadline=None, max_examples=10, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def make_batch():
    """Build a Batch with a contiguous block table from per-sequence (query_len, ctx_len) pairs."""
    from kvfuzz.contracts.model.batch import Batch

    def build(lens, *, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, spare=1, dtype="float32",
              seed=0, reverse=False):
        needed = [-(-(q + c) // block_size) for q, c in lens]
        ids = list(range(sum(needed) + spare))
        if reverse:
            ids = ids[::-1]
        width = max(needed) + 1
        table, k = [], 0
        for n in needed:
            table.append(ids[k : k + n] + [0] * (width - n))
            k += n
        return Batch(query_lens=[q for q, _ in lens], ctx_lens=[c for _, c in lens], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                     num_blocks=sum(needed) + spare, block_table=table, dtype=dtype, seed=seed)

    return build


@pytest.fixture(scope="module")
def one_torch_thread():
    """vLLM's CPU op runs an OpenMP region per call: ~8 ms per call with 2 threads on a busy 2-core machine,
    ~0.05 ms with 1. Modules that call it many times use this fixture."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
