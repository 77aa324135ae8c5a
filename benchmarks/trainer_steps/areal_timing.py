"""One AReaL PPO update (PPOActor.ppo_update: the FSDP2 engine's train_batch forward, backward and
optimizer step) with AReaL's own FSDPPPOActor and with gspo_kernels' FusedFSDPPPOActor, on the same
tiny random Qwen3 with V = 32768 (the lm_head and its logits dominate): median time and peak
memory beyond the inputs. Run in the AReaL environment (scripts/test_areal.sh makes it):

    .venv-areal/bin/python benchmarks/trainer_steps/areal_timing.py [--rows 8 --completion 256
        --vocab 32768 --dtype bf16 --reps 5] [--vocab-range]

GSPO (`importance_sampling_level: sequence`), one micro-batch, AReaL's defaults otherwise; dtype is
AReaL's `actor.dtype` (the FSDP2 compute dtype; float32 master weights either way). Each actor runs
in a fresh process on a one-rank gloo group; time and memory as step_timing.py takes them.
tests/integrations/areal_tests checks the same update's numbers against AReaL's own.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

from gspo_kernels.bench.ports import free_port
from step_timing import MMAP_ENV, measure_step, print_table

PROMPT = 32


def _save_model(path: str, vocab: int) -> None:
    import torch
    import transformers

    from gspo_kernels.testing.tiny import tiny_tokenizer

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4096, pad_token_id=60, eos_token_id=61,
                                      bos_token_id=63, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def _batch(rows: int, completion: int, vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    length = PROMPT + completion
    batch = []
    for _ in range(rows):
        loss_mask = torch.zeros(1, length, dtype=torch.int32)
        loss_mask[:, PROMPT:] = 1
        batch.append(dict(input_ids=torch.randint(0, vocab, (1, length), generator=g),
                          attention_mask=torch.ones(1, length, dtype=torch.bool), loss_mask=loss_mask,
                          logprobs=torch.randn(1, length, generator=g) * 0.1 - 10.0,
                          rewards=torch.randn(1, generator=g), versions=torch.zeros(1, length, dtype=torch.int32)))
    return batch


def _measure(kind: str, args) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPPPOActor

    from gspo_kernels.integrations.areal import FusedFSDPPPOActor

    cls = FSDPPPOActor if kind == "areal" else FusedFSDPPPOActor
    FusedFSDPPPOActor.log_vocab_range = args.vocab_range
    config = PPOActorConfig(experiment_name="bench", trial_name="t", path=args.model, attn_impl="sdpa",
                            dtype={"bf16": "bfloat16", "float32": "float32"}[args.dtype],
                            optimizer=OptimizerConfig(lr=1e-6), backend="fsdp:d1", ppo_n_minibatches=1,
                            mb_spec=MicroBatchSpec(n_mbs=1), importance_sampling_level="sequence")
    actor = cls(config)
    actor.create_process_group()
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=args.rows, train_batch_size=args.rows))
    advantages = actor.compute_advantages(_batch(args.rows, args.completion, args.vocab))

    def update():
        actor.ppo_update(copy.deepcopy(advantages))

    return {"actor": cls.__name__, **measure_step(update, args.reps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", choices=("bf16", "float32"), default="bf16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab-range", action="store_true",
                        help="the fused actor logs vocab_min/max_logits (log_vocab_range: one more head product)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_measure(args.child, args)))
        return
    model = tempfile.mkdtemp()
    _save_model(model, args.vocab)
    env = {**os.environ, **MMAP_ENV, "GSPO_KERNELS_QUIET": "1"}
    results = []
    for kind in ("areal", "gspo_kernels"):
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--model", model, "--port", str(free_port()),
                              "--rows", str(args.rows), "--completion", str(args.completion), "--vocab",
                              str(args.vocab), "--dtype", args.dtype, "--reps", str(args.reps)]
                             + (["--vocab-range"] if args.vocab_range else []),
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            sys.exit(f"{kind} failed:\n{out.stderr[-4000:]}")
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    tokens = args.rows * (PROMPT + args.completion)
    logits_mib = tokens * args.vocab * 4 / 2**20
    print_table(f"AReaL PPO update (GSPO, one micro-batch), tiny Qwen3 (hidden 64, 2 layers), V = {args.vocab}, "
                f"{args.rows} x ({PROMPT} + {args.completion}) tokens, actor.dtype {args.dtype} (float32 log-softmax "
                f"of the logits alone: {logits_mib:.0f} MiB){', log_vocab_range' if args.vocab_range else ''}", "actor", results)


if __name__ == "__main__":
    main()
