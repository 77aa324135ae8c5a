"""The engine's kept sets in verl's FSDP engine. verl 0.9.1's rollouts do not return them; a
rollout of your own (an agent loop) that asks its vLLM or SGLang for them puts them in the batch
under `kept_token_ids`: `(B, R, k)` integer ids aligned with `responses` (the set each response
token was sampled from), `-1` after each set's last id and for tokens the engine did not sample.

The engine's `prepare_model_inputs` is wrapped (engine_hook.py): for a micro-batch holding the
key, the sets follow the rows the model sees, as verl lays them out (packed, the targets rolled
by one, the bucket pad, the Ulysses slice of this rank; or padded), and reach the fused forward
as its `kept_token_ids`, `(..., k)` in the targets' shape, where each row gets the set of its
target token (none for prompt tokens, padding and the rank's pad rows)."""

from __future__ import annotations

import torch

KEY = "kept_token_ids"


def _per_position(micro_batch) -> torch.Tensor:
    """`(B, T, k)`: the kept sets placed on the padded sequences (prompts, then responses), -1
    where there are none."""
    kept, mask = micro_batch[KEY], micro_batch["attention_mask"]
    if kept.is_nested or kept.dim() != 3 or kept.dtype.is_floating_point or kept.dtype == torch.bool:
        raise ValueError(f"the batch's {KEY} must be a (batch, response length, k) integer tensor, -1 padded; got "
                         f"{'a nested tensor' if kept.is_nested else f'{kept.dtype} of shape {tuple(kept.shape)}'}")
    responses = micro_batch.get("responses", None)
    width = responses.shape[-1] if responses is not None and not responses.is_nested else None
    if kept.shape[0] != mask.shape[0] or kept.shape[1] > mask.shape[1] or (width is not None and kept.shape[1] != width):
        raise ValueError(f"the batch's {KEY} has shape {tuple(kept.shape)}; it must be (batch, response length, k) "
                         f"aligned with responses (attention_mask {tuple(mask.shape)}"
                         f"{'' if width is None else f', responses width {width}'})")
    full = kept.new_full((mask.shape[0], mask.shape[1], kept.shape[2]), -1)
    full[:, mask.shape[1] - kept.shape[1]:] = kept  # any negative stays a fill (KeptTokens.from_padded_sets)
    return full


def packed_rows(engine, engine_module, micro_batch) -> torch.Tensor:
    """`(1, rows, k)` for verl's packed layout (use_remove_padding): row t of the packed
    micro-batch predicts token t + 1, then the bucket pad, then this rank's Ulysses slice.
    The same steps verl takes for its rolled ids, taken on each row's global position."""
    sets = _per_position(micro_batch)[micro_batch["attention_mask"].bool()]  # verl's packed order
    n = sets.shape[0]
    where = torch.roll(torch.arange(n, device=sets.device), -1).unsqueeze(0)  # (1, n): the target's position
    pad = engine._get_packed_pad_size(n)
    if pad:
        where, _ = engine_module.pad_packed_inputs(where, None, pad, pad_value=-1)
    if engine.use_ulysses_sp:
        model = getattr(engine.module, "module", engine.module)
        if hasattr(getattr(model, "config", None), "vision_config"):
            raise ValueError(f"the batch's {KEY}: a vision-language model under Ulysses sequence parallelism is "
                             "sliced after its embedding, which the kept sets do not follow")
        where, _, _ = engine_module.ulysses_pad_and_slice_inputs(where, sp_size=engine.ulysses_sequence_parallel_size,
                                                                 pad_value=-1)
    rows = sets.index_select(0, where[0].clamp(min=0))
    return torch.where((where[0] >= 0).unsqueeze(-1), rows, torch.full_like(rows, -1)).unsqueeze(0)


def padded_rows(micro_batch) -> torch.Tensor:
    """`(B, L, k)` for verl's padded layout (no remove_padding): each sequence's tokens from the
    left, L the longest, the targets rolled by one within each row (its last row's target wraps
    to the first token, a prompt token: no set)."""
    sets, mask = _per_position(micro_batch), micro_batch["attention_mask"].bool()
    lengths = mask.sum(-1)
    out = sets.new_full((sets.shape[0], int(lengths.max()) if lengths.numel() else 0, sets.shape[2]), -1)
    for i in range(sets.shape[0]):
        out[i, :int(lengths[i])] = sets[i][mask[i]]
    return torch.roll(out, -1, dims=1)


def rows_for_model(engine, engine_module, micro_batch) -> torch.Tensor:
    use_remove_padding = engine_module.tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
    return packed_rows(engine, engine_module, micro_batch) if use_remove_padding else padded_rows(micro_batch)
