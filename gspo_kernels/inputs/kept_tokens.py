"""The engine's kept set of every token, as engines report it: which token ids the sampler kept
(after temperature, min-p, top-k and top-p) at each position it sampled.

The form is CSR over the call's token rows: `offsets` `(N + 1,)` and `token_ids` `(nnz,)`, row
r's set being `token_ids[offsets[r]:offsets[r + 1]]`. Rows are the call's tokens in their
flattened order: packed `(N,)` as they are, padded `(B, T)` row-major (row b * T + t), so a
padded batch gives every position a row, its padding included (an empty set there is fine).

Everything about the sets alone is checked once, when a KeptTokens is built (on the host; build
it from the rollout's data before moving it to the device): offsets that start at 0, never fall
and end at nnz, ids in [0, vocab_size), no id twice in a row. What depends on the call (each row
in use holds a set, and its target in it) is checked per call: on the host for CPU tensors
(ValueError naming the row), as an asynchronous device-side assert on a GPU (`check_call` then
names the row on the host).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends import native_backend
from .checks import check_values


@dataclass(frozen=True, eq=False)
class KeptTokens:
    """Per token row, the ids the engine's sampler kept (CSR: offsets `(N + 1,)`, token_ids
    `(nnz,)`, int64 or int32, one device), in a vocabulary of vocab_size ids. A row's ids are held
    ascending, whatever order they came in: a set's sums then run in one order (the same bits for
    the same set), and the products from hidden states walk the weight in id order."""

    offsets: torch.Tensor
    token_ids: torch.Tensor
    vocab_size: int
    # The entries' rows, `(nnz,)` int64: built once, shared by every call with these sets.
    row_index: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("offsets", "token_ids"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"KeptTokens.{name} must be a torch.Tensor; got {type(t).__name__}")
            if t.dtype not in (torch.int64, torch.int32) or t.dim() != 1:
                raise TypeError(f"KeptTokens.{name} must be a 1-D int64 or int32 tensor; got {t.dtype} of "
                                f"shape {tuple(t.shape)}")
            object.__setattr__(self, name, t.to(torch.int64).contiguous())
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"KeptTokens.vocab_size must be an int >= 1; got {self.vocab_size!r}")
        offsets, ids = self.offsets, self.token_ids
        if ids.device != offsets.device:
            raise ValueError(f"KeptTokens.token_ids are on {ids.device} but offsets on {offsets.device}")
        if offsets.numel() < 1:
            raise ValueError("KeptTokens.offsets must have N + 1 entries (N token rows); got none")
        _check_offsets(offsets.cpu(), ids.numel())
        counts = offsets[1:] - offsets[:-1]
        rows = torch.arange(counts.numel(), device=offsets.device)
        row_index = torch.repeat_interleave(rows, counts, output_size=ids.numel())
        in_order = _check_ids(row_index.cpu(), ids.cpu(), self.vocab_size)
        object.__setattr__(self, "token_ids", in_order.to(ids.device))
        object.__setattr__(self, "row_index", row_index)

    @property
    def rows(self) -> int:
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    def to(self, device) -> "KeptTokens":
        """The same sets on `device` (checked again: the check reads the host copy)."""
        return KeptTokens(self.offsets.to(device), self.token_ids.to(device), self.vocab_size)

    @staticmethod
    def from_lists(sets, vocab_size: int, device=None) -> "KeptTokens":
        """From one sequence of ids per token row (lists, tuples, 1-D tensors or arrays)."""
        lengths = [len(s) for s in sets]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        if lengths:
            offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        flat = [int(i) for s in sets for i in s]
        ids = torch.tensor(flat, dtype=torch.int64)
        return KeptTokens(offsets.to(device), ids.to(device), vocab_size)

    @staticmethod
    def from_padded(ids: torch.Tensor, vocab_size: int, fill: int = -1) -> "KeptTokens":
        """From a padded `(..., k)` tensor of ids, `fill` after each row's last id (a row may be
        all fill: an empty set); the leading dims are the token rows in their flattened order."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() < 2:
            raise TypeError("KeptTokens.from_padded takes an int64/int32 tensor (..., k) of ids")
        rows = ids.reshape(-1, ids.shape[-1]).to(torch.int64)
        present = rows != fill
        # fill only after the ids: a row's ids must be a prefix, or the positions would not say the order
        after_fill = (present[:, 1:] & ~present[:, :-1]).any(1)
        if bool(after_fill.any()):
            bad = int(after_fill.nonzero()[0])
            raise ValueError(f"KeptTokens.from_padded: row {bad} has an id after a fill value {fill}; put each "
                             "row's ids first")
        counts = present.sum(1)
        offsets = torch.zeros(rows.shape[0] + 1, dtype=torch.int64, device=ids.device)
        offsets[1:] = torch.cumsum(counts, 0)
        return KeptTokens(offsets, rows[present], vocab_size)

    @staticmethod
    def from_padded_sets(ids: torch.Tensor, vocab_size: int) -> tuple["KeptTokens", torch.Tensor]:
        """(the KeptTokens, which rows have a set) from a rollout's `(..., k)` ids, any negative
        value a fill, fills anywhere in a row (what the drop-ins carry through a trainer's batch)."""
        ids = ids.to(torch.int64)
        ids = torch.where(ids < 0, torch.full_like(ids, -1), ids).sort(-1, descending=True).values  # ids first
        return KeptTokens.from_padded(ids, vocab_size), (ids >= 0).any(-1)

    @staticmethod
    def from_responses(responses, starts, rows: int, vocab_size: int, device=None) -> "KeptTokens":
        """From the engine's sets of each response: responses[i] holds one set per generated token,
        as vLLM returns them (`CompletionOutput.sampling_mask`: an object or dict with CSR
        `token_ids` and `offsets`, or a list of lists) or SGLang (`meta_info["output_token_sampling_mask"]`,
        a list per token). starts[i] is the token row whose target is response i's first generated
        token, in the call's flattened rows (padded: b * T + t); rows = N. Every other row (prompts,
        padding) gets an empty set."""
        sets: list = [[] for _ in range(rows)]
        for response, start in zip(responses, starts):
            per_token = _per_token_sets(response)
            if start < 0 or start + len(per_token) > rows:
                raise ValueError(f"a response of {len(per_token)} tokens starting at row {start} does not fit in "
                                 f"{rows} token rows")
            sets[start:start + len(per_token)] = per_token
        return KeptTokens.from_lists(sets, vocab_size, device)

    def check_call(self, rows: int, vocab: int, targets: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
        """The sets against one call: N rows over a vocabulary of `vocab` ids (the global one),
        and each row in use (row_mask, None: all) holding a set with its target (int64 `[N]`).
        Returns target_positions(targets)."""
        if self.rows != rows:
            raise ValueError(f"kept_tokens has {self.rows} rows (offsets has {self.offsets.numel()} entries) but "
                             f"the call has {rows} token rows: offsets must have N + 1 = {rows + 1} entries")
        if self.vocab_size != vocab:
            raise ValueError(f"kept_tokens was built for a vocabulary of {self.vocab_size} ids; the logits have {vocab}")
        if targets.device != self.device:
            raise ValueError(f"kept_tokens is on {self.device} but the call's tensors are on {targets.device}")
        target_pos = self.target_positions(targets)
        has_target = target_pos >= 0
        in_use = has_target if row_mask is None else has_target | ~row_mask
        if targets.device.type == "cpu":
            if not bool(in_use.all()):
                row = int((~in_use).nonzero()[0])
                start, stop = int(self.offsets[row]), int(self.offsets[row + 1])
                what = "an empty kept set" if start == stop else f"a kept set of {stop - start} ids without it"
                raise ValueError(f"token row {row} is in the loss with target {int(targets[row])} and {what}: the "
                                 "engine samples from the set, so its target must be in it (check the rows' order "
                                 "and the mask)")
        else:
            check_values(in_use.all(), "a token row in the loss has a target outside its kept set (kept_tokens; "
                                       "KeptTokens.check_call on CPU tensors names the row)")
        return target_pos

    def target_positions(self, targets: torch.Tensor) -> torch.Tensor:
        """Per row, the entry of its target in `token_ids`, or -1 where the set lacks it."""
        targets = targets.reshape(-1)
        if targets.device.type == "cpu" and native_backend.load_error() is None:
            return native_backend.kept_target_positions(self.offsets, self.token_ids, targets.to(torch.int64).contiguous())
        hit = self.token_ids == targets.index_select(0, self.row_index)
        found = torch.full((self.rows,), -1, dtype=torch.int64, device=self.device)
        entries = torch.arange(self.token_ids.numel(), device=self.device)
        # Misses add -1, which the initial -1 already is: no boolean indexing (a sync and a pass).
        return found.scatter_reduce(0, self.row_index, torch.where(hit, entries, -1), "amax")


def _per_token_sets(response) -> list:
    """One response's sets as a list per generated token: CSR (token_ids, offsets) as attributes or
    keys, or already a sequence of per-token sequences."""
    if isinstance(response, dict):
        ids, offsets = response.get("token_ids"), response.get("offsets")
    else:
        ids, offsets = getattr(response, "token_ids", None), getattr(response, "offsets", None)
    if offsets is None:
        if ids is not None and not isinstance(response, (list, tuple)):
            return [list(s) for s in ids]  # token_ids as a list per token, no offsets
        return [list(s) for s in response]
    ids, offsets = list(ids), [int(o) for o in offsets]
    return [ids[offsets[t]:offsets[t + 1]] for t in range(len(offsets) - 1)]


def _check_offsets(offsets: torch.Tensor, nnz: int) -> None:
    """The offsets (a host tensor): from 0 to nnz, never falling."""
    if int(offsets[0]) != 0 or int(offsets[-1]) != nnz:
        raise ValueError(f"KeptTokens.offsets must start at 0 and end at nnz = {nnz} (the number of "
                         f"token_ids); got {int(offsets[0])} and {int(offsets[-1])}")
    falls = offsets[1:] < offsets[:-1]
    if bool(falls.any()):
        row = int(falls.nonzero()[0])
        raise ValueError(f"KeptTokens.offsets fall at row {row} ({int(offsets[row])} then {int(offsets[row + 1])}): "
                         "they must not decrease")


def _check_ids(rows: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The ids (host tensors, rows: each entry's row): in range, none twice in a row. Returns them
    ascending within each row (the sort that finds a repeated id gives that order for free)."""
    outside = (ids < 0) | (ids >= vocab_size)
    if bool(outside.any()):
        entry = int(outside.nonzero()[0])
        raise ValueError(f"KeptTokens: row {int(rows[entry])} holds id {int(ids[entry])}, outside the vocabulary "
                         f"[0, {vocab_size})")
    if ids.numel() <= 1:
        return ids
    keys, _ = torch.sort(rows * vocab_size + ids)
    twice = keys[1:] == keys[:-1]
    if bool(twice.any()):
        key = int(keys[1:][twice][0])
        raise ValueError(f"KeptTokens: row {key // vocab_size} holds id {key % vocab_size} twice; each id "
                         "once per row")
    return keys - rows * vocab_size  # rows is non-decreasing: the sorted keys keep each row's entries in place
