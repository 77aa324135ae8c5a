"""Vocab-parallel token stats: each rank of a tensor-parallel group holds a contiguous slice
of the vocabulary (Megatron's vocab-parallel lm_head), and a row's softmax spans the ranks.

Stage 1 runs the backend's kernel on the local slice, with the targets this rank owns made
local (the others point at column 0, a valid read). Its per-row (lse_k, H_k, logp_k) are the
partial statistics of the slice; two collectives on `[N]`-sized tensors merge them, the
same merge the kernels do between vocab blocks:

    M   = max_k lse_k                              (all_reduce MAX)
    S0  = sum_k exp(lse_k - M)                     (one SUM of five rows, added in rank order)
    S1  = sum_k exp(lse_k - M) * E_k[z - M]        E_k[z] = lse_k - H_k, the slice's mean
    S2  = (z_y - M) on the owning rank, else 0     z_y = logp_k + lse_k there
    lse = M + log S0,   H = log S0 - S1 / S0,   logp = S2 - log S0

plus how many ranks own the target (exactly one, or the target is outside the global vocab
or the slices overlap or leave a gap there) and how many have a NaN or +inf in their slice.
Stage 2 then runs identically on every rank. Stage 3 needs no collective: the kernel, given
the global lse and H, writes this slice's gradient; only the rows whose target lives on
another rank carry a one-hot term they must not have, at column 0, which is rewritten from
the formula (an O(N) fix-up, token_stats/slice_grad.py: the same for a vocab block on one process).
This module holds the slice's place in the vocabulary and the merge over the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import all_reduce_max, check_group, sum_over_ranks


@dataclass(frozen=True)
class VocabSlice:
    """Columns [start, start + size) of the vocabulary: this rank's slice of a vocab-parallel
    lm_head (group: its tensor-parallel group), or one block of columns of the fused-linear
    vocab sweep on one process (group None)."""

    start: int
    size: int
    group: object = None

    @staticmethod
    def of_rank(group, vocab_start, local_vocab: int) -> "VocabSlice | None":
        """This rank's slice of `group` (None without a group): it starts at vocab_start, by
        default rank * local_vocab."""
        if group is None:
            if vocab_start is not None:
                raise ValueError("vocab_start is the start of this rank's vocab slice and needs tp_group")
            return None
        check_group("tp_group", group)
        if vocab_start is None:
            # Megatron's convention: equal contiguous slices in rank order.
            vocab_start = dist.get_rank(group) * local_vocab
        if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
            raise ValueError(f"vocab_start must be an int >= 0 (a global vocab id); got {vocab_start!r}")
        return VocabSlice(vocab_start, local_vocab, group)

    def local_targets(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel targets, owned): ids made local, and column 0 for the rows whose target is
        outside the slice, so that the kernels neither read outside it nor flag the row NaN."""
        local = targets - self.start
        owned = (local >= 0) & (local < self.size)
        return torch.where(owned, local, torch.zeros_like(local)), owned

    def merge(self, logp_k, entropy_k, lse_k, owned):
        """The global (logp, entropy, lse) of each row from this slice's stats; lse is NaN for
        a row with no finite softmax or no single owner of its target, so that stage 3's row
        rule turns such a row (when in the loss) into NaN, as on one process. The five `[N]` sums
        are added in rank order (collectives.sum_over_ranks: an all_gather on 3+ ranks, O(N)),
        so that a row's bits do not follow the rows merged with it; the max is exact in any
        order."""
        bad = torch.isnan(lse_k) | (lse_k == float("inf"))
        peak = all_reduce_max(torch.where(bad, torch.full_like(lse_k, float("-inf")), lse_k), self.group)
        shift = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        rel = lse_k - shift
        weight = torch.exp(rel)
        has_mass = weight > 0  # a slice whose logits are all -inf adds nothing (its H_k is NaN)
        zero = torch.zeros_like(weight)
        mean_rel = torch.where(has_mass, weight * (rel - entropy_k), zero)
        # logp_k + rel = z_y - shift, finite however far below the peak this slice's mass lies
        # (its weight may underflow to 0; its log-prob must not); an all -inf slice holding the
        # target gives z_y = -inf.
        target_rel = torch.where(lse_k > float("-inf"), logp_k + rel, torch.full_like(rel, float("-inf")))
        parts = torch.stack([
            torch.where(bad, zero, weight),
            torch.where(bad, zero, mean_rel),
            torch.where(owned & ~bad, target_rel, zero),
            owned.to(weight.dtype),
            bad.to(weight.dtype),
        ])
        parts = sum_over_ranks(parts, self.group, in_rank_order=True)
        mass, mean_total, target_total, owners, n_bad = parts.unbind(0)
        log_mass = torch.log(mass)
        no_softmax = (n_bad > 0) | (mass == 0)
        nan = torch.full_like(mass, float("nan"))
        entropy = torch.where(no_softmax, nan, log_mass - mean_total / mass)
        logp = torch.where(no_softmax | (owners != 1), nan, target_total - log_mass)
        lse = torch.where(no_softmax | (owners != 1), nan, shift + log_mass)
        return logp, entropy, lse
