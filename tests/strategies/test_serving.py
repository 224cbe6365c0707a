"""The serving size tier (strategies/serving.py) and the model table it draws from (strategies/models.py): vLLM's
head sharding, batches as a scheduler composes them (decodes first, a token budget, chunks straddling the window),
and shrinking back down to one small sequence."""

import attrs
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis.errors import NoSuchExample

from kvfuzz.contracts.model.capabilities import Capabilities
from kvfuzz.contracts.model.contract import Contract
from kvfuzz.contracts.model.counter_rng import MAX_STREAM_ELEMENTS
from kvfuzz.strategies import models
from kvfuzz.strategies.limits import Limits
from kvfuzz.strategies.models import MODELS, model_shapes, shard_heads
from kvfuzz.strategies.serving import TOKEN_BUDGETS, capture_size, serving_batches
from kvfuzz.strategies.tiers import tier_limits

CAPS = Capabilities(contract=Contract.UNIFIED, devices=("cuda",), dtypes=("float16",), head_sizes=(64, 128, 256),
                    block_sizes=(16, 32), features=("sliding_window", "softcap", "sinks"))
SERVING = tier_limits("serving", Limits())
#: The serving tier with fewer slots and shorter contexts: the same draws, shrinking in a test's time.
SHORT = attrs.evolve(SERVING, max_num_seqs=4, max_ctx_len=8192)
FIND = settings(max_examples=1000, deadline=None, database=None)


def test_heads_are_sharded_as_vllm_shards_them():
    assert shard_heads(32, 8, 1) == (32, 8) and shard_heads(32, 8, 4) == (8, 2)
    assert shard_heads(32, 8, 8) == (4, 1)
    assert shard_heads(64, 8, 16) == (4, 1)  # more ranks than kv heads: each rank holds one, replicated
    assert shard_heads(28, 4, 8) is None  # 28 query heads do not split 8 ways (vLLM asserts)
    assert shard_heads(40, 10, 4) is None  # neither of 10 kv heads and 4 ranks divides the other
    assert all(m.source == f"https://huggingface.co/{m.name}/blob/main/config.json" for m in MODELS)


def test_every_model_row_says_where_it_was_checked():
    assert all(m.checked for m in MODELS)  # strategies/models.py: only values checked against a source are listed
    assert set(models._CHECKED) == {m.name for m in MODELS}  # no provenance left over from a removed row
    assert all(m.num_heads % m.num_kv_heads == 0 for m in MODELS)
    latent = [m for m in MODELS if m.mla]
    assert latent and all(m.num_kv_heads == 1 and m.head_size == m.kv_lora_rank + m.qk_rope_head_dim for m in latent)


def test_model_shapes_keep_what_the_target_accepts():
    shapes = model_shapes(CAPS)
    assert {s.head_size for s in shapes} == {64, 128, 256}
    gemma = [s for s in shapes if s.model == "google/gemma-2-9b"]
    assert [(s.tp, s.num_heads, s.num_kv_heads) for s in gemma] == [(8, 2, 1), (4, 4, 2), (2, 8, 4), (1, 16, 8)]
    assert {(s.sliding_window, s.softcap) for s in gemma} == {(4096, 50.0)}
    assert all(s.sinks and s.sliding_window == 128 for s in shapes if s.model.startswith("openai/gpt-oss"))
    plain = attrs.evolve(CAPS, features=(), gqa_ratios=(1, 2))
    assert all(s.sliding_window is None and s.softcap is None and not s.sinks for s in model_shapes(plain))
    assert all(s.num_heads // s.num_kv_heads in (1, 2) for s in model_shapes(plain))
    latent = attrs.evolve(CAPS, head_sizes=(576,), value_head_size=512, features=())
    assert {s.model for s in model_shapes(latent)} == {"deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V2-Lite"}
    assert all(s.num_kv_heads == 1 for s in model_shapes(latent))
    assert not [s for s in shapes if s.head_size == 576]  # MLA rows only for a latent cache


def test_capture_sizes():
    assert [capture_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 17)] == [1, 2, 4, 4, 8, 8, 16, 24]


def test_serving_batches_are_scheduled_batches_inside_the_declaration():
    seen = []

    @settings(max_examples=60, phases=[Phase.generate], database=None, deadline=None)
    @given(serving_batches(CAPS, SERVING))
    def draw(b):
        assert CAPS.accepts(b)
        assert sum(b.query_lens) <= max(TOKEN_BUDGETS) + 8
        assert b.num_seqs <= SERVING.max_num_seqs and max(b.ctx_lens) <= SERVING.max_ctx_len
        assert sum(b.seq_lens) * b.num_kv_heads * b.head_size <= MAX_STREAM_ELEMENTS
        seen.append(b)

    draw()
    assert max(b.num_seqs for b in seen) >= 8
    assert max(sum(b.query_lens) for b in seen) > 512
    assert max(max(b.ctx_lens) for b in seen) > 4096
    table = {(s.num_heads, s.num_kv_heads, s.head_size) for s in model_shapes(CAPS)}
    assert any((b.num_heads, b.num_kv_heads, b.head_size) in table and b.num_heads >= 8 for b in seen)


def test_a_serving_batch_reaches_a_chunk_straddling_a_window_and_shrinks_back():
    def straddles(b):
        return b.sliding_window is not None and b.sliding_window >= 256 and any(
            q >= 2 and c >= b.sliding_window for q, c in zip(b.query_lens, b.ctx_lens))

    found = find(serving_batches(CAPS, SHORT), straddles, settings=FIND)
    # one prefill chunk of 2 tokens right at the smallest window that satisfies the condition
    assert found.num_seqs == 1 and found.query_lens[0] == 2 and found.sliding_window == 256
    assert 256 <= found.ctx_lens[0] <= 256 + 32


def test_decodes_and_spec_steps_come_before_prefill_chunks():
    # spec-decode steps (k + 1 tokens) next to plain decodes, decodes before prefill chunks
    spec = find(serving_batches(CAPS, SHORT), lambda b: 3 <= b.query_lens[0] <= 8 and b.num_seqs >= 2
                and b.query_lens[-1] > 16, settings=FIND)
    assert spec.num_seqs == 2
    smallest = find(serving_batches(CAPS, SHORT), lambda b: True, settings=FIND)
    assert smallest.num_seqs == 1 and tuple(smallest.ctx_lens) == (0,) and smallest.query_lens[0] <= 2
    assert smallest.num_heads == 1 and smallest.head_size == 64  # off the table: heads shrink as in batches()


def test_off_table_shapes_stay_reachable():
    # a head layout no model in the table has (3 query heads over 1 kv head at head size 64)
    # (one draw in ~200: a group of 3 of ten, one kv head, head size 64, off the table; more examples than FIND)
    odd = find(serving_batches(CAPS, SHORT), lambda b: (b.num_heads, b.num_kv_heads, b.head_size) == (3, 1, 64),
               settings=settings(FIND, max_examples=4000))
    assert odd.num_heads == 3
    with pytest.raises(NoSuchExample):  # never past the declaration
        find(serving_batches(CAPS, SHORT), lambda b: b.head_size not in CAPS.head_sizes,
             settings=settings(max_examples=100, deadline=None))


def test_multi_query_rows_shard_with_their_kv_head_replicated():
    """Falcon-7B (71/1) runs at tp 1 only (vLLM asserts 71 % tp == 0); StarCoder's one kv head is replicated on
    every rank (48, 24, 12, 6 query heads over it); Falcon-180B's groups of 29 keep 4, 2, 1 kv heads at tp 2, 4, 8."""
    shapes = {(s.model, s.tp): (s.num_heads, s.num_kv_heads) for s in model_shapes(CAPS)}
    assert shapes[("tiiuae/falcon-7b", 1)] == (71, 1) and ("tiiuae/falcon-7b", 2) not in shapes
    assert [shapes[("bigcode/starcoder", tp)] for tp in (1, 2, 4, 8)] == [(48, 1), (24, 1), (12, 1), (6, 1)]
    assert [shapes[("tiiuae/falcon-180B", tp)] for tp in (2, 4, 8)] == [(116, 4), (58, 2), (29, 1)]
    assert tier_limits("serving").max_num_heads >= 116  # every one of them fits a serving batch
