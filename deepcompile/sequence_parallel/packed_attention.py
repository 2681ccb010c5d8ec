"""The kernels of ``dcsp::packed_attention`` and its backward (schemas, fake kernels and the autograd
formula: deepcompile/ops.py): causal attention that stays inside each document of a packed row.

The attention pass calls it in place of ``scaled_dot_product_attention`` when
``compile.packed_sequences`` is on, after the all-to-all, with the documents of the forward
(sequence_parallel/documents.py). One op for packed and unpacked batches, choosing its path from
the host-side counts, so one compiled graph serves both:

* CPU: aten's flash kernel for CPU, ``is_causal`` when every row is one document, otherwise with a
  block-causal mask (``[B, 1, S, S]``: CPU runs are small);
* CUDA: flash attention's variable-length kernel over the flattened batch, each document one
  sequence (``cu_seqlens`` = the documents' bounds), so a packed batch costs no mask memory. bf16
  and fp16 only (the flash kernels' dtypes); fp32 on CUDA is refused.

Both save the output and the softmax's log-sum-exp for the backward, as SDPA does. The
log-sum-exp's layout differs between the kernels (and between torch builds for the varlen one),
so the op carries it in a flat fp32 buffer of ``B * H * S`` elements, enough for every layout.
Dropout is not supported (the pass refuses attention with dropout).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from deepcompile import ops

_aten = torch.ops.aten
# The varlen flash kernel's log-sum-exp layout on this torch build: "[H, total]" or, in older
# builds, "[documents, H, longest]". Recorded by the forward, read by the backward.
_varlen_lse_shape: dict = {}


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query key/value heads repeated to the query's head count (CPU kernel: no GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of :func:`_expand_kv`: each key/value head's gradient summed over its copies."""
    if grad.shape[1] == kv_heads:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _block_causal_mask(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, S, S]`` additive mask: 0 where a token attends (same document, not later), -inf elsewhere."""
    length = ids.shape[1]
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(length, length, dtype=torch.bool,
                                                               device=ids.device).tril()
    return torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(~allowed, float("-inf"))[:, None]


def _packed(ids: torch.Tensor, counts: torch.Tensor) -> bool:
    return int(counts[0]) > ids.shape[0]


def _flat_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    flat = torch.zeros(q.shape[0] * q.shape[1] * q.shape[2], dtype=torch.float32, device=q.device)
    flat[:lse.numel()].view(lse.shape).copy_(lse)
    return flat


def _check_cuda_dtype(q: torch.Tensor) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(f"dcsp::packed_attention (compile.packed_sequences) runs flash attention on CUDA, which takes "
                           f"bf16 or fp16; the query is {q.dtype}. Train in bf16 or fp16 (bf16.enabled / "
                           "fp16.enabled), or turn compile.packed_sequences off for unpacked batches")


def _varlen(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` to the varlen kernels' ``[B * S, H, D]``."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _unvarlen(x: torch.Tensor, batch: int) -> torch.Tensor:
    total, h, d = x.shape
    return x.view(batch, total // batch, h, d).transpose(1, 2).contiguous()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, bounds: torch.Tensor,
               counts: torch.Tensor, scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cuda":
        _check_cuda_dtype(q)
        documents, longest = int(counts[0]), int(counts[1])
        cu = bounds[:documents + 1]
        out, lse, *_ = _aten._flash_attention_forward(_varlen(q), _varlen(k), _varlen(v), cu, cu, longest, longest,
                                                      0.0, True, False, scale=scale)
        _varlen_lse_shape["layout"] = lse.dim()
        return _unvarlen(out, q.shape[0]), _flat_lse(lse, q)
    packed = _packed(ids, counts)
    mask = _block_causal_mask(ids, q.dtype) if packed else None
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]), 0.0, not packed, attn_mask=mask, scale=scale)
    return out.contiguous(), _flat_lse(lse, q)


def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse_flat: torch.Tensor, ids: torch.Tensor, bounds: torch.Tensor, counts: torch.Tensor,
                        scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, s, _ = q.shape
    if q.device.type == "cuda":
        _check_cuda_dtype(q)
        documents, longest = int(counts[0]), int(counts[1])
        cu = bounds[:documents + 1]
        shape = (h, b * s) if _varlen_lse_shape.get("layout", 2) == 2 else (documents, h, longest)
        lse = lse_flat[:h * b * s if len(shape) == 2 else documents * h * longest].view(shape)
        # No dropout: the kernel reads no random state; these stand in for the forward's.
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        gq, gk, gv = _aten._flash_attention_backward(
            _varlen(grad.contiguous()), _varlen(q), _varlen(k), _varlen(v), _varlen(out), lse, cu, cu, longest,
            longest, 0.0, True, rng_state, unused, scale=scale)
        return _unvarlen(gq, b), _unvarlen(gk, b), _unvarlen(gv, b)
    packed = _packed(ids, counts)
    mask = _block_causal_mask(ids, q.dtype) if packed else None
    lse = lse_flat[:b * h * s].view(b, h, s)  # the kernel's backward reads it in any memory order
    gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.contiguous(), q, _expand_kv(k, h), _expand_kv(v, h), out, lse, 0.0, not packed, attn_mask=mask,
        scale=scale)
    return gq.contiguous(), _fold_kv_grad(gk, k.shape[1]).contiguous(), _fold_kv_grad(gv, v.shape[1]).contiguous()


ops.register_packed_attention_kernels(_attention, _attention_backward)
