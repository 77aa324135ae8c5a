"""The distributed code paths on NCCL, in a process group of one GPU: tp_group and cp_group
set, on the cuda and triton backends, logits and fused linear, padded and packed, against
the same backend with no group (verify.run_group_of_one). It proves the NCCL path runs: the
collectives, their dtypes and devices, the fix-up kernels. Prints one line per case; exits 1
on a failure. Run by check.sh."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import linear_operands, run_group_of_one


def main() -> int:
    # --cpu: the same run on gloo with the CPU backends, to try the script without a GPU.
    on_cpu = "--cpu" in sys.argv
    device, backends = ("cpu", ("cpu", "torch")) if on_cpu else ("cuda", ("cuda", "triton"))
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}"
        if on_cpu:
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        else:
            dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        failed = 0
        for backend in backends:
            for dtype in (torch.float32, torch.bfloat16):
                for packed in (False, True):
                    problem = make_problem(ProblemSpec(batch=4, seq_len=64, vocab=5000, dtype=dtype, device=device,
                                                       empty_sequence=True))
                    problem = problem.to_packed() if packed else problem
                    result = run_group_of_one(problem, backend, dist.group.WORLD, linear_operands(problem, 64))
                    if not on_cpu:
                        torch.cuda.synchronize()
                    name = f"{backend} {str(dtype).removeprefix('torch.')} {'packed' if packed else 'padded'}"
                    worst = max(result.errors.values())
                    print(f"{'ok  ' if result.passed else 'FAIL'} {dist.get_backend()} group of one, {name}: worst rel. error {worst:.2e}"
                          + ("" if result.passed else f"  {result.failures()}"))
                    failed += not result.passed
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
