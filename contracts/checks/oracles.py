"""Oracles a kernel's output must pass: finiteness, and agreement with the fp64 reference element by element.

Agreement (derivation and calibration in docs/tolerance.md), per output element (token t, head h, dim d):

    |out - ref|  <=  max(LOWP_RTOL * max_d' |out_lp - ref|,  envelope)

``ref`` is the fp64 reference and ``out_lp`` the same math done naively in the batch dtype
(:func:`~kvfuzz.contracts.checks.reference.same_precision_attention`): the first term is FlashAttention's rule
(tests/test_flash_attn.py: ``2 * max|out_pt - ref|``) applied per (token, head) row, so an error confined to one
token cannot hide behind a large rounding error elsewhere. ``envelope``
(:func:`~kvfuzz.contracts.checks.reference.reference_and_envelope`) bounds what a correct FlashAttention-family kernel
(fp32 scores and accumulation, P rounded to the dtype, the output rounded once) can produce at that element; it
scales with what drives the rounding: the output's ulp, ``sum_k p_k |v_k|``, and the logits' fp32 error (head
size, ``sum_i |q_i k_i|``, logit magnitudes). Each term alone admits one legitimate way of computing attention:
naive torch (scores rounded to the dtype) or FlashAttention-style.

No statistic across elements: FA3's mean-error rule (``mean|out - ref| <= 1.5 * mean|out_pt - ref|``) was
measured and rejected (docs/tolerance.md, "Why no mean-error rule").
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs
import torch

from ..model.batch import Batch
from .reference import SOFTCAP_ULPS, same_precision_work

#: Multiple of the naive same-precision row error a kernel may make: FlashAttention's 2, for every dtype (the
#: envelope, not this constant, carries fp32 kernels' larger blocked/online-softmax rounding; RTOL 128 did).
LOWP_RTOL = 2.0


class Oracle(enum.Enum):
    """Every oracle a kernel's output must pass, by the name findings, summaries and reproducer directories use
    (a finding's ``check``), as :class:`~kvfuzz.contracts.checks.violations.Check` names the caller checks."""

    #: NaN or inf anywhere in the output (:func:`check_finite`)
    FINITE = "finite output"
    #: element-wise agreement with the fp64 reference within the bound of the module docstring (:func:`agreement`)
    AGREEMENT = "agreement with the fp64 reference"
    #: NaN or inf in a CUDA-graph pad row (:func:`check_pad_rows`; kvfuzz.contracts.model.padding)
    PAD_FINITE = "finite pad rows"
    #: a padded call changed the paged cache (:func:`check_cache_unchanged`)
    PAD_WRITES = "cache unchanged by a padded call"
    #: a merge of two attention states against the exact fp64 merge of its inputs (kvfuzz.contracts.checks.merge)
    MERGE = "agreement with the exact merge"
    #: the merged log-sum-exp a merge writes (``output_lse``) against the exact one (kvfuzz.contracts.checks.merge)
    MERGE_LSE = "merged log-sum-exp"

    @property
    def label(self) -> str:
        """How users read it next to a failure kind: ``"oracle: finite output"``."""
        return f"oracle: {self.value}"

    @classmethod
    def parse(cls, name: str) -> "Oracle | None":
        """The oracle named ``name`` (its value, or a bare name older reproducers recorded: "finite",
        "agreement"); None for any other name (a caller check, a writer check, a crash)."""
        name = LEGACY_NAMES.get(name, name)
        return next((o for o in cls if o.value == name), None)


#: The names reproducers written before :class:`Oracle` recorded as their check.
LEGACY_NAMES: dict[str, str] = {"finite": Oracle.FINITE.value, "agreement": Oracle.AGREEMENT.value}

#: One message per oracle, formatted with an :class:`OracleFailure`'s fields (:meth:`OracleFailure.message`).
MESSAGES: dict[Oracle, str] = {
    Oracle.FINITE: "non-finite output: {bad_elements} elements in {bad_rows} (token, head) rows; first at sequence "
                   "{seq} position {position} (output row {token}), head {head}, dim {dim}: {error}",
    Oracle.AGREEMENT: "kernel disagrees with the fp64 reference in {bad_rows} (token, head) rows; worst at sequence "
                      "{seq} position {position} (output row {token}), head {head}, dim {dim}: |out - ref| = "
                      "{error:.3g} > bound {bound:.3g}",
    Oracle.PAD_FINITE: "non-finite pad row: {bad_elements} elements in {bad_rows} (token, head) rows of CUDA-graph pad "
                       "sequences; first at output row {token}, which is a pad row (pad sequence {seq}, not a real "
                       "request: the engine drops it, but inside the model it flows on), head {head}, dim {dim}: "
                       "{error}",
    Oracle.MERGE: "merged output disagrees with the exact merge of its inputs in {bad_rows} (token, head) rows; worst "
                  "at sequence {seq} position {position} (output row {token}), head {head}, dim {dim}: |out - exact| "
                  "= {error:.3g} > bound {bound:.3g}",
    Oracle.MERGE_LSE: "merged log-sum-exp disagrees with the exact one in {bad_rows} (head, token) entries; worst at "
                      "sequence {seq} position {position} (token {token}), head {head}: |lse - exact| = {error:.3g} > "
                      "bound {bound:.3g}",
    Oracle.PAD_WRITES: "a call with CUDA-graph pad sequences changed the paged cache: {bad_elements} elements in "
                       "{bad_rows} slots, first at block {token} (slot {position} of it), head {head}, dim {dim} "
                       "(an attention kernel writes nothing; the pads' null block / slot 0 included)",
}
#: :attr:`Oracle.PAD_WRITES` for a cache too big to copy, compared by block digests (:func:`check_cache_digests`).
DIGEST_MESSAGE = ("a call with CUDA-graph pad sequences changed the paged cache: {bad_rows} blocks, first block "
                  "{token} (a big cache is compared block by block through digests, so which elements is not known; "
                  "an attention kernel writes nothing, the pads' null block / slot 0 included)")


def check_label(check: str) -> str:
    """How a finding's ``check`` reads to users: ``"oracle: <name>"`` for an oracle (legacy names included),
    the check itself for anything else (a caller check, a writer check, ``raised <Type>``)."""
    oracle = Oracle.parse(check)
    return check if oracle is None else oracle.label


@attrs.frozen
class OracleFailure:
    """A failed oracle, located at its worst element.

    oracle: which (:class:`Oracle`). seq, position: sequence and token position of the worst row; token: its
    row in the output; head, dim: the worst element; error, bound: its error and the allowed bound (NaN/inf
    for :attr:`Oracle.FINITE`); bad_rows: how many (token, head) rows fail; bad_elements: elements that fail.
    """

    oracle: Oracle
    seq: int
    position: int
    token: int
    head: int
    dim: int
    error: float
    bound: float
    bad_rows: int
    bad_elements: int
    bad_tokens: tuple[int, ...] = ()

    @property
    def ratio(self) -> float:
        """``error / bound`` at the worst element: how many times the bound it exceeds (NaN for
        :attr:`Oracle.FINITE`, whose bound is NaN)."""
        return self.error / self.bound if self.bound else float("inf")

    def message(self) -> str:
        """The oracle's message (:data:`MESSAGES`) filled in with this failure's fields (a cache compared by
        block digests, ``bad_elements`` -1: :data:`DIGEST_MESSAGE`)."""
        template = DIGEST_MESSAGE if self.oracle is Oracle.PAD_WRITES and self.bad_elements < 0 else \
            MESSAGES[self.oracle]
        return template.format(**attrs.asdict(self, recurse=False))

    def to_dict(self) -> dict:
        """JSON-ready: the oracle by its value, plus ``message``."""
        return attrs.asdict(self) | {"oracle": self.oracle.value, "message": self.message()}


def locate(batch: Batch, token: int) -> tuple[int, int]:
    """``(sequence, position)`` of output row ``token`` of ``batch`` (query order)."""
    qsl = batch.query_start_loc
    seq = max(i for i in range(batch.num_seqs) if qsl[i] <= token)
    return seq, batch.ctx_lens[seq] + token - qsl[seq]


def check_finite(batch: Batch, out: torch.Tensor) -> OracleFailure | None:
    """NaN or inf anywhere in ``out`` ``[num_tokens, num_heads, head_size]`` (any device) is always a failure,
    located at its first non-finite element (row-major order). One host sync when it passes.

    A NaN or inf element makes any sum over it NaN or inf, so an fp32 sum that is finite proves every element
    finite (one vectorized pass; ``isfinite(out).all()`` took ten times as long); a non-finite sum (which a
    finite fp32 output of huge values can also give) is decided element by element, in the rows whose sums are
    not finite."""
    if bool(torch.isfinite(out.sum(dtype=torch.float32))):
        return None
    return _non_finite(batch, out)


def _non_finite(batch: Batch, out: torch.Tensor) -> OracleFailure | None:
    """:func:`check_finite`'s element-by-element pass (on the CPU), in the rows whose fp32 sums are not finite: its
    answer for any ``out`` (None when every element is finite)."""
    out = out.cpu()
    rows = torch.nonzero(~torch.isfinite(out.sum(dim=-1, dtype=torch.float32)))  # [k, 2] (token, head), sorted
    bad = ~torch.isfinite(out[rows[:, 0], rows[:, 1]])  # [k, head_size]: exact, in those rows only
    bad_rows = bad.any(dim=-1)
    if not bool(bad_rows.any()):
        return None  # finite values whose sum overflowed
    r = int(torch.nonzero(bad_rows)[0])
    t, h = (int(i) for i in rows[r])
    d = int(torch.nonzero(bad[r])[0])
    seq, pos = locate(batch, t)
    tokens = tuple(int(i) for i in torch.unique(rows[bad_rows, 0]))
    return OracleFailure(Oracle.FINITE, seq, pos, t, h, d, float(out[t, h, d]), float("nan"), int(bad_rows.sum()),
                         int(bad.sum()), tokens)


def check_pad_rows(batch: Batch, out: torch.Tensor) -> OracleFailure | None:
    """NaN or inf in the CUDA-graph pad rows of ``out`` ``[num_tokens + num_pad_seqs, num_heads, head_size]``
    (rows ``num_tokens ..``: one per pad sequence, :mod:`kvfuzz.contracts.model.padding`): the failure names the
    first such row and says it is a pad row (``seq``: the pad's index among the call's sequences, real ones
    first; ``position`` 0). None when there are no pads or every pad row is finite."""
    t0 = batch.num_tokens
    pads = out[t0:]
    if not batch.num_pad_seqs or not pads.numel():
        return None
    bad = ~torch.isfinite(pads.cpu())
    if not bool(bad.any()):
        return None
    rows = bad.any(dim=-1)  # [pads, H]
    r, h = (int(i) for i in torch.nonzero(rows)[0])
    d = int(torch.nonzero(bad[r, h])[0])
    tokens = tuple(t0 + int(i) for i in torch.nonzero(rows.any(dim=1)).flatten())
    return OracleFailure(Oracle.PAD_FINITE, batch.num_seqs + r, 0, t0 + r, h, d, float(pads[r, h, d]),
                         float("nan"), int(rows.sum()), int(bad.sum()), tokens)


def check_cache_unchanged(before: torch.Tensor, after: torch.Tensor) -> OracleFailure | None:
    """Whether a padded call left a cache bitwise as it was: ``before``/``after`` the raw bits of one cache
    (any layout; dim 0 blocks, dim 1 ``block_size`` slots for the NHD layouts this is used with, and the rest
    flattened into (head, dim) as far as the shape allows). None when equal."""
    diff = (before != after)
    if not bool(diff.any()):
        return None
    idx = [int(i) for i in torch.nonzero(diff)[0]] + [0, 0, 0, 0]
    per_slot = diff.flatten(2).any(dim=-1) if diff.dim() > 2 else diff
    return OracleFailure(Oracle.PAD_WRITES, 0, idx[1], idx[0], idx[2], idx[3], float("nan"), float("nan"),
                         int(per_slot.sum()), int(diff.sum()))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Elements per slice when digesting a cache (:func:`block_digests`): the int64 temporaries stay at 256 MiB.
DIGEST_SLICE_ELEMENTS = 1 << 24


def block_digests(cache: torch.Tensor) -> torch.Tensor:
    """int64 ``[num_blocks]``: one digest of each block's raw bits (dim 0 of ``cache``, any layout), a
    position-weighted sum, so any change to one element, or two elements swapped, changes its block's digest.
    For caches too big to copy (a padded big-cache call's "cache unchanged" oracle,
    kvfuzz.fuzz.harness.padding): computed slice by slice along dim 0 (:data:`DIGEST_SLICE_ELEMENTS`), on the
    cache's device, without a copy of the whole cache. The weights cycle through 1..251, so no sum overflows
    int64 (blocks of up to 2**22 elements of 32 bits)."""
    per_block = max(1, cache[:1].numel())
    step = max(1, DIGEST_SLICE_ELEMENTS // per_block)
    weights = torch.arange(per_block, dtype=torch.int64, device=cache.device) % 251 + 1
    out = torch.empty(cache.shape[0], dtype=torch.int64, device=cache.device)
    for i in range(0, cache.shape[0], step):
        part = cache[i:i + step].contiguous()
        part = part.view(_BITS[part.element_size()]).reshape(-1, per_block).to(torch.int64)
        out[i:i + step] = (part * weights).sum(dim=1)
    return out


def check_cache_digests(before: torch.Tensor, after: torch.Tensor) -> OracleFailure | None:
    """:func:`check_cache_unchanged` for a cache known only by its :func:`block_digests` before the call:
    ``before`` those digests, ``after`` the cache now. None when every block's digest is unchanged; else the
    failure names the first changed block and how many changed (which elements is not known:
    ``bad_elements`` is -1)."""
    changed = torch.nonzero(block_digests(after) != before).flatten()
    if not len(changed):
        return None
    return OracleFailure(Oracle.PAD_WRITES, 0, 0, int(changed[0]), 0, 0, float("nan"), float("nan"),
                         len(changed), -1)


def agreement_bound(ref: torch.Tensor, lowp: torch.Tensor, envelope: torch.Tensor,
                    rtol: float = LOWP_RTOL) -> torch.Tensor:
    """The bound of the module docstring, fp64 ``[num_tokens, num_heads, head_size]``: per element,
    ``max(rtol * max_d |lowp - ref|, envelope)``; ``ref``, ``lowp``, ``envelope`` fp64, that shape. A row
    where the naive model is not finite (fp16 scores past 65,504: "extreme" values, docs/tolerance.md) admits
    nothing by it: its bound is the envelope."""
    naive = rtol * (lowp.to(ref.device) - ref).abs().amax(dim=-1, keepdim=True)
    naive = torch.where(torch.isfinite(naive), naive, torch.zeros_like(naive))
    return torch.maximum(naive, envelope)


#: The same-precision output: a tensor ``[num_tokens, num_heads, head_size]``, or a function of output rows (token
#: indices, ascending) computing those rows alone, ``[len(tokens), num_heads, head_size]`` (called only when an
#: element is over the envelope, with the rows that have one: a long sequence's naive model costs its whole
#: ``[H, Q, K]`` of logits, hundreds of GB at serving sizes).
LowPrecision = torch.Tensor | Callable[[list[int]], torch.Tensor]


def over_envelope(out: torch.Tensor, ref: torch.Tensor, envelope: torch.Tensor) -> torch.Tensor:
    """fp64 0-dim on ``ref``'s device: the largest ``|out - ref| / envelope`` (NaN counted as inf; 0 for an empty
    output), computed there without a host sync (``out`` any float dtype, moved to ``ref``'s device; shapes as
    in :func:`agreement`). At most 1 means every element passes :func:`agreement`."""
    err = (out.to(ref.device, torch.float64) - ref).abs()
    if not err.numel():
        return torch.zeros((), dtype=torch.float64, device=ref.device)
    return (err / envelope).nan_to_num(float("inf")).max()  # envelope > 0


#: The most work the naive model of one output may cost the agreement oracle, in multiply-adds summed over the rows it
#: computes (:func:`~kvfuzz.contracts.checks.reference.same_precision_work`): 2**37, about 10 s of fp32 matmuls on a
#: few cores. Past it (a kernel wrong on thousands of rows of a long sequence without a window: 8,192 rows of 40,960
#: keys and 96 heads cost 2**43) the rows worst first, and the rest left unjudged by the naive term
#: (:func:`_rows_bound`).
NAIVE_WORK_BUDGET = 1 << 37


def _rows_bound(batch: Batch, err: torch.Tensor, ref: torch.Tensor, lowp: Callable[[list[int]], torch.Tensor],
                envelope: torch.Tensor, rtol: float) -> torch.Tensor:
    """The bound of :func:`agreement_bound` with the naive model computed by ``lowp`` for the rows that have an element
    over the envelope (the others' bound is the envelope: they pass by it). Within :data:`NAIVE_WORK_BUDGET` every
    such row; past it the rows by their largest ``err / envelope``, worst first, in a few calls, until the budget is
    spent, and the rows left get an infinite bound: not judged (never a failure the naive term might have excused)."""
    rows = ~(err <= envelope).flatten(1).all(dim=1)
    tokens = [int(i) for i in torch.nonzero(rows).flatten()]
    bound = envelope.clone()
    work = same_precision_work(batch, tokens)
    if sum(work.values()) <= NAIVE_WORK_BUDGET:
        bound[tokens] = agreement_bound(ref[tokens], lowp(tokens).cpu(), envelope[tokens], rtol)
        return bound
    worst = (err[tokens] / envelope[tokens]).nan_to_num(float("inf")).flatten(1).amax(dim=1)
    order = [tokens[int(i)] for i in torch.argsort(worst, descending=True, stable=True)]
    spent, k = 0, 0
    while k < len(order) and spent < NAIVE_WORK_BUDGET:
        group, part = [], 0
        while k < len(order) and part < NAIVE_WORK_BUDGET // 8:
            group.append(order[k])
            part += work[order[k]]
            k += 1
        group.sort()
        bound[group] = agreement_bound(ref[group], lowp(group).cpu(), envelope[group], rtol)
        spent += part
    bound[order[k:]] = float("inf")
    return bound


def agreement(batch: Batch, out: torch.Tensor, ref: torch.Tensor, lowp: LowPrecision, envelope: torch.Tensor,
              rtol: float = LOWP_RTOL, over: float | None = None) -> tuple[OracleFailure | None, float]:
    """The element-wise rule of the module docstring, with its ratio: ``(failure, ratio)``.

    ``out`` any float dtype, ``ref`` and ``envelope`` fp64, all ``[num_tokens, num_heads, head_size]`` and on
    one device (``out`` is moved to ``ref``'s); ``lowp`` fp64 that shape, or a function of token indices returning
    those rows (:data:`LowPrecision`), called with the rows that have an element over the envelope.
    ``failure``: None when every element passes, else the failure at the element with the largest
    ``|out - ref| / bound``. ``ratio``: the largest ``|out - ref| / bound`` of a passing output (0.0 when it
    fails). Every element under the envelope passes whatever ``lowp`` is (the bound is at least the envelope),
    so ``lowp`` is computed only when some element exceeds it, and only for the rows with such an element (within
    :data:`NAIVE_WORK_BUDGET`: past it the worst rows, and the rest not judged); the ratio is taken against the
    envelope alone where ``lowp`` was not computed: an upper bound of the ratio against the full bound. One host
    sync when every element is under the envelope; none when ``over``, :func:`over_envelope`'s value for these
    tensors, is given and at most 1."""
    if over is None:
        over = float(over_envelope(out, ref, envelope))
    if over <= 1.0:
        return None, over
    err = (out.to(ref.device, torch.float64) - ref).abs()
    err, ref, envelope = err.cpu(), ref.cpu(), envelope.cpu()
    if callable(lowp):  # the naive model of the rows with an element over the envelope alone: the rest pass by it
        bound = _rows_bound(batch, err, ref, lowp, envelope, rtol)
    else:
        bound = agreement_bound(ref, lowp.cpu(), envelope, rtol)
    bad = ~(err <= bound)  # NaN counts as bad
    if not bad.any():
        return None, float((err / bound).max())
    excess = torch.where(bad, err / bound, torch.zeros_like(err)).nan_to_num(float("inf"))
    t, h, d = (int(i) for i in torch.unravel_index(torch.argmax(excess), excess.shape))
    seq, pos = locate(batch, t)
    rows = bad.any(dim=-1)
    tokens = tuple(int(i) for i in torch.nonzero(rows.any(dim=1)).flatten())
    return OracleFailure(Oracle.AGREEMENT, seq, pos, t, h, d, float(err[t, h, d]), float(bound[t, h, d]),
                         int(rows.sum()), int(bad.sum()), tokens), 0.0


def check_output(batch: Batch, out: torch.Tensor, ref: torch.Tensor, lowp: LowPrecision, envelope: torch.Tensor,
                 rtol: float = LOWP_RTOL, one_read: bool | None = None
                 ) -> tuple[OracleFailure | None, OracleFailure | None, float]:
    """Both oracles of an attention output, as the harness runs them on every example: ``(finite failure,
    agreement failure, ratio)``, :func:`check_finite`'s and :func:`agreement`'s results (agreement only for a
    finite output: a non-finite one fails it too, and its failure wins; ``(None, None, 0.0)`` skipped). Shapes and
    dtypes as in :func:`agreement`, ``out`` on any device. One host sync when both pass: ``out`` goes to ``ref``'s
    device once, the finiteness of its fp32 sum (:func:`check_finite`'s first pass) and :func:`over_envelope` are
    read back together (``one_read``; by default off the CPU: on the CPU, where a read costs nothing, one after the
    other, so a non-finite output skips the agreement's pass), and only a failure computes its details (by
    :func:`check_finite`'s element pass and :func:`agreement` themselves, so a failure reads exactly as theirs)."""
    here = out.to(ref.device)
    finite = torch.isfinite(here.sum(dtype=torch.float32))
    if not (ref.device.type != "cpu" if one_read is None else one_read):
        finite, over = bool(finite), None  # agreement only for an output that may be finite
    else:  # one read of both
        over = over_envelope(here, ref, envelope)
        finite, over = torch.stack([finite.to(over.dtype), over]).tolist()
    if not finite:  # decided element by element (a sum that overflowed is not a failure)
        fail = _non_finite(batch, here)
        if fail is not None:
            return fail, None, 0.0
    fail, ratio = agreement(batch, here, ref, lowp, envelope, rtol, over=over)
    return None, fail, ratio


def check_agreement(batch: Batch, out: torch.Tensor, ref: torch.Tensor, lowp: LowPrecision,
                    envelope: torch.Tensor, rtol: float = LOWP_RTOL) -> OracleFailure | None:
    """The failure of :func:`agreement` (None when every element passes)."""
    return agreement(batch, out, ref, lowp, envelope, rtol)[0]


# ---- the decode-prefill relation's bound (fuzz/harness/relations.py) -------------------------------------
# The relation compares two kernel outputs with each other, not with the reference, and still uses the per-row
# rule kvfuzz's agreement oracle had before the envelope: RTOL[dtype] * max_d |out_lp - ref| + row_floor. Kept
# unchanged for it; the agreement oracle above no longer uses them.

#: Per-dtype multiple of the same-precision row error (fp16/bf16: FlashAttention's 2; fp32: 128, measured on
#: fp32 kernels' online-softmax rounding before the envelope existed).
RTOL: dict[str, float] = {"float16": 2.0, "bfloat16": 2.0, "float32": 128.0}

#: The magnitude ``atol_floor`` is defined at; fp32 rows with larger values get a proportionally larger floor.
FLOOR_MAGNITUDE = 0.3


def atol_floor(dtype: torch.dtype) -> float:
    """FA3's rounding floor ``2 * |(x + 0.3 - 0.3) - x|`` for x ~ 1 in ``dtype``: 2 ulp at 0.3."""
    x = torch.tensor(FLOOR_MAGNITUDE, dtype=torch.float64)
    return 2.0 * float(((x.to(dtype) + FLOOR_MAGNITUDE) - FLOOR_MAGNITUDE).to(torch.float64).sub(x).abs()
                       .clamp_min(torch.finfo(dtype).eps * 0.25))


def row_floor(batch: Batch, ref: torch.Tensor) -> torch.Tensor:
    """``[num_tokens, num_heads]`` floor of the decode-prefill relation's per-row bound: ``atol_floor(dtype)``,
    for float32 scaled by ``max(1, max_d |ref| / 0.3)``, plus ``SOFTCAP_ULPS * c * eps(fp32) * max(1, max_d
    |ref|)`` when ``batch.softcap`` is set."""
    absmax = ref.abs().amax(dim=-1).nan_to_num(0.0)
    floor = torch.full_like(absmax, atol_floor(batch.torch_dtype))
    if batch.torch_dtype == torch.float32:
        floor = floor * (absmax / FLOOR_MAGNITUDE).clamp_min(1.0)
    if batch.softcap is not None:
        floor = floor + SOFTCAP_ULPS * batch.softcap * torch.finfo(torch.float32).eps * absmax.clamp_min(1.0)
    return floor


__all__ = ["DIGEST_MESSAGE", "DIGEST_SLICE_ELEMENTS", "FLOOR_MAGNITUDE", "LEGACY_NAMES", "LOWP_RTOL", "MESSAGES",
           "NAIVE_WORK_BUDGET", "RTOL", "LowPrecision", "Oracle", "OracleFailure", "agreement", "agreement_bound",
           "atol_floor",
           "block_digests", "check_agreement", "check_cache_digests", "check_cache_unchanged", "check_finite",
           "check_label", "check_output", "check_pad_rows", "locate", "over_envelope", "row_floor"]
