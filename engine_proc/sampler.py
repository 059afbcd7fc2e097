"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Sampling draws Exponential(1) noise `q` and takes `argmax(probs / q)`, which is an exact
draw from `probs` (the exponential-race form of the Gumbel-max trick). The noise of a seeded
request comes from its own `torch.Generator`, one row per step, so its tokens do not depend
on which other requests share the batch; unseeded rows share one batched draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_proc.logits_adjustments import LogitsAdjustments


@dataclass
class SamplingBatch:
    """Per-row sampling settings, already on the logits' device."""

    temperatures: torch.Tensor  # float32 [N]; greedy rows hold 1.0 (masked by `greedy`)
    top_ps: torch.Tensor  # float32 [N]
    top_ks: torch.Tensor  # int64 [N]; vocab size where there is no cut
    greedy: torch.Tensor  # bool [N]
    generators: list[torch.Generator | None]  # per row; None: the shared draw
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    any_seeded: bool
    adjustments: LogitsAdjustments | None = None  # penalties, logit_bias, min_tokens


class Sampler:
    def __call__(self, logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
        """logits: float [N, V] -> sampled token ids int64 [N] (on the logits' device)."""
        logits = logits.float()
        if params.adjustments is not None:
            logits = params.adjustments.apply(logits)
        # max(dim).indices: the first maximal index, like argmax, and ~2x faster on CPU
        greedy_ids = logits.max(dim=-1).indices
        if params.all_greedy:
            return greedy_ids
        logits = logits / params.temperatures.unsqueeze(1)
        if params.any_top_k or params.any_top_p:
            logits = self._apply_top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        noise = self._exponential_noise(probs, params)
        sampled = probs.div_(noise).argmax(dim=-1)
        return torch.where(params.greedy, greedy_ids, sampled)

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        if params.any_top_k:
            ranks = torch.arange(vocab, device=logits.device)
            sorted_logits.masked_fill_(
                ranks.unsqueeze(0) >= params.top_ks.unsqueeze(1), -float("inf")
            )
        if params.any_top_p:
            probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token when the tokens ranked above it already reach top_p (keeps >= 1)
            mass_before = probs.cumsum(dim=-1) - probs
            sorted_logits.masked_fill_(mass_before >= params.top_ps.unsqueeze(1), -float("inf"))
        return torch.full_like(logits, -float("inf")).scatter_(-1, sorted_idx, sorted_logits)

    @staticmethod
    def _exponential_noise(probs: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()
        if params.any_seeded:
            for i, generator in enumerate(params.generators):
                if generator is not None:
                    noise[i].exponential_(generator=generator)
        return noise.clamp_min_(1e-10)  # a zero draw would turn p == 0 into nan
