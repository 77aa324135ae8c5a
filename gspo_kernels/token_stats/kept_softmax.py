"""The softmax of each row over its kept entries only (the engine's kept set, inputs/kept_tokens.py):
per-row statistics from the entries' mapped logits z `(nnz,)`, and each entry's gradient.

    lse = log sum_K e^z,   log p(y) = z_y - lse,   H = -sum_K p log p

The entries of a row are contiguous (CSR), so every per-row sum is a segment reduction over
them, taken in the entries' order within the row: a row's bits do not depend on the other rows.
The work is O(nnz); nothing outside the sets is read. Over a vocab slice (tensor parallelism)
each rank holds the entries of its slice and these are the slice's partial statistics, which
VocabSlice.merge turns into the global ones, as for the kernels' full rows.

On a CPU, float32 z go to C++ (csrc/cpu/kept_softmax.cpp: a row at a time, the kernels'
per-element terms); elsewhere, and for float64, the PyTorch ops below, which say what both compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import native_backend
from ..backends.contract import LOG_FLOOR
from ..config.logit_map import LogitMap
from ..distributed.vocab_parallel import VocabSlice
from ..inputs.kept_tokens import KeptTokens


@dataclass(frozen=True)
class KeptEntries:
    """The entries of one call's kept sets that a process holds: all of them, or those in its vocab
    slice. ids are local to the slice; target_pos: per row, the entry of its target among these,
    or -1 (not in the set, or on another rank's slice)."""

    offsets: torch.Tensor  # (N + 1,) int64
    row_index: torch.Tensor  # (nnz,) int64, non-decreasing
    ids: torch.Tensor  # (nnz,) int64, local column ids
    target_pos: torch.Tensor  # (N,) int64

    @property
    def rows(self) -> int:
        return self.offsets.numel() - 1

    @staticmethod
    def of(kept: KeptTokens, target_pos: torch.Tensor, tp_slice: VocabSlice | None) -> "KeptEntries":
        """target_pos: kept.target_positions of the call's global target ids (check_call's result)."""
        if tp_slice is None:
            return KeptEntries(kept.offsets, kept.row_index, kept.token_ids, target_pos)
        local = kept.token_ids - tp_slice.start
        select = (local >= 0) & (local < tp_slice.size)
        row_index, ids = kept.row_index[select], local[select]
        offsets = torch.zeros(kept.rows + 1, dtype=torch.int64, device=kept.device)
        offsets[1:] = torch.cumsum(torch.bincount(row_index, minlength=kept.rows), 0)
        new_index = torch.cumsum(select.to(torch.int64), 0) - 1  # an entry's place among the selected
        found = target_pos >= 0
        at = target_pos.clamp(min=0)
        target_pos = torch.where(found & select[at], new_index[at], torch.full_like(target_pos, -1))
        return KeptEntries(offsets, row_index, ids, target_pos)


def _native(z: torch.Tensor) -> bool:
    """The C++ rows (csrc/cpu/kept_softmax.cpp) for float32 on a CPU; these PyTorch ops elsewhere."""
    return z.device.type == "cpu" and z.dtype == torch.float32 and native_backend.load_error() is None


def kept_stats(z: torch.Tensor, entries: KeptEntries):
    """(logp, entropy, lse) `[N]` in z's dtype from the entries' mapped logits z. A row with a NaN
    or +inf among its entries gets NaN in all three; a row with no entry (or all -inf) gets lse
    -inf and NaN logp and entropy (a slice holding none of the row: VocabSlice.merge counts no
    mass); a row whose target is not among its entries gets logp -inf."""
    if _native(z):
        return native_backend.kept_softmax_stats(z, entries.offsets, entries.target_pos)
    offsets, rows = entries.offsets, entries.row_index
    peak = torch.segment_reduce(z, "max", offsets=offsets)  # NaN if the row has one, +inf if it has one
    bad = torch.isnan(peak) | (peak == float("inf"))
    shift = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    d = z - shift.index_select(0, rows)
    e = torch.exp(d)
    mass = torch.segment_reduce(e, "sum", offsets=offsets)
    # e * d is 0 where e is (d = -inf included: clamped first); d > LOG_FLOOR wherever e > 0
    spread = torch.segment_reduce(e * d.clamp(min=LOG_FLOOR), "sum", offsets=offsets)
    log_mass = torch.log(mass)
    lse = shift + log_mass
    entropy = log_mass - spread / mass
    found = entries.target_pos >= 0
    target_z = z.index_select(0, entries.target_pos.clamp(min=0)) if z.numel() else torch.zeros_like(lse)
    logp = torch.where(found, target_z - lse, torch.full_like(lse, float("-inf")))
    nan = torch.full_like(lse, float("nan"))
    no_softmax = bad | (mass == 0)  # an empty set, or all -inf: no distribution (as log_softmax gives)
    return torch.where(no_softmax, nan, logp), torch.where(bad, nan, entropy), torch.where(bad, nan, lse)


def kept_grad(z: torch.Tensor, entries: KeptEntries, lse, entropy, grad_logp, grad_entropy, row_mask,
              logit_map: LogitMap):
    """dLoss/dx of each entry's raw logit x (z's dtype): dz/dx times grad_logp * (1[target] - p)
    - grad_entropy * p * (log p + H), from the rows' global lse and H. The row rule of the kernels (csrc/gspo_math.h,
    row_action), over the row's entries: a row outside row_mask gets zeros; a row in the loss with
    no finite softmax (lse NaN or infinite) gets NaN; else a row whose upstream gradients are both
    0 gets zeros."""
    if _native(z):
        return native_backend.kept_softmax_grad(z, entries.offsets, entries.target_pos, lse, entropy, grad_logp,
                                                grad_entropy, row_mask, logit_map)
    in_loss = torch.ones_like(lse, dtype=torch.bool) if row_mask is None else row_mask
    live = grad_logp != 0
    if grad_entropy is not None:
        live = live | (grad_entropy != 0)
    live = live & in_loss
    broken = in_loss & ~torch.isfinite(lse)
    zero = torch.zeros_like(lse)
    g = torch.where(live, grad_logp, zero)
    h = zero if grad_entropy is None else torch.where(live, grad_entropy, zero)
    # One gather of the rows' values for every entry (index_select: ~3x faster than [rows] here).
    per_entry = torch.stack([lse, g, h, entropy, live.to(lse.dtype), broken.to(lse.dtype)], 1)
    lse_e, g_e, h_e, entropy_e, live_e, broken_e = per_entry.index_select(0, entries.row_index).unbind(1)
    logp = z - lse_e
    p = torch.exp(logp)
    dz = -p * (g_e + h_e * (logp.clamp(min=LOG_FLOOR) + entropy_e))
    dz = torch.where(live_e > 0, dz, torch.zeros_like(dz))  # a dead row's NaN p must not leak
    if dz.numel():  # the one-hot term; a row without its target adds 0 at entry 0 (no boolean indexing)
        hit = entries.target_pos >= 0
        dz = dz.index_add_(0, entries.target_pos.clamp(min=0), torch.where(hit, g, zero))
    # dz/dx only where dz is not 0: a NaN logit of a row outside the loss has a NaN slope.
    dx = torch.where(dz == 0, dz, dz * logit_map.slope(z))
    return torch.where(broken_e > 0, torch.full_like(dx, float("nan")), dx)
