"""check_output, the two output oracles with one host sync when both pass: on a passing, a non-finite, a wrong and a
huge-but-finite output it returns exactly what check_finite then agreement return."""

import pytest

from kvfuzz.contracts.checks.oracles import agreement, check_finite, check_output, over_envelope
from kvfuzz.contracts.checks.reference import reference_and_envelope, same_precision_attention
from kvfuzz.contracts.model.data import make_batch_data


def _case(make_batch, dtype="float16"):
    b = make_batch([(5, 3), (1, 20), (3, 0)], dtype=dtype, seed=4)
    data = make_batch_data(b)
    ref, env = reference_and_envelope(b, data)
    lowp = same_precision_attention(b, data)
    return b, ref, env, lowp


def _separately(b, out, ref, lowp, env):
    """What the harness computed before check_output: check_finite, then agreement on a finite output."""
    fail = check_finite(b, out)
    if fail is not None:
        return fail, None, 0.0
    return (None, *agreement(b, out, ref, lowp, env))


def _planted(kind, ref, dtype):
    out = ref.to(dtype).clone()
    if kind == "nan":
        out[4, 1, 7] = float("nan")
    elif kind == "inf":
        out[0, 0, 0] = float("-inf")
    elif kind == "off":
        out[2, 3, 5] += 0.25
    elif kind == "huge":  # finite, but its fp32 sum overflows: the sum's finiteness is not a failure by itself
        out[:] = 3e38
    return out


@pytest.mark.parametrize("one_read", [False, True])  # True: as on a GPU, both values read back at once
@pytest.mark.parametrize("kind", ["pass", "nan", "inf", "off", "huge"])
def test_check_output_is_check_finite_then_agreement(make_batch, kind, one_read):
    dtype = "float32" if kind == "huge" else "float16"
    b, ref, env, lowp = _case(make_batch, dtype)
    out = _planted(kind, ref, b.torch_dtype)
    got = check_output(b, out, ref, lowp, env, one_read=one_read)
    want = _separately(b, out, ref, lowp, env)
    assert repr(got) == repr(want)  # repr: a failure's error is NaN, which equals nothing
    failed = {"pass": (False, False), "nan": (True, False), "inf": (True, False), "off": (False, True),
              "huge": (False, True)}[kind]
    assert (got[0] is not None, got[1] is not None) == failed
    if kind == "pass":
        assert got[2] == float(over_envelope(out, ref, env)) <= 1.0


def test_agreement_with_a_given_over_skips_nothing_it_needs(make_batch):
    b, ref, env, lowp = _case(make_batch)
    out = _planted("off", ref, b.torch_dtype)
    over = float(over_envelope(out, ref, env))
    assert over > 1.0
    assert repr(agreement(b, out, ref, lowp, env, over=over)) == repr(agreement(b, out, ref, lowp, env))
