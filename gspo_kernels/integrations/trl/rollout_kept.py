"""The engine's kept sets in the TRL drop-in. TRL 1.16 does not ask its vLLM for them; a
`rollout_func` that does (vLLM's `return_sampling_mask`, SGLang's `return_sampling_mask`) returns
them under the key `kept_token_ids`: for each completion, one set of token ids per generated token
(vLLM's `CompletionOutput.sampling_mask` as it comes, CSR `token_ids`/`offsets`, or a list of
lists). The drop-in takes that key from TRL's extra fields before the reward functions see them,
and its log-prob passes of the step (old and reference policies, then the training loss) use the
sets: the softmax over each token's set (gk.KeptTokens).

Between TRL's generation and its loss the sets travel as a `(B, C, k)` tensor of ids padded with
-1 (FIELD in the step's inputs), so that TRL's shuffling and splitting of the batch carry them.
"""

from __future__ import annotations

import torch

from ...inputs.kept_tokens import KeptTokens, _per_token_sets

FIELD = "kept_token_ids"


class RolloutKeptSets:
    """The sets of the generation in progress, from TRL's extra fields to the step's inputs."""

    def __init__(self) -> None:
        self._sets: list | None = None  # per completion, a list of per-token id lists

    def take(self, extra_fields: dict | None) -> None:
        self._sets = None
        if extra_fields and FIELD in extra_fields:
            self._sets = [_per_token_sets(response) for response in extra_fields.pop(FIELD)]

    def clear(self) -> None:
        self._sets = None

    def refuse_unfused(self, what: str) -> None:
        if self._sets is not None:
            raise ValueError(f"gspo_kernels: the rollout gave the engine's kept sets ({FIELD}), which {what} would "
                             "not read; run the fused path (see the warning that named why it did not run)")

    def padded(self, completions: int, length: int, device) -> torch.Tensor | None:
        """The sets as `(completions, length, k)` ids padded with -1 (None without sets). A
        completion's t-th set is its t-th generated token's; positions past its sets stay empty."""
        if self._sets is None:
            return None
        if len(self._sets) != completions:
            raise ValueError(f"the rollout gave {FIELD} for {len(self._sets)} completions; this process has "
                             f"{completions}")
        widest = max((len(s) for sets in self._sets for s in sets), default=1)
        out = torch.full((completions, length, max(widest, 1)), -1, dtype=torch.int64)
        for i, sets in enumerate(self._sets):
            if len(sets) > length:
                raise ValueError(f"completion {i} has {len(sets)} kept sets in {FIELD} but {length} token positions")
            for t, ids in enumerate(sets):
                out[i, t, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return out.to(device)


def as_kept_tokens(kept_ids: torch.Tensor, mask: torch.Tensor, vocab_size: int, sampling) -> tuple:
    """(KeptTokens of the rows, the stats mask without the rows that have no set). Tokens the
    engine did not sample (a tool's output inside the completion, TRL's tool_mask) have no set:
    their log-probs are left out of the stats, as they are out of the loss."""
    if sampling is not None:
        raise ValueError(f"the rollout gave the engine's kept sets ({FIELD}) and sampling_aware_logprobs is on: "
                         "pass the kept set one way")
    kept, has_set = KeptTokens.from_padded_sets(kept_ids, vocab_size)
    return kept, mask & has_set
