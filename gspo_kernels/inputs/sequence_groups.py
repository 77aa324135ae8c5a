"""A batch cut into groups of whole consecutive sequences, each a LossBatch of its own: what the
one-pass fused-linear schedule (linear/one_pass.py) evaluates stage 2 on while a group's logits
are still at hand. A token's loss coefficients read only its own sequence and the whole
batch's aggregation weight (sequence/gspo_objective.py), so a group gives its tokens the
coefficients they have in the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import LossBatch
from .segments import Segments


@dataclass(frozen=True)
class SequenceGroup:
    rows: slice  # the group's rows of the flattened `[N]` tokens
    seqs: slice  # its sequences
    batch: LossBatch  # its own inputs, of its own token shape


def sequence_groups(batch: LossBatch, max_rows: int, longest: int) -> list[SequenceGroup] | None:
    """Consecutive whole sequences, as many as fit `max_rows` rows per group (the longest
    sequence's rows, where it is longer); None when a sequence is longer than `longest`, when
    the sequences do not cover the rows exactly, or under context parallelism (a sequence's
    other parts are on other ranks)."""
    seg = batch.segments
    if seg.group is not None:
        return None
    if seg.padded_layout:
        length = seg.rows_per_seq
        if length > longest or seg.num_seqs == 0:
            return None
        max_rows = max(max_rows, length)
        per_group = max(1, max_rows // max(1, length))
        bounds = [(s, min(s + per_group, seg.num_seqs)) for s in range(0, seg.num_seqs, per_group)]
        return [_group(batch, slice(a, b), slice(a * length, b * length)) for a, b in bounds]
    cu = seg.cu_seqlens.tolist()
    longest_seq = max(b - a for a, b in zip(cu, cu[1:]))
    if cu[0] != 0 or cu[-1] != seg.rows or longest_seq > longest:
        return None
    max_rows = max(max_rows, longest_seq)
    groups, first = [], 0
    for last in range(1, len(cu)):
        if cu[last] - cu[first] > max_rows:
            groups.append((first, last - 1))
            first = last - 1
    groups.append((first, len(cu) - 1))
    return [_group(batch, slice(a, b), slice(cu[a], cu[b])) for a, b in groups if b > a]


def _group(batch: LossBatch, seqs: slice, rows: slice) -> SequenceGroup:
    seg = batch.segments
    if seg.padded_layout:
        def tokens(t):
            return None if t is None else t[seqs]
        segments = Segments.padded(seqs.stop - seqs.start, seg.rows_per_seq)
    else:
        def tokens(t):
            return None if t is None else t[rows]
        cu = seg.cu_seqlens[seqs.start:seqs.stop + 1] - rows.start
        segments = Segments.packed(cu, rows.stop - rows.start, known_valid=True)
    mask = tokens(batch.mask)
    # Every field by name, not dataclasses.replace: torch.compile on torch 2.6 cannot trace replace
    # ("hasattr UserDefinedClassVariable __dataclass_fields__"; 2.14 traces it).
    group = LossBatch(
        targets=tokens(batch.targets),
        token_shape=mask.shape,
        mask=mask,
        old_logprobs=tokens(batch.old_logprobs),
        ref_logprobs=tokens(batch.ref_logprobs),
        advantages=tokens(batch.advantages) if batch.advantages_per_token else batch.advantages[seqs],
        advantages_per_token=batch.advantages_per_token,
        segments=segments,
        normalizer=batch.normalizer,
        horizon=batch.horizon,
        rollout_logprobs=tokens(batch.rollout_logprobs),
        entropy_threshold=batch.entropy_threshold,
        token_weights=tokens(batch.token_weights),
        masked=batch.masked,
    )
    return SequenceGroup(rows, seqs, group)


def group_aggregation(aggregation, seqs: slice):
    """The whole batch's W for a group's sequences: a per-sequence W sliced, a number or a 0-d
    tensor as it is."""
    if isinstance(aggregation, torch.Tensor) and aggregation.dim():
        return aggregation[seqs]
    return aggregation
