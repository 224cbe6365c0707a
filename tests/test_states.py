"""The production states' registry (kvfuzz.contracts.model.states.PRODUCTION_STATES) is the one list: every state
has a draw (kvfuzz.strategies.states.DRAWS), its harness hooks name registered states only
(kvfuzz.fuzz.harness.states.HOOKS), and Capabilities (validation, accepts, outside, states, without_states),
coverage's tags and Target.gate_capabilities read it: a planted state registered there alone is declared, drawn
and refused through all of them. No kernel runs here."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuzz.contracts.model import states as registry
from kvfuzz.contracts.model.batch import Batch
from kvfuzz.contracts.model.capabilities import STATES, Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.state import ProductionState, State
from kvfuzz.fuzz.harness import states as harness_states
from kvfuzz.fuzz.harness.coverage import batch_states
from kvfuzz.strategies import states as draws
from kvfuzz.strategies.batches import batches
from kvfuzz.strategies.limits import Limits

CAPS = Capabilities(contract=Contract.UNIFIED, devices=("cpu",), dtypes=("float32",), head_sizes=(32,),
                    block_sizes=(16,), features=("sliding_window",))


def test_every_state_has_a_home_a_draw_and_only_registered_hooks():
    assert list(STATES) == list(registry.PRODUCTION_STATES) == ["shared_prefix_blocks", "freed_window_blocks",
                                                                 "cuda_graph_padding"]
    assert set(draws.DRAWS) == set(registry.PRODUCTION_STATES)
    assert set(harness_states.HOOKS) <= set(registry.PRODUCTION_STATES)
    fields = {a.name for a in attrs.fields(Capabilities)}
    for name, state in registry.PRODUCTION_STATES.items():
        assert isinstance(state, ProductionState) and state.name == name and name in fields
        assert attrs.fields_dict(Capabilities)[name].default == state.off  # declared off unless a target says so
        __import__(state.home)


def test_each_states_validation_comes_from_its_home():
    with pytest.raises(ValueError, match="freed_window_blocks needs the feature 'sliding_window'"):
        attrs.evolve(CAPS, features=(), freed_window_blocks=True)
    with pytest.raises(ValueError, match="unknown cuda_graph_padding 'tensorrt'"):
        attrs.evolve(CAPS, cuda_graph_padding="tensorrt")
    with pytest.raises(ValueError, match=r"unknown production states \['cuda_graph_pads'\]"):
        CAPS.without_states(("cuda_graph_pads",))


def test_declaration_accepts_and_names_states_by_the_registry():
    padded = Batch(query_lens=[1], ctx_lens=[3], num_heads=1, num_kv_heads=1, head_size=32, block_size=16,
                   num_blocks=2, block_table=[[1]], dtype="float32", num_pad_seqs=2)
    assert not CAPS.accepts(padded) and CAPS.outside(padded) == ["CUDA-graph pad sequences"]
    vllm = attrs.evolve(CAPS, cuda_graph_padding="vllm", freed_window_blocks=True)
    assert vllm.accepts(padded) and vllm.outside(padded) == []
    assert vllm.states == ("freed window blocks", "cuda-graph padding (vllm)")
    assert vllm.without_states(("cuda_graph_padding",)).states == ("freed window blocks",)
    assert batch_states(padded) == "cuda-graph-padding"


def _planted(monkeypatch):
    """A state registered in PRODUCTION_STATES alone (a draw and no hooks), declared through an existing bool
    field's stand-in: ``decode_only`` plays its declaration, a batch of one sequence is in it."""
    planted = State("decode_only", "planted", False, "the planted state", "planted", __name__,
                    lambda b: b.num_seqs == 1, None)
    monkeypatch.setitem(registry.PRODUCTION_STATES, "decode_only", planted)
    monkeypatch.setitem(draws.DRAWS, "decode_only", lambda draw, caps, kw, serving: {"csr_tail": draw(st.just((-1,)))})
    return planted


def test_a_planted_state_is_declared_refused_and_drawn_through_the_registry(monkeypatch):
    _planted(monkeypatch)
    one = Batch(query_lens=[1], ctx_lens=[0], num_heads=1, num_kv_heads=1, head_size=32, block_size=16,
                num_blocks=1, block_table=[[0]], dtype="float32")
    assert "the planted state" in CAPS.outside(one) and not CAPS.accepts(one)
    declared = attrs.evolve(CAPS, decode_only=True)
    assert "planted" in declared.states and declared.accepts(one) and batch_states(one) == "planted"
    assert declared.without_states(("decode_only",)).decode_only is False

    @settings(max_examples=5, database=None, deadline=None)
    @given(batches(declared, Limits(max_num_seqs=2, max_query_len=2, max_ctx_len=8)))
    def drawn(batch):
        assert batch.csr_tail == (-1,)  # the planted draw ran (a block-table target draws no csr_tail)

    drawn()


def test_only_the_states_a_batch_is_in_run_their_hooks():
    plain = Batch(query_lens=[1], ctx_lens=[3], num_heads=1, num_kv_heads=1, head_size=32, block_size=16,
                  num_blocks=1, block_table=[[0]], dtype="float32", sliding_window=2)
    assert harness_states.active_hooks(plain) == [] and harness_states.call_check_args(plain) == {}
    freed = attrs.evolve(plain, ctx_lens=(40,), num_blocks=4, block_table=((0, 0, 1),), freed_window_blocks=True)
    assert harness_states.active_hooks(freed) == [harness_states.HOOKS["freed_window_blocks"]]
    assert harness_states.call_check_args(freed) == {"null_block": 0}
