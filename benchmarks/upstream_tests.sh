#!/usr/bin/env bash
# Unpacks the test files of vLLM's pinned release (tests/kernels/attention/ of the vllm-0.33.0 source distribution
# on PyPI, its sha256 checked against the index) into .upstream/vllm-0.33.0/ (ignored: the project copies no
# upstream tests). `kvfuzz bench upstream --tree .upstream/vllm-0.33.0` and benchmarks/upstream_suites.sh run them.
# Usage: bash benchmarks/upstream_tests.sh [DEST]   (default .upstream/vllm-0.33.0; PY: the python to use)
set -euo pipefail
DEST=${1:-.upstream/vllm-0.33.0}
PY=${PY:-python3}
"$PY" - "$DEST" <<'PYEOF'
import hashlib, io, json, sys, tarfile, urllib.request
from pathlib import Path

dest, version = Path(sys.argv[1]), "0.33.0"
name = f"vllm-{version}.tar.gz"
req = urllib.request.Request("https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=120))["files"]
entry = next(f for f in files if f["filename"] == name)
data = urllib.request.urlopen(entry["url"], timeout=600).read()
if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
    sys.exit(f"upstream_tests: {name}: sha256 differs from PyPI's index")
prefix = f"vllm-{version}/tests/kernels/attention/"
n = 0
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    for m in tar.getmembers():
        if m.isfile() and m.name.startswith(prefix) and m.name.endswith(".py"):
            out = dest / m.name[len(f"vllm-{version}/"):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(m).read())
            n += 1
print(f"upstream_tests: {n} files of {name} (tests/kernels/attention) in {dest}")
PYEOF
