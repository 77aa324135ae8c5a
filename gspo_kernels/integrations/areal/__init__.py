"""AReaL drop-in: the FSDP2 PPO actor with its log-prob and loss passes on gspo_kernels, from the
hidden states and the lm_head (no `[N, V]` logits).

One line in the entry script, before AReaL builds its engines:

    import gspo_kernels.integrations.areal as gk_areal
    gk_areal.use_fused_actor()        # PPOTrainer now builds FusedFSDPPPOActor (actor, reference, teacher)

or, in a loop that builds the actor itself, `FusedFSDPPPOActor(config=config.actor)` where it
built `FSDPPPOActor`. GSPO is AReaL's own key, `actor.importance_sampling_level: sequence`.
Which of AReaL's loss options run on gspo_kernels' loss: losses.py; what the actor refuses
(critics, tree training, Ulysses or tensor parallelism, vision models): actor.py. Tested against
AReaL 1.0.4 (`tests/integrations/areal_tests`), installed apart: `pip install --no-deps
areal==1.0.4` beside the `[areal]` extra (docs/trainers.md).
"""

from __future__ import annotations

from .actor import VOCAB_RANGE_ENV, FusedFSDPPPOActor


def use_fused_actor(log_vocab_range: bool | None = None) -> None:
    """Makes `from areal.engine import FSDPPPOActor` give FusedFSDPPPOActor in this process:
    AReaL's trainers import it there when they build the actor, the reference and the teacher. Under
    AReaL's single controller the workers get the class by its import path
    (gspo_kernels.integrations.areal.actor.FusedFSDPPPOActor), so they need only gspo_kernels
    installed. log_vocab_range (None: as the environment says): FusedFSDPPPOActor.log_vocab_range,
    AReaL's two logit-range statistics for one more forward product of the head; it is also
    written to GSPO_KERNELS_AREAL_VOCAB_RANGE in this process's environment, which processes it
    starts inherit and the class reads when they import it."""
    import os

    import areal.engine

    if log_vocab_range is not None:
        FusedFSDPPPOActor.log_vocab_range = bool(log_vocab_range)
        os.environ[VOCAB_RANGE_ENV] = "1" if log_vocab_range else "0"
    areal.engine.FSDPPPOActor = FusedFSDPPPOActor


__all__ = ["VOCAB_RANGE_ENV", "FusedFSDPPPOActor", "use_fused_actor"]
