"""Random GSPO problems whose clipping is known in advance, for tests, `check` and benchmarks.

With eps = 3e-4 a problem built from arbitrary old log-probs either clips nothing or clips
at random, and a test of it proves little. Here old log-probs are set from the true
(float64) log-probs so that each sequence's mean log-ratio is one of a few values well away
from the clip edges, cycling through: clipped high (A > 0), clipped low (A < 0), outside the
range on the unclipped side of each sign, and inside the range. Per-token log-ratios add a
+-3e-3 zigzag that cancels in each sequence's mean, so token-level ratios clip too, and every
token's log-ratio stays >= 1e-4 away from an edge: far beyond fp32 error in the log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (mean log-ratio of the sequence, sign of its advantage)
_SEQUENCE_CASES = (
    (2e-3, 1.0),  # ratio 1.002 > 1 + eps_high, A > 0: clipped high
    (-2e-3, -1.0),  # ratio 0.998 < 1 - eps_low, A < 0: clipped low
    (2e-3, -1.0),  # above the range but A < 0: unclipped
    (-2e-3, 1.0),  # below the range but A > 0: unclipped
    (1e-4, 1.0),  # inside the range
    (-1e-4, -1.0),
)
_TOKEN_ZIGZAG = 3e-3
# Sampler (rollout) log-probs sit below the old ones by a per-sequence offset (cycling) plus a
# +-0.9 per-token zigzag, so importance weights exp(old - rollout) land on both sides of the
# bounds the tests use ([0.4, 2]) at token and sequence level alike (e^(+-1) and e^(+-0.2) per
# sequence; e^(0.2 + 0.9) = 3.0, e^(-0.2 - 0.9) = 0.33 per token), and the sequences offset by
# -1 sit ~1 nat off-policy.
_ROLLOUT_OFFSETS = (1.0, -1.0, 0.2, -0.2)
_ROLLOUT_ZIGZAG = 0.9


@dataclass(frozen=True)
class ProblemSpec:
    batch: int = 6
    seq_len: int = 9
    vocab: int = 300
    dtype: torch.dtype = torch.float32
    temperature: float = 1.0
    logit_scale: float = 1.0  # the model's multiplier on its logits (passed only when not 1)
    logit_softcap: float | None = None  # the model's soft-cap (passed only when set)
    empty_sequence: bool = False  # one sequence with no response token
    strided: bool = False  # logits are a view with a row stride larger than V
    token_advantages: bool = False
    with_ref: bool = False
    with_rollout: bool = False
    logit_std: float = 2.0  # the spread of the random logits
    device: str = "cpu"
    seed: int = 0


@dataclass
class Problem:
    """Inputs of gspo_loss. `logits_base[view]` is the logits tensor the loss sees."""

    spec: ProblemSpec
    logits_base: torch.Tensor
    view: tuple
    target_ids: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None

    @property
    def logits(self) -> torch.Tensor:
        return self.logits_base[self.view]

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def loss_args(self, logits: torch.Tensor | None = None):
        """(positional args, keyword args) for gspo_loss; `logits` replaces the problem's own."""
        args = (self.logits if logits is None else logits, self.target_ids, self.old_logprobs, self.advantages)
        kwargs = {"mask": self.mask, "temperature": self.spec.temperature}
        if self.spec.logit_scale != 1.0:
            kwargs["logit_scale"] = self.spec.logit_scale
        if self.spec.logit_softcap is not None:
            kwargs["logit_softcap"] = self.spec.logit_softcap
        if self.ref_logprobs is not None:
            kwargs["ref_logprobs"] = self.ref_logprobs
        if self.rollout_logprobs is not None:
            kwargs["rollout_logprobs"] = self.rollout_logprobs
        if self.cu_seqlens is not None:
            kwargs["cu_seqlens"] = self.cu_seqlens
        return args, kwargs

    def to_packed(self) -> "Problem":
        """The same sequences in the packed layout, trailing padding rows dropped."""
        if self.packed:
            return self
        # A sequence with no response keeps none of its rows: an empty segment.
        lengths = [int(row.nonzero().max()) + 1 if row.any() else 0 for row in self.mask.cpu()]
        logits = self.logits.detach()

        def cat(t):
            return torch.cat([t[i, :n] for i, n in enumerate(lengths)])

        packed_logits = cat(logits)
        view: tuple = (Ellipsis,)
        if self.spec.strided:
            padded = torch.randn(packed_logits.shape[0], packed_logits.shape[1] + 7, device=packed_logits.device)
            padded = padded.to(packed_logits.dtype)
            padded[:, : packed_logits.shape[1]] = packed_logits
            packed_logits, view = padded, (slice(None), slice(0, logits.shape[-1]))
        cu = torch.tensor([0] + lengths, device=logits.device).cumsum(0)
        return Problem(
            spec=self.spec, logits_base=packed_logits, view=view, target_ids=cat(self.target_ids),
            old_logprobs=cat(self.old_logprobs), mask=cat(self.mask),
            advantages=cat(self.advantages) if self.spec.token_advantages else self.advantages,
            ref_logprobs=None if self.ref_logprobs is None else cat(self.ref_logprobs), cu_seqlens=cu,
            rollout_logprobs=None if self.rollout_logprobs is None else cat(self.rollout_logprobs),
        )


def _response_masks(spec: ProblemSpec, gen: torch.Generator) -> torch.Tensor:
    mask = torch.zeros(spec.batch, spec.seq_len, dtype=torch.bool)
    for i in range(spec.batch):
        prompt = int(torch.randint(0, spec.seq_len // 3 + 1, (1,), generator=gen))
        length = int(torch.randint(1, spec.seq_len - prompt + 1, (1,), generator=gen))
        mask[i, prompt : prompt + length] = True
    if spec.empty_sequence:
        mask[min(1, spec.batch - 1)] = False
    return mask


def _log_ratio_plan(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token target log-ratios and per-sequence advantage signs (see the module docstring)."""
    log_ratio = torch.zeros(mask.shape, dtype=torch.float64)
    signs = torch.empty(mask.shape[0], dtype=torch.float64)
    for i in range(mask.shape[0]):
        mean, sign = _SEQUENCE_CASES[i % len(_SEQUENCE_CASES)]
        signs[i] = sign
        rows = mask[i].nonzero().flatten().tolist()
        zigzag = [(-1) ** k * _TOKEN_ZIGZAG for k in range(len(rows) - len(rows) % 2)] + [0.0] * (len(rows) % 2)
        for row, z in zip(rows, zigzag):
            log_ratio[i, row] = mean + z
    return log_ratio, signs


def make_problem(spec: ProblemSpec = ProblemSpec()) -> Problem:
    gen = torch.Generator().manual_seed(spec.seed)
    b, t, v = spec.batch, spec.seq_len, spec.vocab
    extra = 1 if spec.strided else 0
    logits_base = (torch.randn(b, t + extra, v, generator=gen) * spec.logit_std).to(spec.dtype)
    view = (slice(None), slice(0, t)) if spec.strided else (Ellipsis,)
    logits = logits_base[view]
    target_ids = torch.randint(0, v, (b, t), generator=gen)
    mask = _response_masks(spec, gen)

    z = logits.double() * spec.logit_scale
    if spec.logit_softcap is not None:
        z = spec.logit_softcap * torch.tanh(z / spec.logit_softcap)
    true_logp = torch.log_softmax(z / spec.temperature, -1).gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    log_ratio, signs = _log_ratio_plan(mask)
    # Outside the response the old log-probs are noise: the loss must never read them.
    noise = torch.randn(b, t, generator=gen, dtype=torch.float64) * 5
    old_logprobs = torch.where(mask, true_logp - log_ratio, noise).float()

    magnitude = 0.5 + torch.rand(b, generator=gen, dtype=torch.float64)
    advantages = (signs * magnitude).float()
    if spec.token_advantages:
        token_signs = torch.where(torch.rand(b, t, generator=gen) < 0.5, -1.0, 1.0)
        advantages = (token_signs * (0.5 + torch.rand(b, t, generator=gen))).float()

    ref = None
    if spec.with_ref:
        # Offset so the k1 estimate (a signed mean) is not a near-cancelling sum of noise.
        ref = (true_logp - 0.1 + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)).float()

    rollout = None
    if spec.with_rollout:
        offsets = torch.tensor([_ROLLOUT_OFFSETS[i % len(_ROLLOUT_OFFSETS)] for i in range(b)], dtype=torch.float64)
        zigzag = _ROLLOUT_ZIGZAG * (1.0 - 2.0 * (torch.arange(t) % 2)).double()
        rollout = (old_logprobs.double() - offsets[:, None] - zigzag[None, :]).float()

    def dev(x):
        return None if x is None else x.to(spec.device)

    return Problem(
        spec=spec, logits_base=dev(logits_base), view=view, target_ids=dev(target_ids),
        old_logprobs=dev(old_logprobs), advantages=dev(advantages), mask=dev(mask), ref_logprobs=dev(ref),
        rollout_logprobs=dev(rollout),
    )
