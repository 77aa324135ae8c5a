"""Checks batch_invariant=True on a device at a real size: probe rows alone against the same rows
inside batches of other rows (each at another offset), for each path; then two runs of the loss,
bitwise. Prints one line per (path, batch) and exits 1 on any difference.

    python benchmarks/gpu/batch_invariance_probe.py --device cuda --paths cuda,triton,tiles \\
        --sizes 1024,4096,16384 --hidden 4096 --vocab 151936

A path is a backend of the chunked path (cuda, triton, cpu, torch) or `tiles` (fused=True).
The probe rows get per-row upstream gradients, so their `d hidden` rows must match too.
"""

from __future__ import annotations

import argparse
import sys

import torch

import gspo_kernels as gk

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _path_options(path: str) -> dict:
    return {"backend": "triton", "fused": True} if path == "tiles" else {"backend": path}


def _stats(path, hidden, weight, targets, coef):
    """(logp, entropy, d hidden) with the upstream gradient coef[row] for (logp, entropy)."""
    leaf = hidden.detach().clone().requires_grad_()
    logp, entropy = gk.fused_linear_selective_log_softmax(leaf, weight, targets, return_entropy=True,
                                                          batch_invariant=True, **_path_options(path))
    (logp * coef[:, 0] + entropy * coef[:, 1]).sum().backward()
    return logp.detach(), entropy.detach(), leaf.grad


def _rows(n, hidden_size, vocab, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = (torch.randn(n, hidden_size, generator=gen, device=device) * 0.5).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen, device=device)
    coef = torch.rand(n, 2, generator=gen, device=device) + 0.1
    return hidden, targets, coef


def check_rows(args, path, weight) -> bool:
    device, dtype = args.device, DTYPES[args.dtype]
    probe = _rows(args.probe_rows, args.hidden, args.vocab, dtype, device, seed=1)
    alone = [_stats(path, probe[0][i:i + 1], weight, probe[1][i:i + 1], probe[2][i:i + 1])
             for i in range(args.probe_rows)]
    alone = [torch.cat(parts) for parts in zip(*alone)]
    ok = True
    for size in args.sizes:
        others = _rows(size - args.probe_rows, args.hidden, args.vocab, dtype, device, seed=size)
        at = (size - args.probe_rows) // 3  # the probe rows in the middle of the batch
        batch = [torch.cat([o[:at], p, o[at:]]) for o, p in zip(others, probe)]
        got = _stats(path, batch[0], weight, batch[1], batch[2])
        same = [torch.equal(g[at:at + args.probe_rows], a) for g, a in zip(got, alone)]
        worst = max(float((g[at:at + args.probe_rows].float() - a.float()).abs().max()) for g, a in zip(got, alone))
        print(f"{path:7s} batch {size:6d}: logp/entropy/d hidden bitwise equal to the rows alone: {same} "
              f"(max |diff| {worst:.3g})", flush=True)
        ok &= all(same)
        del batch, got, others
    return ok


def check_runs(args, path, weight) -> bool:
    device, dtype = args.device, DTYPES[args.dtype]
    n = min(args.sizes)
    hidden, targets, coef = _rows(n, args.hidden, args.vocab, dtype, device, seed=2)
    with torch.no_grad():  # old log-probs near the current ones: the ratio is not all clipped
        logp = gk.fused_linear_selective_log_softmax(hidden, weight, targets, **_path_options(path))
    old = (logp + 1e-3 * torch.randn(n, device=device))[None]
    adv = torch.randn(1, device=device)
    runs = []
    for _ in range(2):
        h, w = hidden.clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss, _ = gk.fused_linear_gspo_loss(h[None], w, targets[None], old, adv, batch_invariant=True,
                                            **_path_options(path))
        loss.backward()
        runs.append((loss.detach(), h.grad, w.grad))
        del w
    same = [torch.equal(a, b) for a, b in zip(*runs)]
    print(f"{path:7s} two runs of the loss at N = {n}: loss/d hidden/d weight bitwise equal: {same}", flush=True)
    return all(same)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--paths", default="cuda,triton,tiles")
    p.add_argument("--sizes", default="1024,4096,16384")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--probe-rows", type=int, default=8)
    args = p.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    gen = torch.Generator(device=args.device).manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device=args.device) * 0.05).to(DTYPES[args.dtype])
    ok = True
    for path in args.paths.split(","):
        try:
            ok &= check_rows(args, path, weight)
            ok &= check_runs(args, path, weight)
        except Exception as exc:  # one path's failure must not hide the others'
            print(f"{path:7s} ERROR {type(exc).__name__}: {exc}", flush=True)
            ok = False
    print("batch invariance:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
