"""Small calls of every CUDA kernel variant, for `compute-sanitizer --tool memcheck`.

Covers: 16-byte and scalar paths (V a multiple of 8 or not; a row start off 16 bytes),
warp-per-row and block-per-row (V <= 2048 or not), in place, strided rows, padding rows,
out-of-range targets outside the row mask, with and without the entropy term; and the packed
layout's segment ops (empty segments, segments longer than a block, k columns, a row count off
the block size, a cu_seqlens past the rows). Exits non-zero on a wrong value.
"""

import sys

import torch

import gspo_kernels  # noqa: F401  (registers torch.ops.gspo_kernels)

ops = torch.ops.gspo_kernels
# --device cpu runs the same cases on the C++ CPU kernels: the probe's own checks, tried without a GPU.
DEVICE = "cpu" if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu" else "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def one_case(vocab: int, dtype: torch.dtype, strided: bool, with_h: bool, softcap: float = 0.0,
             kept: bool = False) -> float:
    """The ops take inv_temperature = 1.1 (z = 1.1 x); softcap > 0: z = softcap * tanh(1.1 x);
    kept: a sampler's kept set, each row's logits above its median."""
    full = torch.randn(3, 6, vocab + (1 if strided else 0), device=DEVICE).to(dtype)
    logits = full[..., :vocab] if strided else full
    targets = torch.randint(0, vocab, (18,), device=DEVICE)
    targets[0], targets[1] = -100, vocab  # out of range: NaN log-prob, no read outside the row
    kept_min = logits.float().median(-1).values.reshape(18).contiguous() if kept else None
    if kept:  # targets inside the kept set: the log-prob check below stays a check
        targets = torch.where(targets >= 0, logits.float().reshape(18, vocab).argmax(-1), targets)
        targets[0], targets[1] = -100, vocab
    logp, entropy, lse = ops.token_stats(logits, targets, 1.1, softcap, kept_min)
    g = torch.randn(18, device=DEVICE)
    g[2:5] = 0  # padding rows
    h = torch.randn(18, device=DEVICE) if with_h else None
    if with_h:
        h[2:5] = 0  # padding rows carry neither gradient
    row_mask = torch.ones(18, dtype=torch.bool, device=DEVICE)
    row_mask[:2] = False  # the out-of-range targets sit outside the loss: zeros, never read
    grad = ops.logits_grad(logits, targets, lse, entropy, g, h, row_mask, 1.1, softcap, kept_min)
    inplace = logits.clone()
    ops.logits_grad_(inplace, targets, lse, entropy, g, h, row_mask, 1.1, softcap, kept_min)
    _sync()
    z = logits.double() * 1.1
    z = softcap * torch.tanh(z) if softcap > 0 else z
    if kept:
        z = torch.where(logits.float() < kept_min.reshape(logits.shape[:-1])[..., None], float("-inf"), z)
    ref = torch.log_softmax(z, -1).reshape(18, vocab)
    err = (logp[2:].double() - ref[torch.arange(2, 18), targets[2:]]).abs().max().item()
    rows = grad.reshape(18, vocab)
    checks = {"NaN log-prob at out-of-range targets": bool(torch.isnan(logp[:2]).all()),
              "in place equals out of place": torch.equal(grad, inplace),
              "zero gradient on masked and padding rows": bool(rows[:5].abs().sum() == 0)}
    for name, passed in checks.items():
        if not passed:
            print(f"sanitizer probe: V={vocab} {dtype} strided={strided}: {name}: no")
    return err if all(checks.values()) else float("inf")


def segment_cases() -> bool:
    ok = True
    for bounds in ([0, 0, 3, 3, 700, 1300, 1300], [0, 1], list(range(0, 1000, 3)) + [1000]):
        cu = torch.tensor(bounds, device=DEVICE)
        for shape in ((bounds[-1],), (bounds[-1], 3)):
            x = torch.randn(shape, device=DEVICE)
            want = torch.stack([x[a:b].double().sum(0) for a, b in zip(bounds, bounds[1:])]).float()
            ok &= bool(torch.allclose(ops.segment_sum(x, cu), want, rtol=1e-6, atol=1e-6))
        v = torch.randn(len(bounds) - 1, device=DEVICE)
        want = v.cpu().repeat_interleave(torch.tensor(bounds).diff())
        ok &= torch.equal(ops.segment_expand(v, cu, bounds[-1]).cpu(), want)
    past = torch.tensor([0, 2, 9], device=DEVICE)  # ends past the 5 rows: clamped, no read beyond
    ok &= ops.segment_sum(torch.arange(5.0, device=DEVICE), past).tolist() == [1.0, 9.0]
    ok &= ops.segment_expand(torch.tensor([7.0, 8.0], device=DEVICE), past, 5).tolist() == [7.0, 7.0, 8.0, 8.0, 8.0]
    _sync()
    return ok


def main() -> int:
    if not segment_cases():
        print("sanitizer probe: a segment op gave a wrong value")
        return 1
    worst = 0.0
    if "--once" in sys.argv:  # each op and path once: warp and block rows, aligned and not, soft-cap, kept set
        cases = [(64, torch.bfloat16, False, True, 0.0, True), (5000, torch.float32, True, False, 2.5, False),
                 (2049, torch.float16, False, True, 0.0, False)]
        for vocab, dtype, strided, with_h, softcap, kept in cases:
            worst = max(worst, one_case(vocab, dtype, strided, with_h, softcap, kept))
    else:
        for vocab in (7, 64, 2048, 2049, 5000, 32768):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for strided in (False, True):
                    worst = max(worst, one_case(vocab, dtype, strided, with_h=(vocab % 2 == 1),
                                                softcap=2.5 if strided else 0.0, kept=vocab in (64, 5000)))
    print(f"sanitizer probe: max |logp - ref| = {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
