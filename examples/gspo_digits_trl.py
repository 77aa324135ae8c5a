"""The digit-sum task of gspo_digits.py, trained by TRL's trainer through the gspo_kernels
drop-in, on a CPU, with nothing downloaded:

    python examples/gspo_digits_trl.py          # 10 s to a minute and a half on 2 cores, by the CPU's bf16

The only gspo_kernels line is the import of GRPOTrainer; everything else is TRL's usual set-up:
a dataset of prompts ("s17": answer with digits that sum to 17), a reward function on the
completion text, GRPOConfig with GSPO's sequence-level ratio and clip range. The model is a
2-layer Llama with random weights and a word-level tokenizer (d0..d9, s0..s27), built here.
"""

from __future__ import annotations

import argparse
import random
import tempfile

DIGITS = 3
MAX_SUM = 9 * DIGITS
WORDS = [f"d{i}" for i in range(10)] + [f"s{i}" for i in range(MAX_SUM + 1)]


def digit_sum_reward(prompts, completions, **kwargs):
    """0.5 x the share of digit words among the first DIGITS, plus 0.5 x closeness of their sum
    to the target when all are digits (the reward of gspo_digits.py)."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        target = int(prompt.split()[-1][1:])
        words = completion.split()[:DIGITS]
        digits = [int(w[1:]) for w in words if w.startswith("d")]
        score = 0.5 * len(digits) / DIGITS
        if len(digits) == DIGITS:
            score += 0.5 * (1 - abs(sum(digits) - target) / MAX_SUM)
        rewards.append(score)
    return rewards


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="optimiser steps (a generation batch every 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import datasets
    import trl

    from gspo_kernels.testing.tiny import tiny_llama, tiny_tokenizer
    from gspo_kernels.integrations.trl import GRPOTrainer

    tokenizer = tiny_tokenizer(WORDS)
    model = tiny_llama(vocab=len(WORDS) + 4, hidden=64, seed=args.seed, words=len(WORDS))
    rng = random.Random(args.seed)
    prompts = datasets.Dataset.from_dict({"prompt": [f"s{rng.randint(0, MAX_SUM)}" for _ in range(4096)]})
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, learning_rate=3e-3, per_device_train_batch_size=64,
        num_generations=8, max_completion_length=DIGITS, importance_sampling_level="sequence", loss_type="grpo",
        epsilon=3e-4, epsilon_high=4e-4, num_iterations=2, beta=0.0, use_cpu=True, bf16=False, report_to=[],
        logging_steps=1, save_strategy="no", seed=args.seed, disable_tqdm=False)
    trainer = GRPOTrainer(model=model, reward_funcs=digit_sum_reward, args=config, train_dataset=prompts,
                          processing_class=tokenizer)
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    window = min(10, len(rewards))
    print(f"mean reward: first {window} generation batches {sum(rewards[:window]) / window:.3f}, last {window} "
          f"{sum(rewards[-window:]) / window:.3f} ({len(rewards)} batches, {args.steps} steps, seed {args.seed})")
    return rewards


if __name__ == "__main__":
    main()
