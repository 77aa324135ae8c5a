"""The C++ products over the engine's kept sets (csrc/cpu/kept_products.cpp) against their
speed knobs, on a CPU: the logits and d hidden over a grid of tile rows and weight-block bytes,
d weight over rows a block, each cell timed in interleaved rounds (every cell once a round, the
order reversed every other round), medians over rounds. The defaults the package picks
(linear/kept_products.py: row_tiles, block_rows) are marked. The bits do not depend on the knobs
(tests/loss/test_kept_tokens.py), only the time; run it on a CPU kind before changing them.

    .venv/bin/python benchmarks/cpu/kept_tiles.py [--rows 2048] [--hidden 512] [--vocab 32768] [--k 512]
        [--tiles 256,512,1024] [--blocks-kib 256,512,1024] [--block-rows 256,512,1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gspo_kernels.backends import native_backend
from gspo_kernels.linear.kept_products import block_rows, row_tiles


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _sets(rows: int, vocab: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct random ids a row, each row's ascending (as KeptTokens holds them)."""
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k].sort().values for _ in range(rows)])
    return torch.arange(0, rows * k + 1, k), ids.flatten()


def _cells(args, hidden, weight, offsets, ids, dx) -> dict[str, callable]:
    row_bytes = weight.shape[1] * weight.element_size()
    cells = {}
    for tile in _ints(args.tiles):
        for kib in _ints(args.blocks_kib):
            block_ids = max(1, (kib << 10) // row_bytes)
            cells[f"logits   tile {tile:5d} block {kib:5d} KiB"] = (
                lambda t=tile, b=block_ids: native_backend.kept_dots(hidden, weight, offsets, ids, t, b))
            cells[f"d hidden tile {tile:5d} block {kib:5d} KiB"] = (
                lambda t=tile, b=block_ids: native_backend.kept_hidden_grad(dx, weight, offsets, ids, t, b, True))
    for rows in _ints(args.block_rows):
        def d_weight(r=rows):
            grouped, group_offsets, group_rows = native_backend.kept_group(offsets, ids, dx, weight.shape[0], r)
            return native_backend.kept_weight_grad(grouped, hidden, group_offsets, group_rows, weight.shape[0], r)
        cells[f"d weight rows a block {rows:5d} (with its grouping)"] = d_weight
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--tiles", default="256,512,1024")
    parser.add_argument("--blocks-kib", default="256,512,1024")
    parser.add_argument("--block-rows", default="256,512,1024")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if native_backend.load_error() is not None:
        raise SystemExit(f"the native extension does not load: {native_backend.load_error()}")
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.05).to(torch.bfloat16)
    offsets, ids = _sets(args.rows, args.vocab, args.k, gen)
    dx = torch.randn(ids.numel(), generator=gen) * 1e-3
    cells = _cells(args, hidden, weight, offsets, ids, dx)
    times = {name: [] for name in cells}
    for fn in cells.values():
        fn()  # warm-up: first-touch pages, the threads
    for round_ in range(args.rounds):
        names = list(cells) if round_ % 2 == 0 else list(reversed(cells))
        for name in names:
            start = time.perf_counter()
            cells[name]()
            times[name].append(time.perf_counter() - start)
    tile_rows, block_ids = row_tiles(hidden, weight)
    default_kib = block_ids * args.hidden * hidden.element_size() >> 10
    print(f"N = {args.rows}, H = {args.hidden}, V = {args.vocab}, k = {args.k}, bf16, {torch.get_num_threads()} "
          f"threads; the defaults here: tile {tile_rows}, block {default_kib} KiB, rows a block {block_rows(hidden)}")
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts) * 1e3:7.1f} ms  (min {min(ts) * 1e3:.1f})")


if __name__ == "__main__":
    main()
