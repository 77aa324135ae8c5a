"""Interleaved A/B timing of fused linear on a CPU against the trainer's own path, forward +
backward, the bench's default problem (N = 2048 in 4 sequences of 512, H = 512, V = 32768, bf16;
`bench/linear.py`'s problem). The base is what a trainer runs: the lm_head in the inputs' dtype
(bf16 where the CPU multiplies it natively, float32 otherwise: the bench's `materialized`), then
gk.gspo_loss on the logits. Each round runs every variant twice in turn (the second timed, the
allocator warm, as in a training loop), so that the machine's drifting speed hits them alike;
medians over rounds.

    variant            head      what runs
    trainer            full      lm_head matmul, then gspo_loss (every ratio's base)
    one_pass           full      fused_linear_gspo_loss, the one-pass schedule (the default here)
    two_pass           full      fused_linear_gspo_loss, schedule='two_pass'
    one_pass_fp32acc   full      one pass, weight_grad_fp32=True (d weight summed in float32)
    trainer_frozen     frozen    the trainer's path with weight.requires_grad=False (LoRA)
    one_pass_frozen    frozen    one pass with the frozen head (4NVH)

Run: python benchmarks/cpu/fused_linear_ab.py [rounds] [variant,...] (about 2 minutes at 7 rounds on
2 cores; default: all; the frozen variants' ratios are taken against trainer_frozen).
"""
import statistics
import sys
import time

import torch

import gspo_kernels as gk
from gspo_kernels.bench.linear import LinearShape, _native_matmul, make_linear_problem
from gspo_kernels.bench.problem import EPS_HIGH, EPS_LOW
from gspo_kernels.linear.products import cpu_has_native_bf16

SHAPE = LinearShape.parse("2048x512x32768")


def trainer(h, w, p):
    return gk.gspo_loss(_native_matmul(h, w), p.target_ids, p.old_logprobs, p.advantages, mask=p.mask,
                        eps_low=EPS_LOW, eps_high=EPS_HIGH)[0]


def fused(**linear):
    def loss(h, w, p):
        return gk.fused_linear_gspo_loss(h, w, p.target_ids, p.old_logprobs, p.advantages, mask=p.mask,
                                         eps_low=EPS_LOW, eps_high=EPS_HIGH, **linear)[0]
    return loss


VARIANTS = {
    "trainer": (trainer, False),
    "one_pass": (fused(schedule="one_pass"), False),
    "two_pass": (fused(schedule="two_pass"), False),
    "one_pass_fp32acc": (fused(schedule="one_pass", weight_grad_fp32=True), False),
    "trainer_frozen": (trainer, True),
    "one_pass_frozen": (fused(schedule="one_pass"), True),
}


def step(problem, loss_fn, frozen):
    h = problem.hidden.detach().clone().requires_grad_()
    w = problem.weight.detach().clone().requires_grad_(not frozen)

    def run():
        h.grad = w.grad = None
        loss_fn(h, w, problem).backward()
    return run


def main(rounds: int, chosen: list[str]) -> None:
    problem = make_linear_problem(SHAPE, torch.bfloat16, "cpu")
    variants = {name: VARIANTS[name] for name in (chosen or VARIANTS)}
    runs = {name: step(problem, fn, frozen) for name, (fn, frozen) in variants.items()}
    times = {name: [] for name in variants}
    for _ in range(rounds + 1):  # the first round warms up
        for name, run in runs.items():
            run()  # untimed: the timed run finds the allocator warm
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"N={SHAPE.tokens} (sequences of 512) H={SHAPE.hidden} V={SHAPE.vocab} bf16, {torch.get_num_threads()} "
          f"threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_has_native_bf16()}, "
          f"torch {torch.__version__}, {rounds} rounds")
    print("| variant | median ms | vs the trainer's path |\n|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values[1:])
        base = "trainer_frozen" if variants[name][1] else "trainer"
        ratio = f"{median / statistics.median(times[base][1:]):.2f}x" if base in times else "-"
        print(f"| {name} | {median * 1e3:.0f} | {ratio} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7, sys.argv[2].split(",") if len(sys.argv) > 2 else [])
