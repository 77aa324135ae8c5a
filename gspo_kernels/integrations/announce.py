"""The drop-ins' one line per process that says they run fused, and on which path (a fallback
speaks for itself, with a warning). Off with GSPO_KERNELS_QUIET=1 in the environment. env_flag:
how the drop-ins read such switches."""

from __future__ import annotations

import os
import sys

QUIET_ENV = "GSPO_KERNELS_QUIET"
_said: set[str] = set()


def env_flag(name: str) -> bool:
    """A drop-in's switch in the environment: 1, true, yes or on."""
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def announce_fused(line: str) -> None:
    """Prints `gspo_kernels: <line>` to stderr the first time this process asks for it."""
    if line in _said or env_flag(QUIET_ENV):
        return
    _said.add(line)
    print(f"gspo_kernels: {line} (once per process; {QUIET_ENV}=1 silences it)", file=sys.stderr, flush=True)
