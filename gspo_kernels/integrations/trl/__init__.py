"""TRL drop-in: `from gspo_kernels.integrations.trl import GRPOTrainer` instead of TRL's (and
its `GRPOConfig`, TRL's plus `batch_invariant`, for that option). trainer.py is the subclass,
options.py the mapping of TRL's options and metrics.py TRL's logged metrics. GRPOTrainer and
GRPOConfig are imported on first use, so that options.py loads (and is tested) without TRL
installed."""

__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str):
    if name in __all__:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
