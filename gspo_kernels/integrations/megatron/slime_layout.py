"""Where slime's response tokens sit in the logits it hands its loss, with and without context
parallelism (slime/backends/megatron_utils/cp_utils.py and data.py at THUDM/slime 624b824).

Each sample is packed one after the other. Without context parallelism it takes `total` rows,
row p predicting token p + 1. With context parallel size cp, slime pads each sample to a
multiple of 2 * cp, cuts it into 2 * cp chunks of `ceil(total / (2 cp))` rows, and rank r keeps
chunks r and 2 cp - 1 - r (the load-balanced split), in that order. A sample's response tokens
are predicted by rows p in [prompt - 1, total - 1); slime orders a rank's response tokens by
sample, then by p, and its per-token inputs (old, reference and rollout log-probs, advantages)
come in that order, while its loss masks cover each whole response.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlimeLayout:
    """targets: each logits row's next token (0 outside every response; those rows are masked);
    response_rows: this rank's response rows in slime's order; local_lengths: how many of each
    sample's response tokens this rank holds; full_index: each of them as a position in the
    samples' whole responses, concatenated."""

    targets: torch.Tensor
    response_rows: torch.Tensor
    local_lengths: list
    full_index: torch.Tensor


def _sample_positions(total: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The positions in its sample of the rows a sample takes on this rank, in row order."""
    if cp_size == 1:
        return torch.arange(total)
    chunk = -(-total // (2 * cp_size))
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def slime_layout(batch, rows: int, device, cp_rank: int = 0, cp_size: int = 1) -> SlimeLayout:
    """The layout of this rank's rows. The indices come from the lengths (host integers); the
    tokens are gathered where they live, in one indexing: no device value is read on the host."""
    response_rows, full_index, token_index, local_lengths = [], [], [], []
    offset = full_offset = token_offset = 0
    for total, response in zip(batch["total_lengths"], batch["response_lengths"]):
        positions = _sample_positions(total, cp_rank, cp_size)
        prompt = total - response
        local = ((positions >= prompt - 1) & (positions < total - 1)).nonzero().flatten()
        response_rows.append(offset + local)
        full_index.append(full_offset + positions[local] - (prompt - 1))
        token_index.append(token_offset + positions[local] + 1)  # row p predicts token p + 1
        local_lengths.append(int(local.numel()))
        offset += positions.numel()
        full_offset += response
        token_offset += total
    if offset > rows:
        raise ValueError(f"the samples' total_lengths take {offset} rows on this rank but the logits hold {rows}")
    response_rows = torch.cat(response_rows).to(device)
    tokens = torch.cat([t[:total] for t, total in zip(batch["unconcat_tokens"], batch["total_lengths"])]).to(device)
    targets = torch.zeros(rows, dtype=torch.long, device=device)
    targets[response_rows] = tokens[torch.cat(token_index).to(device)]
    return SlimeLayout(targets, response_rows, local_lengths, torch.cat(full_index).to(device))
