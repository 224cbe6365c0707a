"""Deliberately broken kernels for testing the campaign machinery (loaded as user adapters by path).

CrashingSdpa kills its process with SIGSEGV on batches of three or more sequences; HangingSdpa sleeps
forever on a decode sequence whose ctx_len is 3 mod 7. Both are correct otherwise (torch SDPA)."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
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


class SilentOnUndeclaredHeadSizes(SdpaPaged):
    """Declares head sizes 32/64/128 and, for any other head size, returns zeros instead of raising."""

    name = "planted.silent_on_undeclared_head_sizes"
    description = "SDPA that computes garbage for undeclared head sizes without an error"

    def run(self, call):
        out = super().run(call)
        if out.shape[-1] not in self.capabilities.head_sizes:
            out.zero_()
        return out
