"""TP merge precision against one process: log-probs and entropies of float32 logits randn + c,
V = 1000 split over 2 gloo ranks, against the float64 log-softmax of the same float32 logits.
Run: python benchmarks/cpu/tp_precision_probe.py (about 20 s on 2 cores)."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gspo_kernels as gk


def worker(rank, init, scale):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(0)
    V = 1000
    x = torch.randn(64, V, generator=g, dtype=torch.float64) + scale
    t = torch.randint(0, V, (64,), generator=g)
    ref = torch.log_softmax(x.float().double(), -1)
    ref_lp = ref.gather(-1, t[:, None]).squeeze(-1)
    ref_h = -(ref.exp() * ref).sum(-1)
    xs = x.float()
    half = V // 2
    part = xs[:, :half] if rank == 0 else xs[:, half:]
    lp, h = gk.selective_log_softmax(part.contiguous(), t, return_entropy=True, backend="cpu", tp_group=dist.group.WORLD, vocab_start=0 if rank == 0 else half)
    lp1, h1 = gk.selective_log_softmax(xs, t, return_entropy=True, backend="cpu")
    if rank == 0:
        print(f"scale {scale:g}: tp logp err {(lp.double()-ref_lp).abs().max():.2e} entropy err {(h.double()-ref_h).abs().max():.2e} | one process logp err {(lp1.double()-ref_lp).abs().max():.2e} entropy err {(h1.double()-ref_h).abs().max():.2e}")
    dist.barrier(); dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort a normal exit after the group is gone

if __name__ == "__main__":
    for scale in (0, 30, 1e3, 1e4):
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(worker, args=(os.path.join(d, "i"), scale), nprocs=2)
