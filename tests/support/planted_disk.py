"""A disk that fills in the middle of a campaign, without mounting anything (tests/fuzz/campaign/test_disk_full.py):
loaded as a user adapter by path, this module is imported by the supervisor and by every worker, and patches both.

While the flag file named by KVFUZZ_PLANTED_FULL exists, the campaign's --out (KVFUZZ_PLANTED_OUT) is "full":
every ``os.replace`` into it fails with ENOSPC (how kvfuzz ends each atomic write: state.json, status.json,
summary.json, a reproducer's files; not with KVFUZZ_PLANTED_ONLY_STATVFS), and ``os.statvfs`` of it reports no
free block. The kernels (correct SDPA
otherwise, tests/support/planted_endings.py) create the flag on head size 64 — the disk fills as a failure is found;
without KVFUZZ_PLANTED_FULL (a rerun once there is space) nothing fills."""

import errno
import os
from pathlib import Path

from planted_endings import BAD_HEAD, _Planted

FLAG = os.environ.get("KVFUZZ_PLANTED_FULL")
OUT = os.environ.get("KVFUZZ_PLANTED_OUT")
#: set: only statvfs says the disk is full (the last bytes still take state.json)
ONLY_STATVFS = bool(os.environ.get("KVFUZZ_PLANTED_ONLY_STATVFS"))


def full() -> bool:
    return bool(FLAG) and Path(FLAG).exists()


def _inside_out(path) -> bool:
    return bool(OUT) and Path(os.path.abspath(path)).is_relative_to(os.path.abspath(OUT))


_real_replace, _real_statvfs = os.replace, os.statvfs


def _replace(src, dst, *args, **kwargs):
    if full() and _inside_out(dst) and not ONLY_STATVFS:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
    return _real_replace(src, dst, *args, **kwargs)


class _Full:
    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return 0 if name in ("f_bavail", "f_bfree") else getattr(self._real, name)


def _statvfs(path):
    st = _real_statvfs(path)
    return _Full(st) if full() and _inside_out(path) else st


os.replace, os.statvfs = _replace, _statvfs


class FillsOnFailure(_Planted):
    name = "planted.fills_on_failure"
    description = "a wrong result on head size 64; the disk fills as it is found"

    def misbehave(self, call) -> None:
        if FLAG:  # without a flag (a rerun once there is space) only the wrong result
            Path(FLAG).touch()

    def run(self, call):
        out = super().run(call)
        if call.kwargs["query"].shape[-1] == BAD_HEAD:
            out.add_(1.0)
        return out


class DiesOfFullLog(_Planted):
    name = "planted.dies_of_full_log"
    description = "on head size 64 the disk fills and the worker dies as Python does when it cannot flush its log"

    def misbehave(self, call) -> None:
        if FLAG:  # without a flag (a rerun once there is space) correct
            Path(FLAG).touch()
            os._exit(120)
