"""The naive same-precision model computed for some output rows alone (the agreement oracle's fallback for rows over
the envelope): the same rows as the whole batch's model, over only the keys each row can see, in blocks; and the
oracle asks for exactly the rows it needs.

What it guards: an H200 unified-attention campaign (2026-11-28) computed the model for a whole 8192-query sequence
after 32,768 cached tokens with ALiBi (its [H, Q, K] logits and fp64 bias, hundreds of GB) when one element was over
the envelope, and the worker hung in "check" for 300 s: a harness error in a default campaign."""

import pytest
import torch
from support import batch_of

from kvfuzz.contracts.checks import reference
from kvfuzz.contracts.checks.oracles import agreement
from kvfuzz.contracts.checks.reference import reference_and_envelope, same_precision_attention
from kvfuzz.contracts.model.data import make_batch_data

#: prefills, a decode and a chunk after a long context, with the features that enter the naive model's logits
CASES = {
    "window+alibi": dict(sliding_window=7, alibi=True),
    "sinks+softcap": dict(sinks=True, softcap=5.0),
    "plain": dict(),
}


def _batch(features, dtype="float16"):
    return batch_of([(9, 3), (1, 40), (17, 0), (12, 50)], num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype,
                    seed=5, **features)


@pytest.mark.parametrize("features", CASES.values(), ids=CASES.keys())
def test_rows_alone_equal_the_whole_batch_rows(features, monkeypatch):
    b = _batch(features)
    d = make_batch_data(b)
    whole = same_precision_attention(b, d)
    tokens = [0, 4, 8, 9, 10, 27, 28, 33, b.num_tokens - 1]
    monkeypatch.setattr(reference, "ROWS_BLOCK_LOGITS", 4 * 3 * 20)  # a few rows a block: several blocks a sequence
    rows = same_precision_attention(b, d, tokens)
    assert rows.shape == (len(tokens), b.num_heads, b.head_size_v)
    torch.testing.assert_close(rows, whole[tokens], rtol=0, atol=2 * torch.finfo(torch.float16).eps)


def test_blocks_stay_within_the_logit_budget_and_keep_every_row(monkeypatch):
    b = _batch(dict(sliding_window=7))
    monkeypatch.setattr(reference, "ROWS_BLOCK_LOGITS", 4 * 3 * 12)
    rows = list(range(12))
    blocks = reference._row_blocks(b, 3, rows)  # sequence 3: 12 rows after 50 cached tokens, window 7
    assert [int(r) for blk in blocks for r in blk] == rows
    assert len(blocks) > 1
    for blk in blocks:  # keys seen: from the first row's window start to the last row
        keys = int(blk[-1]) - int(blk[0]) + 7
        assert len(blk) == 1 or b.num_heads * len(blk) * keys <= reference.ROWS_BLOCK_LOGITS


def test_agreement_asks_for_the_rows_over_the_envelope_alone():
    b = _batch(dict(sliding_window=7, alibi=True))
    d = make_batch_data(b)
    ref, env = reference_and_envelope(b, d)
    whole = same_precision_attention(b, d)
    out = ref.to(b.torch_dtype).clone()
    out[10, 1, 3] += 0.5  # a kernel wrong at one element of token 10 (sequence 1's decode)
    out[30, 0, 0] += 0.5
    asked = []

    def lowp(tokens):
        asked.append(list(tokens))
        return same_precision_attention(b, d, tokens)

    fail, _ = agreement(b, out, ref, lowp, env)
    assert asked == [[10, 30]]
    want, _ = agreement(b, out, ref, whole, env)  # the whole batch's model: the same verdict, the same failure
    assert fail is not None and repr(fail) == repr(want)



@pytest.mark.parametrize("shift", [0.0, 0.5])
def test_past_the_work_budget_the_worst_rows_are_judged_and_the_rest_never_fail(shift, monkeypatch):
    """``shift`` 0: the output is the naive model itself (a naive-style kernel: rows over the envelope, excused by the
    naive term); 0.5: it is wrong everywhere."""
    from kvfuzz.contracts.checks import oracles

    b = batch_of([(24, 8), (16, 40)], num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", seed=3)
    d = make_batch_data(b)
    ref, env = reference_and_envelope(b, d)
    out = same_precision_attention(b, d) + shift
    ratio = ((out - ref).abs() / env).flatten(1).amax(dim=1)
    over = [t for t in range(b.num_tokens) if ratio[t] > 1]
    assert len(over) >= 4
    full, _ = agreement(b, out, ref, same_precision_attention(b, d), env)  # the verdict with every row's model
    asked = []

    def lowp(tokens):
        asked.extend(tokens)
        return same_precision_attention(b, d, tokens)

    work = reference.same_precision_work(b, over)
    monkeypatch.setattr(oracles, "NAIVE_WORK_BUDGET", sum(work.values()) // 4)
    fail, _ = agreement(b, out, ref, lowp, env)
    assert 0 < len(asked) < len(over) and set(asked) <= set(over) and len(set(asked)) == len(asked)
    assert sum(work[t] for t in asked) < sum(work.values()) // 4 + 8 * max(work.values())  # + the last group's overrun
    left = [t for t in over if t not in asked]
    assert ratio[asked].min() >= ratio[left].max()  # worst first
    assert (fail is None) == (full is None) == (shift == 0.0)  # excused everywhere: passes; wrong: still fails
    if fail is not None:  # found among the rows judged
        assert fail.token in asked and set(fail.bad_tokens) <= set(asked)
