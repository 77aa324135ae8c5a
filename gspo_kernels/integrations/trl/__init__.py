"""TRL drop-in: `from gspo_kernels.integrations.trl import GRPOTrainer` instead of TRL's.
trainer.py is the subclass, options.py the mapping of TRL's options and metrics.py TRL's logged
metrics. GRPOTrainer is imported on first use, so that options.py loads (and is tested)
without TRL installed."""

__all__ = ["GRPOTrainer"]


def __getattr__(name: str):
    if name == "GRPOTrainer":
        from .trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
