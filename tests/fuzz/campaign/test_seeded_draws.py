"""A campaign's draws depend on its seed, not on what its process imported (kvfuzz.strategies.seeding): Hypothesis
mixes the literals of every local module in ``sys.modules`` into its draws, so a campaign of one seed found a
re-injected bug at its 60th example alone and not in 150 after the other tests of its file had imported more
(tests/fuzz/bench/test_bugs.py). A chunk whose every example draws one integer from a range where only a planted
module has literals draws the same before and after that module is imported."""

from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase
from support.planted_constants import plant

from kvfuzz.contracts.model.example import Example
from kvfuzz.contracts.model.poison import Poison
from kvfuzz.fuzz.bench.paged_torch import PagedTorch, small_batch
from kvfuzz.fuzz.campaign import engine
from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.records import TargetStats

#: The batch seeds the chunk draws, and the planted literals among them (no module of kvfuzz's has one there).
LOW, HIGH = 1_000_000_001, 2_000_000_000
PLANTED = range(1_234_567_000, 1_234_567_100)


def chunk_seeds(tmp_path, monkeypatch, name: str) -> list[int]:
    """The batch seeds one chunk of a campaign (seed 0) of PagedTorch draws, one example an integer in the range."""
    seen = []

    def example(i: int) -> Example:
        seen.append(i)
        return Example(small_batch([1], [3], head_size=32, block_size=8, seed=i), Poison.ZEROS)

    monkeypatch.setattr(engine, "strategy_for", lambda *a, **k: st.integers(LOW, HIGH).map(example))
    config = CampaignConfig(out=tmp_path / name, max_examples=300, duration=None, seed=0, pin_configs=False,
                            database=InMemoryExampleDatabase(), stop_at_first_failure=True)
    campaign = engine.Campaign(PagedTorch(), config, engine._Counting(TargetStats("torch.paged"), 0.0, lambda s: None))
    assert campaign.run_chunk(0, 300) == []  # correct attention: nothing found, nothing shrunk
    return seen


def test_a_chunk_draws_the_same_after_a_module_of_constants_is_imported(tmp_path, monkeypatch):
    before = chunk_seeds(tmp_path, monkeypatch, "before")
    assert len(before) >= 300 and not set(before) & set(PLANTED)
    plant(tmp_path, monkeypatch, PLANTED)
    assert chunk_seeds(tmp_path, monkeypatch, "after") == before
