"""Small micro-batches on a GPU: one gspo_loss forward + backward launched eagerly against the same
call captured once in a CUDA graph and replayed, each as a fraction of the byte floor.

    python benchmarks/gpu/cuda_graph.py [--tokens 1024,2048,4096,16384] [--vocab 151936] [--json out.json]

The capture follows the pattern of docs/performance.md ("CUDA graphs"): static inputs, a few
warm-up calls on a side stream, then one captured call whose loss and logits gradient are
static outputs. Each replay must give exactly the eager call's loss and gradient (same kernels,
same order), which this script checks before it times anything. The byte floor is 3 N V 2 bytes
(bf16: two reads of the logits, one write of the gradient) over 4.3 TB/s, an H200's copy rate
counting read + write (a figure measured outside this repository; `python -m gspo_kernels bench`
measures the machine's own). `--device cpu` runs the eager half only, to check the script itself
where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import gspo_kernels as gk

H200_COPY_BYTES_PER_S = 4.3e12
SEQ_LEN = 1024


def _problem(tokens: int, vocab: int, device: str):
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    batch = max(1, tokens // SEQ_LEN)
    seq_len = tokens // batch
    logits = (torch.randn(batch, seq_len, vocab, generator=gen) * 2).to(device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    old = (logp + torch.randn(logp.shape, generator=gen).to(device) * 1e-3).float()
    advantages = torch.randn(batch, generator=gen).to(device)
    mask = (torch.rand(batch, seq_len, generator=gen) < 0.9).to(device)
    return logits.requires_grad_(), targets, old, advantages, mask


def _call(backend: str, logits, targets, old, advantages, mask):
    loss, _ = gk.gspo_loss(logits, targets, old, advantages, mask=mask, backend=backend)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, grad


def median_ms(fn, reps: int, device: str) -> float:
    """Median wall time of `fn` over `reps` calls (CUDA events on a GPU); linear_profile.py uses it too."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _capture(backend: str, inputs):
    """(graph, static loss, static grad) of one call on the static `inputs`.

    The logits leaf is made anew here: an autograd node of it made on the default stream and
    still alive (an eager call's loss) makes the captured backward wait on the default stream,
    which CUDA refuses during capture (cudaErrorStreamCaptureImplicit, seen on an H200 with
    torch 2.11)."""
    inputs = (inputs[0].detach().requires_grad_(), *inputs[1:])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: Triton's compilation and the allocator's first blocks
            _call(backend, *inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        loss, grad = _call(backend, *inputs)
    return graph, loss, grad


def run(tokens_list, vocab: int, backends, reps: int, device: str):
    rows, failures = [], []
    for tokens in tokens_list:
        inputs = _problem(tokens, vocab, device)
        floor_ms = 3 * tokens * vocab * 2 / H200_COPY_BYTES_PER_S * 1e3
        for backend in backends:
            eager_loss, eager_grad = (t.detach() for t in _call(backend, *inputs))
            eager_ms = median_ms(lambda: _call(backend, *inputs), reps, device)
            graph_ms = None
            if device == "cuda":
                graph, loss, grad = _capture(backend, inputs)
                graph.replay()
                torch.cuda.synchronize()
                if not (torch.equal(loss, eager_loss) and torch.equal(grad, eager_grad)):
                    failures.append(f"{backend} N={tokens}: replay differs from eager "
                                    f"(loss {loss.item()} vs {eager_loss.item()})")
                graph_ms = median_ms(graph.replay, reps, device)
                del graph
            rows.append(dict(backend=backend, tokens=tokens, vocab=vocab, eager_ms=eager_ms, graph_ms=graph_ms,
                             floor_ms=floor_ms))
            print(f"{backend:7s} N={tokens:6d} eager {eager_ms:8.3f} ms ({floor_ms / eager_ms:5.1%} of floor)"
                  + ("" if graph_ms is None else f"  graph {graph_ms:8.3f} ms ({floor_ms / graph_ms:5.1%} of floor)")
                  + f"  floor {floor_ms:.3f} ms", flush=True)
    return rows, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,2048,4096,16384")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--backends", default="cuda,triton")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu to check the eager half", file=sys.stderr)
        return 2
    rows, failures = run([int(t) for t in args.tokens.split(",")], args.vocab, args.backends.split(","), args.reps,
                         args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                           torch=torch.__version__, rows=rows, failures=failures), f, indent=1)
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
