"""Drop-ins for the trainers GSPO users run: `integrations.trl` (TRL's GRPOTrainer) and
`integrations.verl` (verl's policy-loss registry and actor log-probs). Each module imports its
trainer, so import the one you use: `from gspo_kernels.integrations.trl import GRPOTrainer`.
Install their pinned versions with `pip install -e .[integrations]`."""
