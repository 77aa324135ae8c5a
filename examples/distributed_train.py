"""GSPO training with the lm_head split over ranks (tensor parallel) or the tokens split over
ranks (context parallel), on CPUs with gloo:

    torchrun --standalone --nproc-per-node 2 examples/distributed_train.py --split tp
    torchrun --standalone --nproc-per-node 2 examples/distributed_train.py --split cp

A tiny per-token model (embedding, MLP) feeds fused_linear_gspo_loss: no rank ever holds
the logits. With --split tp each rank owns a contiguous slice of the lm_head's rows (the
vocab) and d hidden comes back summed over the ranks, so the replicated body gets the same
gradient everywhere. With --split cp each rank owns a contiguous part of every sequence's
tokens; the loss sums per-sequence statistics over the ranks, and each rank's parameter
gradients are its tokens' share, summed here with one all_reduce. (A real CP model also
needs attention across the parts, ring or Ulysses; this body has none.)

Every rank prints nothing but rank 0, which logs the loss, the clip fraction, and the
advantage-weighted mean log-prob of the responses (it rises as the policy learns to favour
the sequences with positive advantage), then checks that the replicated parameters agree
on every rank.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import gspo_kernels as gk
from gspo_kernels.testing.problem_split import context_part, even_parts


class TinyBody(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return x + self.mlp(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("tp", "cp"), default="tp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights and data on every rank
    body = TinyBody(args.vocab, args.hidden)
    full_head = torch.randn(args.vocab, args.hidden) * 0.05
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = torch.zeros(args.batch, args.seq_len, dtype=torch.bool)
    mask[:, args.seq_len // 4:] = True  # the response; the rest is the prompt
    advantages = torch.randn(args.batch)
    advantages = (advantages - advantages.mean()) / advantages.std()

    split = {}
    if args.split == "tp":
        v_start, v_stop = even_parts(args.vocab, world)[rank]
        head = torch.nn.Parameter(full_head[v_start:v_stop].clone())
        split = {"tp_group": dist.group.WORLD, "vocab_start": v_start}
        gk.distributed.check_vocab_split(dist.group.WORLD, v_stop - v_start, v_start, vocab_size=args.vocab)
    else:
        head = torch.nn.Parameter(full_head.clone())
        part = context_part(rank, world, args.batch, args.seq_len)
        t_start, t_stop = part.columns
        inputs, targets, mask = inputs[:, t_start:t_stop], targets[:, t_start:t_stop], mask[:, t_start:t_stop]
        split = {"cp_group": dist.group.WORLD}
    params = list(body.parameters()) + [head]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    options = dict(level="sequence", eps_low=0.05, eps_high=0.05, chunk_size=64, **split)

    def weighted_logp(logp: torch.Tensor) -> torch.Tensor:
        """sum_i A_i * mean_t logp_it over the whole batch (summed over the cp parts)."""
        per_seq = torch.stack([(logp * mask).sum(1), mask.sum(1).float()])
        if args.split == "cp":
            dist.all_reduce(per_seq)
        return (advantages * per_seq[0] / per_seq[1].clamp(min=1)).sum()

    first = None
    for step in range(args.steps):
        if step % 2 == 0:  # a fresh rollout batch: old log-probs from the current policy
            with torch.no_grad():
                old = gk.fused_linear_selective_log_softmax(
                    body(inputs), head, targets, mask=mask, chunk_size=64,
                    **{k: v for k, v in split.items() if k != "cp_group"})
        loss, metrics = gk.fused_linear_gspo_loss(body(inputs), head, targets, old, advantages, mask=mask, **options)
        optimizer.zero_grad()
        loss.backward()
        if args.split == "cp":  # each rank's tokens gave their share of every parameter's gradient
            for p in params:
                dist.all_reduce(p.grad)
        optimizer.step()
        score = weighted_logp(metrics["token_logprobs"]).item()
        first = score if first is None else first
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():+.5f}  clip_frac {metrics['clip_frac'].item():.3f}  "
                  f"sum_i A_i mean logp_i {score:+.3f}", flush=True)

    # The replicated parameters must agree on every rank (the tp head slices differ by design).
    shared = torch.cat([p.detach().reshape(-1) for p in (body.parameters() if args.split == "tp" else params)])
    spread = shared.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    lowest = shared.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    gap = (spread - lowest).abs().max().item()
    if rank == 0:
        print(f"advantage-weighted log-prob: {first:+.3f} -> {score:+.3f} over {args.steps} steps")
        print(f"replicated parameters: largest difference between ranks {gap:.3g} "
              f"({'in sync' if gap == 0 else 'OUT OF SYNC'})", flush=True)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    if gap != 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
