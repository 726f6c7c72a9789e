# Generated from refusion_hf.modeling.refusion_loss by refusion_hf.modeling.remote_code (save_pretrained writes it; `make embedded-bundle` refreshes the embedded model's copy): edit the source, not this file.
"""ReFusion's hybrid training loss: autoregressive CE on clean slots + masked-diffusion CE on masked slots.

The inputs are the fields `RefusionDataCollator` builds (docs/design.md §2):

* `labels` `[B, T]`, *not shifted*: `labels[b, i]` is the target of the logits at buffer position i, -100 where
  there is none. In a clean slot that target is the next token of the same slot (the slot's last token has none);
  at a masked position it is the position's own original token;
* `mdm_weights` `[B, T]` float: `1 / (p_mask * answer_length * num_examples)` of the example at its masked
  positions, 0 elsewhere (`num_examples`: the examples collated into the batch, which may be packed into fewer
  rows). A position with a positive weight is a masked (MDM) position; every other labelled position is a clean
  (AR) one.

    AR  = mean CE over every labelled clean position of the batch
    MDM = sum over masked positions of CE * mdm_weight   (= per-example sum / p_mask / answer_length, batch mean)
    loss = AR + MDM

This is the authors' code-level normalisation (the paper's equations normalise per slot instead). Both parts are
computed in float32 whatever the logits' dtype. A part with no position in the batch is 0 (kept in the graph, so
every rank of a distributed run still back-propagates through the same parameters).

Part of the remote-code bundle: standard library, torch and transformers imports only, plus bundle siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

IGNORE_INDEX = -100


@dataclass
class RefusionCausalLMOutputWithPast(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the two parts of the ReFusion loss (`loss = ar_loss + mdm_loss`).

    ar_loss (`torch.Tensor`, *optional*): mean cross-entropy over the labelled tokens of the clean slots.
    mdm_loss (`torch.Tensor`, *optional*): sum of cross-entropy / p_mask / answer_length over the masked
        tokens, divided by the number of examples (the sum of `mdm_weights * CE`).
    """

    ar_loss: torch.Tensor | None = None
    mdm_loss: torch.Tensor | None = None


def refusion_loss(
    logits: torch.Tensor, labels: torch.Tensor, mdm_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The AR and MDM parts of the ReFusion loss (float32 scalars) for `logits` `[B, T, V]`."""
    if labels.shape != logits.shape[:2] or mdm_weights.shape != logits.shape[:2]:
        raise ValueError(
            f"`labels` {tuple(labels.shape)} and `mdm_weights` {tuple(mdm_weights.shape)} must both have the shape "
            f"of the logits' first two dimensions {tuple(logits.shape[:2])} (batch, sequence); build them with "
            "`RefusionDataCollator`."
        )
    labels = labels.to(logits.device)
    mdm_weights = mdm_weights.to(device=logits.device, dtype=torch.float32)
    token_ce = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(labels)
    labelled = labels != IGNORE_INDEX
    masked = mdm_weights > 0
    if (masked & ~labelled).any():
        raise ValueError(
            "`mdm_weights` is positive at a position whose label is -100: every masked position must be labelled "
            "with its own original token (see `RefusionDataCollator`)."
        )
    clean = labelled & ~masked
    zero = logits.float().sum() * 0.0
    ar_loss = token_ce[clean].sum() / clean.sum() if clean.any() else zero
    mdm_loss = (token_ce * mdm_weights)[masked].sum() if masked.any() else zero
    return ar_loss, mdm_loss


__all__ = ["IGNORE_INDEX", "RefusionCausalLMOutputWithPast", "refusion_loss"]
