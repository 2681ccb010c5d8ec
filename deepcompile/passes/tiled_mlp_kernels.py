"""The kernels of ``dcmlp::gated_mlp`` and its backward (schemas: deepcompile/ops.py).

A gated MLP (Llama's, Qwen2's, Mistral's, Gemma's: ``down(act(gate(x)) * up(x))``) holds
``tokens x intermediate`` activations between its matmuls: at 128k tokens and an 8B model's
14336-wide intermediate, 3.5 GiB per tensor in bf16, and autograd saves three of them per layer
(the gate's output, the activation, the up projection) plus the product that feeds ``down``. These
kernels run the MLP ``chunk`` tokens at a time: the forward keeps only its output, and the
backward recomputes each chunk's intermediates from the input before taking their gradients. Each
chunk repeats the untiled arithmetic (matmuls in the inputs' dtype, the activation's own backward
kernel); the weight gradients are summed over chunks in fp32 and rounded once, so the results
differ from autograd's only in the order of those sums.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F

from deepcompile import ops

# activation name -> (forward, backward(grad, input)): the aten kernels autograd itself calls.
ACTIVATIONS: Dict[str, Tuple[Callable, Callable]] = {
    "silu": (F.silu, torch.ops.aten.silu_backward.default),
    "gelu": (F.gelu, lambda grad, x: torch.ops.aten.gelu_backward.default(grad, x, approximate="none")),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"),
                  lambda grad, x: torch.ops.aten.gelu_backward.default(grad, x, approximate="tanh")),
}


def _chunks(tokens: int, chunk: int):
    step = max(1, chunk)
    for start in range(0, tokens, step):
        yield start, min(tokens, start + step)


def _check(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"dcmlp::gated_mlp: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if gate.dim() != 2 or gate.shape != up.shape or down.dim() != 2 or down.shape[1] != gate.shape[0] \
            or x.shape[-1] != gate.shape[1]:
        raise ValueError(f"dcmlp::gated_mlp: x [..., features], gate and up [intermediate, features] and down "
                         f"[out, intermediate] expected, got {tuple(x.shape)}, {tuple(gate.shape)}, "
                         f"{tuple(up.shape)}, {tuple(down.shape)}")


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str,
              chunk: int) -> torch.Tensor:
    _check(x, gate, up, down, activation)
    act = ACTIVATIONS[activation][0]
    flat = x.reshape(-1, x.shape[-1])
    out = flat.new_empty(flat.shape[0], down.shape[0])
    for start, end in _chunks(flat.shape[0], chunk):
        rows = flat[start:end]
        out[start:end] = F.linear(act(F.linear(rows, gate)) * F.linear(rows, up), down)
    return out.view(*x.shape[:-1], down.shape[0])


def gated_mlp_backward(grad: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       down: torch.Tensor, activation: str,
                       chunk: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(x, gate, up, down, activation)
    act, act_backward = ACTIVATIONS[activation]
    flat = x.reshape(-1, x.shape[-1])
    grad_out = grad.reshape(-1, down.shape[0])
    grad_x = torch.empty_like(flat)
    grads_w = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in (gate, up, down)]
    for start, end in _chunks(flat.shape[0], chunk):
        rows, g_out = flat[start:end], grad_out[start:end]
        pre = F.linear(rows, gate)  # recomputed: nothing of [tokens, intermediate] was saved
        upped = F.linear(rows, up)
        activated = act(pre)
        g_hidden = g_out @ down
        grads_w[2] += (g_out.t() @ (activated * upped)).float()
        g_pre = act_backward(g_hidden * upped, pre)
        g_up = g_hidden * activated
        grad_x[start:end] = g_pre @ gate + g_up @ up
        grads_w[0] += (g_pre.t() @ rows).float()
        grads_w[1] += (g_up.t() @ rows).float()
    return (grad_x.view(x.shape), *(g.to(w.dtype) for g, w in zip(grads_w, (gate, up, down))))


ops.register_tiled_mlp_kernels(gated_mlp, gated_mlp_backward)
