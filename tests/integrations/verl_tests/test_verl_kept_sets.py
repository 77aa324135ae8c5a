"""The engine's kept sets through verl's FSDP engine: a batch with `kept_token_ids` (aligned with
`responses`), converted by verl's own left_right_2_no_padding and laid out by verl's own
FSDPEngineWithLMHead.prepare_model_inputs (wrapped), reaches the fused forward with each row holding the
set of its target token, packed (with verl's bucket pad) and padded; the log-probs, entropies
and every parameter's gradient match the model's own logits renormalised over the same sets."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("verl.workers.utils.padding")
transformers = pytest.importorskip("transformers")

import gspo_kernels.integrations.verl as gk_verl  # noqa: E402
from gspo_kernels.testing.tiny import tiny_llama  # noqa: E402

TEMPERATURE = 0.8
VOCAB = 64


def _batch(gen):
    """verl's left-right padded batch of 3 sequences (prompts left-padded to 4, responses
    right-padded to 5) with the engine's sets: each sampled response token's set holds it;
    response token (0, 2) was not sampled (a tool's output: response_mask 0, no set)."""
    from verl.utils import tensordict_utils as tu

    prompt_lens, response_lens, width_p, width_r, k = [4, 2, 3], [5, 3, 1], 4, 5, 6
    rows = len(prompt_lens)
    ids = torch.randint(0, VOCAB, (rows, width_p + width_r), generator=gen)
    mask = torch.zeros(rows, width_p + width_r, dtype=torch.int64)
    kept = torch.full((rows, width_r, k), -1)
    response_mask = torch.zeros(rows, width_r, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, width_p - p:width_p + r] = 1
        for j in range(r):
            if (i, j) == (0, 2):
                continue
            response_mask[i, j] = 1
            size = int(torch.randint(1, k + 1, (), generator=gen))
            ids_ = torch.randperm(VOCAB, generator=gen)[:size]
            if ids[i, width_p + j] not in ids_:
                ids_[0] = ids[i, width_p + j]
            kept[i, j, :size] = ids_
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    td = tu.get_tensordict({"input_ids": ids, "attention_mask": mask, "response_mask": response_mask,
                            "position_ids": position_ids, "prompts": ids[:, :width_p], "responses": ids[:, width_p:],
                            gk_verl.kept_sets.KEY: kept})
    return td, ids, mask, kept, response_mask, width_p


def _engine(model, pad, sp):
    return types.SimpleNamespace(module=model, use_ulysses_sp=sp > 1, ulysses_sequence_parallel_size=sp,
                                 pad_to_length=bool(pad), _get_packed_pad_size=lambda n: pad,
                                 pass_packed_cu_seqlens=False)


def _as_ulysses_rank(monkeypatch, rank: int, size: int) -> None:
    """verl's Ulysses slicing as rank `rank` of `size` (its group calls, without a process group)."""
    import verl.utils.ulysses as ulysses

    monkeypatch.setattr(ulysses, "dist", types.SimpleNamespace(get_world_size=lambda group=None: size))
    monkeypatch.setattr(ulysses, "get_ulysses_sequence_parallel_rank", lambda group=None: rank)


def _reference_rows(logits, targets, sets):
    """log p and entropy of each row's target over its set, from the model's own logits."""
    z = logits.double() / TEMPERATURE
    listed = torch.zeros_like(z, dtype=torch.bool)
    for r, s in enumerate(sets):
        listed[r, s[s >= 0]] = True
    lsm = torch.log_softmax(torch.where(listed, z, torch.full_like(z, -torch.inf)), -1)
    p = lsm.exp()
    entropy = -(p * torch.where(p > 0, lsm, torch.zeros_like(lsm))).sum(-1)
    return lsm.gather(-1, targets[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize("layout", ["packed", "packed+bucket_pad", "packed+ulysses_rank_1_of_2", "padded"])
def test_kept_sets_follow_verls_rows_to_the_fused_forward(layout, monkeypatch):
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.padding import left_right_2_no_padding

    assert getattr(FSDPEngineWithLMHead.prepare_model_inputs, "gspo_kernels", False)  # wrapped when verl imported its engine
    gen = torch.Generator().manual_seed(5)
    td, ids, mask, kept, response_mask, width_p = _batch(gen)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, use_remove_padding=layout != "padded", use_fused_kernels=True, temperature=TEMPERATURE)
    model = tiny_llama(vocab=VOCAB, tied=False).float()
    cls = type(model)
    original = cls.forward
    cls.forward = gk_verl.forward_with_gspo_kernels
    try:
        sp = 2 if "ulysses" in layout else 1
        if sp > 1:
            _as_ulysses_rank(monkeypatch, 1, sp)
        pad = 3 if "bucket" in layout else 0
        model_inputs, _ = FSDPEngineWithLMHead.prepare_model_inputs(_engine(model, pad, sp), td)
        rows = model_inputs[gk_verl.kept_sets.KEY]
        out = model(**model_inputs)
        cls.forward = original  # the model's own logits on the same inputs (the same hidden states)
        plain = {k: v for k, v in model_inputs.items() if k not in ("temperature", "shift_labels", gk_verl.kept_sets.KEY)}
        logits = model(**plain).logits
    finally:
        cls.forward = original

    flat_rows = rows.reshape(-1, rows.shape[-1])
    if layout == "padded":
        targets = torch.roll(model_inputs["input_ids"], -1, -1).reshape(-1)
    else:
        targets = model_inputs["shift_labels"].reshape(-1)
        total = int(mask.sum()) + pad
        total += (sp - total % sp) % sp
        assert flat_rows.shape[0] == total // sp
        first = (sp - 1) * (total // sp)  # this rank's first global row
    # Each sampled response token's set is on the row that predicts it, and only there.
    packed_at = mask.reshape(-1).cumsum(0).reshape(mask.shape) - 1  # position in verl's packed order
    expected = torch.full_like(flat_rows, -1)
    for i, j in (response_mask > 0).nonzero().tolist():
        if layout == "padded":
            row = i * rows.shape[1] + int(mask[i, :width_p + j].sum()) - 1
        else:
            row = int(packed_at[i, width_p + j]) - 1 - first
            if not 0 <= row < flat_rows.shape[0]:
                continue  # on the other rank
        assert int(targets[row]) == int(ids[i, width_p + j])
        expected[row] = kept[i, j]
    assert torch.equal(flat_rows.sort(-1).values, expected.sort(-1).values)

    has_set = (flat_rows >= 0).any(-1)
    assert int(has_set.sum()) >= 3  # sets on this layout's rows (the rank's, under Ulysses)
    want_lp, want_ent = _reference_rows(logits.reshape(-1, VOCAB)[has_set], targets[has_set], flat_rows[has_set])
    got_lp, got_ent = out.log_probs.reshape(-1), out.entropy.reshape(-1)
    assert torch.allclose(got_lp[has_set].double(), want_lp, atol=2e-5)
    assert torch.allclose(got_ent[has_set].double(), want_ent, atol=2e-5)
    assert torch.equal(got_lp[~has_set], torch.zeros_like(got_lp[~has_set]))  # no set: 0, no gradient

    # Every parameter's gradient against the model's own logits over the same sets.
    weights = torch.randn(int(has_set.sum()), generator=gen, dtype=torch.float64)
    cls.forward = gk_verl.forward_with_gspo_kernels
    try:
        model.zero_grad()
        (model(**model_inputs).log_probs.reshape(-1)[has_set].double() * weights).sum().backward()
        ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        cls.forward = original
    model.zero_grad()
    logits = model(**plain).logits.reshape(-1, VOCAB)[has_set]
    (_reference_rows(logits, targets[has_set], flat_rows[has_set])[0] * weights).sum().backward()
    for name, p in model.named_parameters():
        scale = max(p.grad.abs().max().item(), 1e-6)
        assert (ours[name] - p.grad).abs().max().item() <= 1e-4 * scale, name


def test_kept_sets_and_the_sampling_option_are_refused_together():
    model = tiny_llama(vocab=VOCAB, tied=True).float()
    setattr(model, gk_verl.fused_forward.SAMPLING_ATTRIBUTE, gk_verl.engine_hook.SamplingFilter(top_k=5))
    ids = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="pass the kept set one way"):
        gk_verl.forward_with_gspo_kernels(model, input_ids=ids, kept_token_ids=torch.full((1, 4, 2), -1))
    delattr(model, gk_verl.fused_forward.SAMPLING_ATTRIBUTE)
    with pytest.raises(ValueError, match="one set of ids per target"):
        gk_verl.forward_with_gspo_kernels(model, input_ids=ids, kept_token_ids=torch.full((1, 3, 2), -1))
    kept = torch.full((1, 4, 2), -1)
    kept[0, 1, 0] = (int(ids[0, 2]) + 1) % VOCAB  # a set without the target, on a row in the loss
    with pytest.raises(ValueError, match="token row 1 is in the loss"):
        gk_verl.forward_with_gspo_kernels(model, input_ids=ids, kept_token_ids=kept)
