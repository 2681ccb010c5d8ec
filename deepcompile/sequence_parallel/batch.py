"""Splitting a batch of whole sequences into this rank's slice.

Causal language modelling predicts token ``t + 1`` from tokens ``<= t``. Shifting the labels inside
a slice would lose the prediction across each slice boundary, so the labels are shifted over the
whole sequence first (``shift_labels``, the key transformers' loss functions take as already
shifted) and sliced after. Positions are the global ones (``position_ids``), so rotary embeddings
see where the slice sits. A sequence whose length does not divide by the group size is padded at
its end: padding tokens come after every real token, so causal attention keeps them out of every
real token's view, and their labels are ignored.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

IGNORE_INDEX = -100
# Keys sliced along the sequence (dimension 1); everything else is passed on as it is.
_PER_TOKEN = ("input_ids", "inputs_embeds", "position_ids", "shift_labels")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` moved one token left over the whole sequence: entry ``t`` is the label of token ``t + 1``."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def _pad(value: torch.Tensor, to: int, fill: int) -> torch.Tensor:
    missing = to - value.shape[1]
    if missing == 0:
        return value
    pad = value.new_full((value.shape[0], missing, *value.shape[2:]), fill)
    return torch.cat([value, pad], dim=1)


def shard_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int, pad_token_id: int = 0) -> Dict[str, Any]:
    """This rank's slice of ``batch`` (``input_ids`` or ``inputs_embeds`` of shape ``[B, S, ...]``,
    optionally ``labels``, ``position_ids`` and an all-ones ``attention_mask``): ``input_ids``,
    ``position_ids`` and, when there are labels, ``shift_labels`` for tokens
    ``[r * S' / P, (r + 1) * S' / P)`` with ``S'`` the length padded to a multiple of ``P``.
    ``labels`` is set to the same tensor as ``shift_labels`` (transformers' causal-LM heads compute
    a loss only when ``labels`` is given, and use ``shift_labels`` as it is)."""
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sequence-parallel rank {sp_rank} of {sp_size}")
    out = dict(batch)
    tokens = out.get("input_ids", out.get("inputs_embeds"))
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        raise ValueError("shard_batch needs input_ids (or inputs_embeds) of shape [batch, sequence, ...]")
    mask = out.pop("attention_mask", None)
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("shard_batch: an attention_mask with padding cannot be split over ranks; pack sequences "
                         "without padding (or pad at the end with labels -100 and no attention_mask)")
    length = tokens.shape[1]
    padded = -(-length // sp_size) * sp_size
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length, device=tokens.device)
    if out["position_ids"].dim() == 1:  # one row for the whole batch, as transformers allows
        out["position_ids"] = out["position_ids"].expand(tokens.shape[0], length)
    if "labels" in out and "shift_labels" not in out:
        out["shift_labels"] = shift_labels(out.pop("labels"))
    out.pop("labels", None)
    fills = {"input_ids": pad_token_id, "inputs_embeds": 0, "shift_labels": IGNORE_INDEX}
    # Padding continues the positions (never attended to by real tokens).
    positions = out["position_ids"]
    extra = positions[:, -1:] + torch.arange(1, padded - length + 1, device=positions.device, dtype=positions.dtype)
    out["position_ids"] = torch.cat([positions, extra], dim=1)
    per_rank = padded // sp_size
    lo, hi = sp_rank * per_rank, (sp_rank + 1) * per_rank
    for key in _PER_TOKEN:
        if key in out:
            value = out[key]
            if key in fills:
                value = _pad(value, padded, fills[key])
            out[key] = value[:, lo:hi].contiguous()
    if "shift_labels" in out:
        out["labels"] = out["shift_labels"]
    return out
