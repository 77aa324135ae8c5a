"""Where the fused-linear time goes on a GPU: the chunked path's (and the tile kernels') CUDA
kernels by total time in one forward + backward, the same at other chunk sizes, and the four
ways of forming one of its products (16-bit operands with a float32 result, a 16-bit result
upcast, float32 with TF32, float32 without) at the shapes the path multiplies.

    python benchmarks/gpu/linear_profile.py [--tokens 16384] [--hidden 4096] [--vocab 151936]

Prints tables only; the figures go to RESULTS.md with the date and the GPU by hand.
"""

from __future__ import annotations

import argparse
import sys

import torch

import gspo_kernels as gk
from cuda_graph import median_ms  # this folder's script (the script's folder is on sys.path)
from gspo_kernels.linear import default_chunk_rows


def _ms(fn, reps: int = 5) -> float:
    fn()  # warm-up: Triton's compilation, cuBLAS's heuristics, the allocator
    return median_ms(fn, reps, "cuda")


def _problem(tokens: int, hidden: int, vocab: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda", generator=gen)).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens // 1024, 1024), device="cuda", generator=gen)
    old = -torch.rand(targets.shape, device="cuda", generator=gen) * 12
    adv = torch.randn(targets.shape[0], device="cuda", generator=gen)
    return h, w, targets, old, adv


def _step(h, w, targets, old, adv, **options):
    def run():
        h.grad = w.grad = None
        loss, _ = gk.fused_linear_gspo_loss(h.view(*targets.shape, -1), w, targets, old, adv, **options)
        loss.backward()
    return run


def profile_kernels(run, title: str, top: int = 12) -> None:
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    print(f"\n{title}: {total / 1e3:.1f} ms of GPU kernels")
    print("| kernel | calls | ms | share |\n|---|---|---|---|")
    for e in events[:top]:
        print(f"| {e.key[:90]} | {e.count} | {e.device_time_total / 1e3:.1f} | {e.device_time_total / total:.0%} |")


def product_forms(tokens: int, hidden: int, vocab: int, chunk: int) -> None:
    width = max(1, chunk * vocab // tokens)
    shapes = {"forward chunk  [chunk,H]x[H,V]": (chunk, hidden, vocab, False),
              "logits block   [N,H]x[H,Vb]": (tokens, hidden, width, False),
              "d hidden       [N,Vb]x[Vb,H]": (tokens, width, hidden, False),
              "d weight       [Vb,N]x[N,H] (A transposed)": (width, tokens, hidden, True)}
    print(f"\nproducts at chunk = {chunk} (vocab block {width}): ms, and TFLOP/s")
    print("| product | bf16 -> fp32 (out_dtype) | bf16 -> bf16 .float() | fp32 TF32 | fp32 |\n|---|---|---|---|---|")
    for name, (m, k, n, transposed) in shapes.items():
        a = torch.randn(k, m, device="cuda").bfloat16().t() if transposed else torch.randn(m, k, device="cuda").bfloat16()
        b = torch.randn(k, n, device="cuda").bfloat16()
        af, bf = a.float(), b.float()
        cells = []
        for form in ("out_dtype", "upcast", "tf32", "fp32"):
            torch.backends.cuda.matmul.allow_tf32 = form == "tf32"
            if form == "out_dtype":
                fn = lambda: torch.mm(a, b, out_dtype=torch.float32)  # noqa: E731
            elif form == "upcast":
                fn = lambda: (a @ b).float()  # noqa: E731
            else:
                fn = lambda: af @ bf  # noqa: E731
            try:
                ms = _ms(fn)
                cells.append(f"{ms:.2f} ({2 * m * k * n / ms / 1e9:.0f})")
            except (RuntimeError, TypeError) as error:
                cells.append(f"error: {str(error)[:40]}")
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunks", default="default,1024,2048", help="chunk sizes of the fused contender")
    parser.add_argument("--no-profile", action="store_true", help="the timings only: no kernel tables, no products")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIPPED: needs a CUDA GPU")
        return 0
    tokens, hidden, vocab = args.tokens, args.hidden, args.vocab
    h, w, targets, old, adv = _problem(tokens, hidden, vocab)
    flops6 = 6 * tokens * hidden * vocab

    def materialized():
        h.grad = w.grad = None
        logits = h.view(*targets.shape, -1) @ w.t()
        loss, _ = gk.gspo_loss(logits, targets, old, adv)
        loss.backward()

    print(f"N = {tokens}, H = {hidden}, V = {vocab}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| contender | fwd+bwd ms | TFLOP/s (6NVH) |\n|---|---|---|")
    runs = {"materialized": materialized}
    default_chunk = default_chunk_rows(tokens, vocab, h.device)
    for chunk in args.chunks.split(","):
        name = f"fused chunk {default_chunk} (default)" if chunk == "default" else f"fused chunk {chunk}"
        runs[name] = _step(h, w, targets, old, adv, chunk_size=None if chunk == "default" else int(chunk))
    runs["fused_tiles"] = _step(h, w, targets, old, adv, fused=True)
    for name, run in runs.items():
        try:
            ms = _ms(run, reps=3)
            print(f"| {name} | {ms:.1f} | {flops6 / ms / 1e9:.0f} |", flush=True)
        except torch.OutOfMemoryError:
            print(f"| {name} | out of memory | - |")
            torch.cuda.empty_cache()
    if args.no_profile:
        return 0
    profile_kernels(runs["materialized"], "materialized")
    profile_kernels(_step(h, w, targets, old, adv), f"fused, chunk {default_chunk} (the default)")
    profile_kernels(runs["fused_tiles"], "fused_tiles")
    h.grad = w.grad = None
    product_forms(tokens, hidden, vocab, default_chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
