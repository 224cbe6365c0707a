"""A counter-based generator whose numbers are the same bits on every device and torch version.

Every number is a pure function of ``(seed, stream, index)``, computed with torch int32 operations that are
exact on every device (wrapping multiply, xor, and, shifts) and then two exact float steps, so a batch drawn on
the CPU and one drawn on a GPU are bitwise equal by construction, whatever the chunking, the device or the
torch version. No transcendental function is used (``log``/``cos``/``erfinv`` differ between the CPU and CUDA),
and no two float operations meet in one expression that a compiler could fuse into an FMA: each torch op
here is a separate, correctly rounded IEEE operation.

The construction, for element ``j`` of stream ``s`` (``j < 2**28``, ``s < 16``):

* ``k0, k1``: the low and high 32 bits of ``splitmix64(seed mod 2**64)`` (pure Python, once per draw);
* the counter ``c = s * 2**28 + j`` and two 32-bit words ``w_r = lowbias32(c ^ k_r)`` for ``r = 0, 1``, where
  lowbias32 is Chris Wellons' 32-bit integer hash (a bijection: ``x ^= x >> 16; x *= 0x7feb352d;
  x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16``, logical shifts, products mod ``2**32``). Within one seed no
  two ``(stream, index)`` pairs share a word;
* four independent uniforms, each spanning ``2**22`` units: of each word (read as a signed int32) its high 22
  bits ``w >> 10`` (22-bit resolution) and its low 10 bits ``(w & 0x3FF) * 2**12``; ``X_r`` the sum of word
  ``r``'s two;
* ``Z = X_0 - X_1``: an integer, symmetric about 0 (the difference of two independent copies of one
  distribution: mean exactly 0), ``|Z| < 2**23``;
* ``x = float32(Z) * float32(sqrt(3) * 2**-22)``: the conversion is exact (``|Z| <= 2**24``), the product one
  rounding.

So ``x`` follows the Irwin–Hall distribution of 4 uniforms (the sum of four independent uniforms, centred and
scaled to unit variance), discretized: two of the four uniforms have 2**22 levels, two have 2**10 (which moves
the density from the continuous Irwin–Hall one by about 2**-10 of itself), and the values lie on a lattice of
step ``sqrt(3) * 2**-22`` (about ``2**-21.2``, a few fp32 ulps near 1), with ``|x| <= 2 * sqrt(3)`` (about 3.46).
Mean 0, variance 1 (to about 2**-20), excess kurtosis -0.3 (a normal's is 0): close enough to a standard
normal for attention inputs, with no tails beyond 3.46 standard deviations.

:func:`below` draws integers ``floor(u * n)`` with ``u = (w_0 & 0x7FFFFFFF) / 2**31`` from the same words, for
choices such as the "dominant" position of a sequence.

CPU cost: the work runs in chunks of :data:`CHUNK` elements through small reused buffers (fresh large
allocations page-fault on every call, which dominated an unchunked version); about 30 torch calls per chunk.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch

#: Stream ids: every tensor of a batch draws from its own stream, so the keys do not depend on how many
#: queries there are.
QUERY, KEYS, VALUES, SINKS, DOMINANT = 0, 1, 2, 3, 4
#: Elements per stream (the counter's index field has 28 bits).
MAX_STREAM_ELEMENTS = 1 << 28
#: Elements generated per chunk on the CPU (a whole draw at once on other devices, whose allocators cache).
CHUNK = 1 << 16

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def _int32(v: int) -> int:
    """``v mod 2**32`` as a signed int32 value (what torch's int32 holds)."""
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


_M1, _M2 = _int32(0x7FEB352D), _int32(0x846CA68B)
#: ``sqrt(3) * 2**-22`` rounded to float32: one uniform of width ``2**22`` has variance ``2**44 / 12``, four have
#: ``2**44 / 3``.
SCALE = struct.unpack("<f", struct.pack("<f", math.sqrt(3.0) * 2.0 ** -22))[0]


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser of ``x + golden gamma`` (Vigna), mod 2**64: the seed's two 32-bit keys."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def keys(seed: int) -> tuple[int, int]:
    """The two int32 hash keys of ``seed`` (any Python int; taken mod 2**64)."""
    z = splitmix64(seed & _MASK64)
    return _int32(z), _int32(z >> 32)


def _c(v: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A 0-dim CPU tensor of the construction's constant ``v`` (a CPU scalar to torch on every device), made once
    per process: a Python int operand would be wrapped and cast to int32 on every op, which costs more than the op
    on a small batch. Only the fixed constants (shifts, masks, multipliers, :data:`SCALE`) go through here, so
    :data:`_CONSTANTS` stays at a dozen entries; a seed's keys are made per draw (:func:`_key_tensors`)."""
    t = _CONSTANTS.get((v, dtype))
    if t is None:
        t = _CONSTANTS[(v, dtype)] = torch.tensor(v, dtype=dtype)
    return t


_CONSTANTS: dict[tuple[int | float, torch.dtype], torch.Tensor] = {}


def _key_tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two int32 keys of ``seed`` (:func:`keys`) as 0-dim CPU tensors, made for one draw and not kept: every
    example draws its own seeds, so a cache of them would grow with the campaign (~0.9 KiB a seed)."""
    k0, k1 = keys(seed)
    return torch.tensor(k0, dtype=torch.int32), torch.tensor(k1, dtype=torch.int32)


def _xorshift(x: torch.Tensor, s: int, tmp: torch.Tensor) -> None:
    """``x ^= x >>> s`` in place (logical shift: torch's ``>>`` on int32 is arithmetic, so mask)."""
    torch.bitwise_right_shift(x, _c(s), out=tmp)
    tmp.bitwise_and_(_c((1 << (32 - s)) - 1))
    x.bitwise_xor_(tmp)


def _words(k: tuple[torch.Tensor, torch.Tensor], pieces: Sequence[tuple[int, int, int]], w: torch.Tensor,
           tmp: torch.Tensor) -> None:
    """Fill ``w`` (int32 ``[2, m]``) with the words of counters ``pieces``: ``(stream, first index, count)``
    runs laid end to end, under the seed's keys ``k`` (:func:`_key_tensors`)."""
    w0, w1 = w.unbind(0)
    at = 0
    for stream, first, count in pieces:
        base = _int32(stream * MAX_STREAM_ELEMENTS + first)  # no run crosses 2**31: the values fit in int32
        torch.arange(base, base + count, dtype=torch.int32, out=w0[at:at + count])
        at += count
    torch.bitwise_xor(w0, k[1], out=w1)
    w0.bitwise_xor_(k[0])
    _xorshift(w, 16, tmp)
    w.mul_(_c(_M1))
    _xorshift(w, 15, tmp)
    w.mul_(_c(_M2))
    _xorshift(w, 16, tmp)


def _check(counts: Sequence[tuple[int, int]]) -> None:
    for stream, n in counts:
        if not 0 <= stream < 16 or not 0 <= n <= MAX_STREAM_ELEMENTS:
            raise ValueError(f"stream {stream} with {n} elements: streams are 0..15 with at most "
                             f"{MAX_STREAM_ELEMENTS} elements each")


def _chunks(counts: Sequence[tuple[int, int]], size: int):
    """``(offset, element count, pieces)`` per chunk of at most ``size`` elements of the concatenated
    streams."""
    pieces, at, room = [], 0, size
    for stream, n in counts:
        j = 0
        while j < n:
            take = min(n - j, room)
            pieces.append((stream, j, take))
            j, room = j + take, room - take
            if room == 0:
                yield at, size, pieces
                at, pieces, room = at + size, [], size
    if pieces:
        yield at, size - room, pieces


def normal(seed: int, counts: Sequence[tuple[int, int]], device: str | torch.device = "cpu") -> torch.Tensor:
    """float32 ``[sum of n]``: the first ``n`` numbers of each ``(stream, n)`` of ``counts``, laid end to end
    (split it with ``torch.split``). Each number is approximately standard normal (Irwin–Hall of 4, see the
    module docstring) and depends only on ``(seed, stream, its index in the stream)``: the same bits on every
    device, whatever the chunking. Raises ValueError for a stream outside 0..15 or over
    :data:`MAX_STREAM_ELEMENTS` elements."""
    _check(counts)
    device = torch.device(device)
    total = sum(n for _, n in counts)
    out = torch.empty(total, dtype=torch.float32, device=device)
    if total == 0:
        return out
    size = min(total, CHUNK) if device.type == "cpu" else total
    k = _key_tensors(seed)
    w = torch.empty((2, size), dtype=torch.int32, device=device)
    tmp = torch.empty_like(w)
    scale = _c(SCALE, torch.float32)
    for at, m, pieces in _chunks(counts, size):
        wm, tm, o = (w, tmp, out) if m == total else (w[:, :m], tmp[:, :m], out[at:at + m])
        _words(k, pieces, wm, tm)
        torch.bitwise_right_shift(wm, _c(10), out=tm)  # high 22 bits, signed: [-2**21, 2**21)
        wm.bitwise_and_(_c(0x3FF))
        wm.bitwise_left_shift_(_c(12))  # low 10 bits, times 2**12: [0, 2**22)
        tm.add_(wm)  # X_r, in [-2**21, 3 * 2**21)
        t0, t1 = tm.unbind(0)
        torch.sub(t0, t1, out=o)  # Z = X_0 - X_1, computed in int32, stored as float32: exact, |Z| < 2**23
        o.mul_(scale)
    return out


def below(seed: int, stream: int, bounds: torch.Tensor) -> torch.Tensor:
    """int64 like ``bounds`` (positive int64, at most ``2**31``): element ``i`` is ``floor(u_i * bounds[i])``
    for a uniform ``u_i = (w & 0x7FFFFFFF) / 2**31`` from word 0 of index ``i`` of ``stream``; on
    ``bounds.device``, the same bits on every device."""
    n = bounds.numel()
    _check([(stream, n)])
    w = torch.empty((2, n), dtype=torch.int32, device=bounds.device)
    if n:
        _words(_key_tensors(seed), [(stream, 0, n)], w, torch.empty_like(w))
    u = w[0].long().bitwise_and_(0x7FFFFFFF)
    return u.mul_(bounds.reshape(-1)).bitwise_right_shift_(31).reshape(bounds.shape)


__all__ = ["CHUNK", "DOMINANT", "KEYS", "MAX_STREAM_ELEMENTS", "QUERY", "SCALE", "SINKS", "VALUES", "below",
           "keys", "normal", "splitmix64"]
