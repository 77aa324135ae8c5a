"""FuzzCase: every value the differential fuzz draws, as plain Python values.

Hypothesis draws one of these (fuzz_strategies.py) and fuzz_build.py turns it into tensors with
a torch.Generator seeded by `seed`, so a case is a complete, printable recipe: its repr pasted
into tests/fuzz/replay.py rebuilds the same tensors and reruns the same checks. Keep every
field a str, int, float, bool, None, or a tuple/dict of those, so that `repr` round-trips.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# Entry points under test (fuzz_run.py runs each against the float64 reference).
ENTRIES = ("gspo_loss", "fused_linear", "policy_loss", "selective_log_softmax")

# Where the advantage/ratio plan puts a sequence's mean log-ratio d = lp - old (fuzz_build.py):
# relative to the clip bounds, far from them, or beyond float32's exp range (above only: an old
# log-prob is <= 0, so d = lp - old >= lp).
ZONES = ("inside", "above", "below", "far_above", "far_below", "overflow")

# Bad values put into one row (fuzz_build.py). "place" says whether that row is a response row
# (mask 1: the result must turn NaN as the reference's does) or padding (mask 0: nothing may change).
INJECTIONS = ("nan", "pinf", "ninf", "row_ninf", "target_banned", "id_neg", "id_big")


@dataclass(frozen=True, repr=False)
class FuzzCase:
    entry: str = "gspo_loss"
    backend: str = "torch"  # ignored by policy_loss (stage 2 only)
    seed: int = 0
    # Layout: one (prompt, response, tail) row count per sequence. Padded: B = len(spans) rows of
    # T = longest + pad_extra; packed: the sequences back to back, cu_seqlens from their lengths.
    packed: bool = False
    spans: tuple = ((0, 3, 0),)
    pad_extra: int = 0
    holes: bool = False  # drop some response rows inside a span (multi-turn masks)
    vocab: int = 7
    logits_dtype: str = "float32"
    logit_std: float = 2.0
    logits_view: str = "contiguous"  # fuzz_layouts.LOGITS_VIEWS (hidden's view for fused_linear)
    index_dtype: str = "int64"  # target_ids
    cu_dtype: str = "int64"  # cu_seqlens
    logprob_dtype: str = "float32"  # old/ref/rollout log-probs, advantages, policy_loss's inputs
    mask_form: str = "bool"  # "none" (mask=None), "bool", "int64", "int32", "uint8"
    views: tuple = ()  # (input name, fuzz_layouts.PER_TOKEN_LAYOUTS entry) pairs; others contiguous
    injections: tuple = ()  # (INJECTIONS entry, "response" | "padding") pairs
    padding_garbage: bool = False  # NaN/inf/huge old, ref, rollout log-probs and advantages on mask-0 rows
    # The ratio plan: old_logprobs None, or planned per sequence from `zones` (one per sequence).
    on_policy: bool = True
    zones: tuple = ()
    token_spread: float = 0.0  # per-token spread of d around its sequence's mean
    signs: tuple = ()  # advantage sign per sequence: 1, -1 or 0
    adv_per_token: bool = False
    with_ref: bool = False
    rollout: str = "none"  # "none", "given", "given_with_nan"
    normalizer: str = "none"  # "none", "float", "tensor"
    entropy_threshold: str = "none"  # "none", "float", "tensor" (with top_entropy_quantile < 1)
    off_policy: bool = False  # set off_policy_mask_threshold between the sequences' gaps
    pick: float = 0.5  # which gap (or entropy gap) a data-derived threshold sits in
    options: dict = field(default_factory=dict)  # GSPOConfig keywords
    # fused_linear: hidden size, bias, chunk_size, batch_invariant, schedule (auto: one pass
    # wherever the loss allows it), weight transposed, fused tiles.
    hidden: int = 8
    bias: bool = True
    chunk_size: int | None = None
    batch_invariant: bool = False
    schedule: str = "auto"
    weight_transposed: bool = False
    fused: bool = False
    # selective_log_softmax: with entropy, with mask (mask_form "none" = without).
    return_entropy: bool = True
    triton_block_v: int | None = None  # Triton's vocab block forced small: several blocks per row
    # The engine's kept sets (kept_tokens): "none", "random" (random sets holding the response
    # rows' targets), "sampler" (each row's top-k logits, k drawn, its target in place of the k-th),
    # "singletons" (the target alone) or "whole" (every id: checked against the plain reference).
    kept_sets: str = "none"

    def __repr__(self) -> str:
        """Only the fields that differ from the defaults: a shrunk case reads as what it needs."""
        default = FuzzCase()
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name in ("entry", "backend", "seed") or getattr(self, f.name) != getattr(default, f.name)]
        return f"FuzzCase({', '.join(parts)})"

    def repro(self, extra: str = "") -> str:
        """One line to paste into a shell at the repository root to rerun this case. The repr holds
        no double quote, backslash, $ or backtick, so double quotes keep it one shell word."""
        tail = f" {extra}" if extra else ""
        return f'TRITON_INTERPRET=1 .venv/bin/python tests/fuzz/replay.py "{self!r}"{tail}'
