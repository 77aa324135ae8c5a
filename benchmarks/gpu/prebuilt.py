"""The prebuilt extension's stamp (benchmarks/gpu/prebuild.sh): which interpreter, torch, CUDA,
GPU architecture and sources it was built from, so that check.sh uses it only where all match.

    python benchmarks/gpu/prebuilt.py stamp     # prints this interpreter's and tree's stamp
    python benchmarks/gpu/prebuilt.py install   # copies .prebuilt/'s extension into place if its
                                                # stamp matches; exit 1 (and why) otherwise
"""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PREBUILT = ROOT / ".prebuilt"
ARCH = "90"


def sources_hash() -> str:
    """sha256 over the files the extension is built from (csrc/ and setup.py), in path order."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("csrc/**/*"), ROOT / "setup.py"]):
        if path.is_file():
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def stamp() -> str:
    import torch

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"python={python} torch={torch.__version__.split('+')[0]} cuda={torch.version.cuda} arch={ARCH} " \
           f"sources={sources_hash()}"


def install() -> int:
    built = sorted(PREBUILT.glob("_C.cpython-*.so"))
    stamp_file = PREBUILT / "STAMP"
    if not built or not stamp_file.exists():
        print("prebuilt: none in .prebuilt/ (benchmarks/gpu/prebuild.sh makes it): building from source")
        return 1
    want, have = stamp_file.read_text().strip(), stamp()
    if want != have:
        print(f"prebuilt: stamp {want!r} does not match this machine's {have!r}: building from source")
        return 1
    target = ROOT / "gspo_kernels" / "backends" / built[0].name
    shutil.copy2(built[0], target.with_suffix(".tmp"))
    target.with_suffix(".tmp").rename(target)
    print(f"prebuilt: {built[0].name} installed ({want})")
    return 0


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "stamp":
        print(stamp())
    elif command == "install":
        sys.exit(install())
    else:
        sys.exit(__doc__)
