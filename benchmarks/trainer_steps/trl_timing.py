"""One TRL training step's loss (forward + backward of GRPOTrainer._compute_loss) with TRL's own
trainer and with the gspo_kernels drop-in, on the same tiny random Llama with V = 32768 (the
lm_head and its logits dominate): median time and peak memory beyond the inputs.

    python benchmarks/trainer_steps/trl_timing.py [--rows 8 --completion 256 --vocab 32768 --reps 5] [--lora]

--lora wraps the model in PEFT LoRA (r 8 on every projection, the lm_head frozen), as a
small-GPU user would: only the adapters train, and the head's gradient is not formed.

Each trainer runs in a fresh subprocess; time and memory as step_timing.py takes them. float32,
importance_sampling_level="sequence", loss_type="grpo", beta 0.04.

It times; parity_trl.py (run by parity.py) checks the same step's loss and gradients against
TRL's own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from step_timing import MMAP_ENV, measure_step, print_table


def _measure(kind: str, rows: int, completion: int, vocab: int, reps: int, lora: bool) -> dict:
    import torch
    import trl

    from gspo_kernels.testing.tiny import tiny_grpo_trainer, tiny_llama
    from gspo_kernels.integrations.trl import GRPOTrainer

    cls = trl.GRPOTrainer if kind == "trl" else GRPOTrainer
    model = tiny_llama(vocab=vocab, hidden=64)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trainer = tiny_grpo_trainer(cls, model, tempfile.mkdtemp(),
                                importance_sampling_level="sequence", loss_type="grpo",
                                max_completion_length=completion)
    trainer.beta = 0.04  # after construction: with beta > 0 there, TRL would load a reference model by name
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    gen = torch.Generator().manual_seed(0)
    prompt = 32
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    batch = {"prompt_ids": torch.randint(0, 60, (rows, prompt), generator=gen),
             "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
             "completion_ids": torch.randint(0, vocab, (rows, completion), generator=gen),
             "completion_mask": completion_mask, "advantages": torch.randn(rows, generator=gen),
             "num_items_in_batch": completion_mask.sum().float(),
             "old_per_token_logps": torch.randn(rows, completion, generator=gen) * 0.1 - 10.0,
             "ref_per_token_logps": torch.randn(rows, completion, generator=gen) * 0.1 - 10.0}

    def step():
        trainer.model.zero_grad(set_to_none=True)
        trainer._compute_loss(trainer.model, batch).backward()

    return {"trainer": kind, **measure_step(step, reps, settle=lambda: trainer.model.zero_grad(set_to_none=True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA r 8 on every projection, frozen lm_head")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child, args.rows, args.completion, args.vocab, args.reps, args.lora)))
        return
    env = {**os.environ, **MMAP_ENV}
    results = []
    for kind in ("trl", "gspo_kernels"):
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--rows", str(args.rows), "--completion",
                              str(args.completion), "--vocab", str(args.vocab), "--reps", str(args.reps)]
                             + (["--lora"] if args.lora else []),
                             capture_output=True, text=True, env=env, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_mib = args.rows * args.completion * args.vocab * 4 / 2**20
    adapted = ", PEFT LoRA r 8 on every projection (frozen lm_head)" if args.lora else ""
    print_table(f"TRL GRPOTrainer step (loss forward + backward), tiny Llama (hidden 64, 2 layers){adapted}, "
                f"V = {args.vocab}, {args.rows} x {args.completion} completion tokens, float32 (the logits alone: "
                f"{logits_mib:.0f} MiB)", "trainer", results)


if __name__ == "__main__":
    main()
