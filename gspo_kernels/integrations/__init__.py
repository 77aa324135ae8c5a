"""Drop-ins for the trainers GSPO users run: `integrations.trl` (TRL's GRPOTrainer),
`integrations.verl` (verl's policy-loss registry and actor log-probs), `integrations.areal`
(AReaL's FSDP2 PPO actor) and `integrations.megatron` (Megatron-Core's vocab-parallel logits and
output layer, slime's custom loss). Each package imports its trainer, so import the one you use:
`from gspo_kernels.integrations.trl import GRPOTrainer`. Install their pinned versions with
`pip install -e .[integrations]` (AReaL's apart: `[areal]`, docs/trainers.md)."""
