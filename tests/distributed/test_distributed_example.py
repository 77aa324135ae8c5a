"""examples/distributed_train.py under torchrun (2 gloo processes): it runs, learns, keeps the
replicated parameters in sync, and its tp and cp runs, the same whole problem cut two ways,
follow the same trajectory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "distributed_train.py"


def _run(split: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
           "--split", split, "--steps", "6"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_example_learns_in_sync_and_splits_agree():
    scores = {}
    for split in ("tp", "cp"):
        out = _run(split)
        assert "(in sync)" in out, out
        first, last = (float(x) for x in re.search(r"log-prob: ([-+.\d]+) -> ([-+.\d]+)", out).groups())
        assert last > first + 0.05, out
        scores[split] = [float(x) for x in re.findall(r"mean logp_i ([-+.\d]+)", out)]
        assert len(scores[split]) == 6, out
    assert scores["tp"] == pytest.approx(scores["cp"], abs=2e-3)
