"""Rewrites a ray wheel without the parts a single-process verl actor never runs, so that it
fits in the 64 MiB working tree that travels to the GPU machine (the whole cp312 wheel is 76 MiB).

    python benchmarks/gpu/wheel_trim.py .whl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl

verl's modules `import ray` at the top (the worker base class, the decorators), so the package
must import; benchmarks/trainer_steps/parity.py never starts a Ray cluster, so the cluster's own
executables (gcs_server, raylet: ray/core/src/), the Java jars (ray/jars/) and the dashboard's web
client (ray/dashboard/client/) are dropped, with their RECORD lines. `import ray` loads
ray/_raylet.so, which is kept. The wheel is rewritten in place under its own name."""

from __future__ import annotations

import os
import sys
import zipfile

DROPPED = ("ray/jars/", "ray/core/src/", "ray/dashboard/client/")


def trim(path: str) -> tuple[int, int]:
    """Rewrites `path` without DROPPED; returns its size before and after, in bytes."""
    before = os.path.getsize(path)
    tmp = path + ".trimmed"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(DROPPED):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not line.startswith(DROPPED)]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)
    return before, os.path.getsize(path)


if __name__ == "__main__":
    for wheel in sys.argv[1:]:
        old, new = trim(wheel)
        print(f"{os.path.basename(wheel)}: {old / 2**20:.1f} MiB -> {new / 2**20:.1f} MiB")
