"""The bound within which two float computations of the same values agree, stated from the
dtype and the sums that feed the compared values, never from one machine's result.

The model. A float sum rounds at every addition, by at most u = eps / 2 of the partial
sum. Those roundings go up as often as down, so over n of them the error walks like a
random sum: its standard deviation is about u * sqrt(n / 3) times the size of the values
summed, i.e. it grows ~ eps * sqrt(n) (the worst case, every rounding the same way, is
eps * n; it takes adversarial inputs). n counts every rounding that reaches a compared value:
for one dot product or mean, its length K; for a chain of them (the layers of a model, the
steps of a recurrence), the sum of their lengths (at most the longest times their number).

Two computations of the same maths sum in different orders: a split batch against the whole
(other GEMM blockings), a packed weight against a plain one, a C kernel against torch's ops,
8-float AVX2 vectors against 16-float AVX-512 ones, FMA (one rounding) against a multiply
and an add (two), another thread count splitting a sum elsewhere, transformers' reference
against our implementation. Each side carries its own error, so they differ by sqrt(2) times
one side's; over N compared values the largest of those near-Gaussian differences lies within
sqrt(2 ln N) standard deviations, under 6 for N < 10^7. Hence the bound on a difference:

    6 * sqrt(2) * u * sqrt(n / 3) * scale  =  sqrt(6) * eps * sqrt(n) * scale

Vector and blocked sums (8 or 16 running sums, pairwise trees) err less than this estimate of
a sequential sum: that is the margin the bound keeps for whichever kernel path a CPU takes.

In bfloat16 and float16 the kernels accumulate in float32 and round each op's output once:
a chain of d ops gathers d roundings of the narrow dtype (terms=1, depth=d).

Where no sum is involved (element-wise ops, copies, table lookups) or both sides run the
same ops on the same shapes, the results are the same bits on every CPU: tests assert
equality there, not a tolerance.
"""

from __future__ import annotations

import math

import torch

from shared.model_config import TextConfig, VisionConfig

SIGMAS = 6  # the largest of < 10^7 compared values stays within 6 standard deviations


def tolerance(dtype: torch.dtype, terms: int, *, depth: int = 1,
              scale: float | None = None) -> dict[str, float]:
    """atol / rtol (torch.testing.assert_close's keywords) for values of `dtype` fed by
    `depth` chained sums of at most `terms` terms each, or by one chain of `terms` in all.

    `scale`: the size of what is summed (the reference's rms), which sets the error of a sum
    whatever its result: atol covers that much, rtol the values larger than it. Without it
    the bound is relative only, for values computed without cancellation (a norm's output)."""
    rel = SIGMAS * math.sqrt(2) * (torch.finfo(dtype).eps / 2) * math.sqrt(terms * depth / 3)
    return {"atol": 0.0 if scale is None else rel * scale, "rtol": rel}


def tolerance_for(reference: torch.Tensor, terms: int, *, depth: int = 1) -> dict[str, float]:
    """`tolerance` at the reference's dtype, with its rms as the scale."""
    return tolerance(reference.dtype, terms, depth=depth, scale=rms(reference))


def rms(values: torch.Tensor) -> float:
    return float(values.detach().double().pow(2).mean().sqrt()) if values.numel() else 0.0


def logprob_limit(logits: torch.Tensor, terms: int) -> float:
    """The bound on a log-probability z_i - logsumexp(z) from `logits` fed by `terms`: its
    error is z_i's less a p-weighted mean of the others', at most twice the largest's."""
    bound = tolerance_for(logits, terms)
    return 2 * (bound["atol"] + bound["rtol"] * float(logits.abs().max()))


def assert_argmax_differs_only_at_ties(logits: torch.Tensor, reference: torch.Tensor,
                                       bound: dict[str, float]) -> None:
    """Where `logits` pick another token than `reference` (rows of [..., vocab]), the
    reference's two candidates are within `bound` of each other: a tie at this precision."""
    ours, best = logits.float().argmax(-1), reference.float().argmax(-1)
    reference = reference.float()
    picked = reference.gather(-1, ours[..., None])[..., 0]
    top = reference.gather(-1, best[..., None])[..., 0]
    allowed = 2 * bound["atol"] + bound["rtol"] * (picked.abs() + top.abs())
    assert ((ours == best) | (top - picked <= allowed)).all(), (top - picked)[ours != best]


# ---- the chains of sums in our models ----------------------------------------------------
# Each counts the terms summed along the longest path to an output (a norm's mean of squares,
# each projection's input width, a softmax's denominator and its weighted sum); element-wise
# ops round once per value and are left out.


def vision_terms(vision: VisionConfig, patches: int) -> int:
    """Through a vision tower to its merged embeddings (and DeepStack features), for images
    of at most `patches` patches each (attention sums over one image's, or one window's)."""
    conv = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    h, unit = vision.hidden_size, vision.spatial_merge_size**2
    block = (h + h  # norm, qkv
             + vision.head_dim + 2 * patches  # q.k, the softmax's sum, p.v
             + h + h + h + vision.intermediate_size)  # proj, norm, fc1, fc2
    merger = h + h * unit + h * unit  # norm, fc1, fc2
    return conv + vision.depth * block + merger


def decoder_terms(text: TextConfig, tokens: int, *, logits: bool = True) -> int:
    """Through the decoder to its last hidden states (or, with `logits`, the logits), for
    sequences of at most `tokens` tokens.

    A hybrid stack (Gated DeltaNet layers) counts its layers as adding their errors, the
    worst case, rather than as one random walk: a recurrent state is a running sum over every
    earlier token, so the error a layer makes at one token persists, the same, in all later
    tokens' states instead of averaging out, and the layers above see it coherently
    (transformers' own float32 Qwen3.5 logits drift from its float64 ones several times
    further than a random walk of their sums allows; the attention-only presets' stay well
    within it)."""
    h = text.hidden_size
    head_dim = text.head_dim or h // text.num_attention_heads
    layers = []
    for i in range(text.num_hidden_layers):
        if text.layer_types and text.is_linear_layer(i):
            # Gated DeltaNet: in_proj, the causal conv, q/k l2 norms, then the recurrence:
            # the state is a sum over key_dim per token, chained over the tokens (the chunked
            # form: a triangular solve over each 64-token chunk, then chunk to chunk)
            dk = text.linear_key_head_dim
            mixer = (h + text.linear_conv_kernel_dim + dk + tokens * dk + min(tokens, 64) ** 2
                     + text.linear_value_head_dim  # gated norm
                     + text.linear_num_value_heads * text.linear_value_head_dim)  # out_proj
        else:
            mixer = (h + (head_dim if text.qk_norm else 0)  # qkv (and the q/k norms)
                     + head_dim + 2 * tokens  # q.k, the softmax's sum, p.v
                     + text.num_attention_heads * head_dim)  # o_proj
        if text.num_experts and text.is_moe_layer(i):
            # router, its softmax, the top-k weights; an expert's gate_up and down; the sum
            # over experts; the shared expert's gate, gate_up and down
            mlp = (h + text.num_experts + text.num_experts_per_tok + h
                   + text.moe_intermediate_size + text.num_experts_per_tok)
            if text.shared_expert_intermediate_size:
                mlp += h + h + text.shared_expert_intermediate_size
        else:
            mlp = h + text.intermediate_size  # gate_up, down
        layers += [h + mixer, h + mlp]  # each with its norm
    layers.append(h + (h if logits else 0))  # the final norm, lm_head
    if text.layer_types:
        return round(sum(math.sqrt(n) for n in layers) ** 2)
    return sum(layers)
