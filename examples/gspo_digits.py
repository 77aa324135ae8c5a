"""A whole GSPO training run on a CPU in a few minutes, with nothing downloaded.

    python examples/gspo_digits.py                 # writes gspo_digits_reward.png in the working directory

The task has a verifiable reward: the prompt is a target sum S (one token), and the policy
must answer with DIGITS digit tokens that add up to S. A response earns 0.5 x its share of
digit tokens, plus, when every token is a digit, 0.5 x (1 - |sum - S| / the largest sum).

The policy is a small causal LM built from a config (transformers' Llama, 2 layers, random
weights). Each step samples GROUP responses per prompt, turns the rewards into
group-normalised advantages, keeps the sampler's log-probs as the old log-probs, and then
takes a few optimiser steps on gspo_kernels' fused-linear GSPO loss (hidden states and the
lm_head weight in, no logits kept), with a KL penalty to the initial model. It logs reward,
clip fraction and KL per step, draws a progress bar, and plots the reward curve.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass

import torch

import gspo_kernels as gk

DIGITS = 3
MAX_SUM = 9 * DIGITS
BOS = 10  # token ids: 0-9 digits, 10 BOS, 11 + S the target sum S
VOCAB = 11 + MAX_SUM + 1


@dataclass
class Rollout:
    sequences: torch.Tensor  # (B, 2 + DIGITS): BOS, target, response
    response: torch.Tensor  # (B, DIGITS)
    old_logprobs: torch.Tensor  # (B, DIGITS) from the sampling pass
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)


def make_policy(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def reward(response: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    is_digit = response < 10
    all_digits = is_digit.all(dim=1)
    total = torch.where(is_digit, response, torch.zeros_like(response)).sum(dim=1)
    closeness = 1.0 - (total - target).abs().float() / MAX_SUM
    return 0.5 * is_digit.float().mean(dim=1) + 0.5 * torch.where(all_digits, closeness, torch.zeros_like(closeness))


@torch.no_grad()
def sample(policy, prompts: int, group: int, gen: torch.Generator) -> Rollout:
    targets = torch.randint(0, MAX_SUM + 1, (prompts,), generator=gen).repeat_interleave(group)
    seqs = torch.stack([torch.full_like(targets, BOS), 11 + targets], dim=1)
    logprobs = []
    for _ in range(DIGITS):
        logits = policy(seqs).logits[:, -1].float()
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        logprobs.append(torch.log_softmax(logits, -1).gather(1, token))
        seqs = torch.cat([seqs, token], dim=1)
    response = seqs[:, 2:]
    rewards = reward(response, targets)
    grouped = rewards.view(prompts, group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    return Rollout(seqs, response, torch.cat(logprobs, dim=1), rewards, advantages)


def response_hidden(model, sequences: torch.Tensor) -> torch.Tensor:
    """The hidden states that predict the response tokens: positions 1 .. 1 + DIGITS - 1."""
    hidden = model.model(sequences).last_hidden_state
    return hidden[:, 1:1 + DIGITS]


@torch.no_grad()
def reference_logprobs(ref, rollout: Rollout) -> torch.Tensor:
    return gk.fused_linear_selective_log_softmax(response_hidden(ref, rollout.sequences), ref.lm_head.weight,
                                                 rollout.response)


def progress(step: int, total: int, text: str) -> None:
    width = 24
    filled = width * step // total
    line = f"[{'#' * filled}{'.' * (width - filled)}] {step:3d}/{total} {text}"
    if sys.stdout.isatty():
        print("\r" + line, end="" if step < total else "\n", flush=True)
    else:
        print(line, flush=True)


def train(args) -> list[dict]:
    policy = make_policy(args.seed)
    ref = copy.deepcopy(policy).eval()
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    loss_fn = gk.FusedLinearGSPOLoss(level="sequence", eps_low=args.eps_low, eps_high=args.eps_high,
                                     beta=args.beta, loss_agg="seq-mean-token-mean")
    gen = torch.Generator().manual_seed(args.seed)
    history = []
    for step in range(1, args.steps + 1):
        policy.eval()
        rollout = sample(policy, args.prompts, args.group, gen)
        ref_logp = reference_logprobs(ref, rollout)
        policy.train()
        clip, kl = [], []
        for _ in range(args.updates):  # several updates per batch: the ratio moves off 1 and clipping acts
            loss, metrics = loss_fn(response_hidden(policy, rollout.sequences), policy.lm_head, rollout.response,
                                    rollout.old_logprobs, rollout.advantages, ref_logprobs=ref_logp)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            clip.append(float(metrics["clip_frac"]))
            kl.append(float(metrics["kl"]))
        record = {"step": step, "reward": float(rollout.rewards.mean()), "clip_frac": sum(clip) / len(clip),
                  "kl": sum(kl) / len(kl)}
        history.append(record)
        progress(step, args.steps, f"reward {record['reward']:.3f}  clip_frac {record['clip_frac']:.3f}  "
                                   f"kl {record['kl']:.4f}")
    return history


def plot(history: list[dict], path: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    rewards = [h["reward"] for h in history]
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, alpha=0.35, label="mean reward per step")
    ax.plot(steps, smooth, label=f"{window}-step average")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.set_title("GSPO (gspo_kernels) on digit sums, 2-layer LM, CPU")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="sampled responses per prompt")
    parser.add_argument("--updates", type=int, default=2, help="optimiser steps per sampled batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eps-low", type=float, default=3e-4, help="GSPO's clip range (the paper's values)")
    parser.add_argument("--eps-high", type=float, default=4e-4)
    parser.add_argument("--beta", type=float, default=0.01, help="KL penalty to the initial model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="gspo_digits_reward.png",
                        help="reward-curve PNG, relative to the working directory ('' for none; the docs' copy is "
                             "examples/gspo_digits_reward.png)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    history = train(args)
    window = min(10, len(history))
    first = sum(h["reward"] for h in history[:window]) / window
    last = sum(h["reward"] for h in history[-window:]) / window
    print(f"mean reward: step 1 {history[0]['reward']:.3f}, first {window} steps {first:.3f}, last {window} steps "
          f"{last:.3f} ({args.steps} steps, seed {args.seed}, {time.perf_counter() - start:.0f} s)")
    if args.plot:
        plot(history, args.plot, window)
        print(f"wrote {args.plot}")
    return history


if __name__ == "__main__":
    main()
