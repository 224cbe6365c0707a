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
