"""Models, data and training loops for parity tests: a distributed engine run against
single-process training of the same model on the same data.

Each case is addressed by name so that test bodies (run in spawned rank processes) can rebuild
it. Every rank trains on its slice of each global batch and reports the mean of the ranks' losses,
which equals the single-process loss on the whole batch (equal slice sizes).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

GLOBAL_BATCH = 12  # divisible by world sizes 2, 3, 4


# ---- models ------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Layer sizes not divisible by 2 or 3: every shard is padded."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 5)

    def forward(self, x, y):
        return ((self.fc2(torch.nn.functional.gelu(self.fc1(x))) - y) ** 2).mean()


class GraphBreakMLP(MLP):
    """Dynamo splits the forward into two graphs around the break."""

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.fc1(x))
        torch._dynamo.graph_break()
        return ((self.fc2(h) - y) ** 2).mean()


class DisabledForwardMLP(MLP):
    """A forward under ``torch.compiler.disable``: Dynamo skips the frame, so the whole forward runs
    eagerly and no graph of it is compiled."""

    @torch.compiler.disable
    def forward(self, x, y):
        return super().forward(x, y)


class PartlyDisabledMLP(MLP):
    """One compiled graph plus one eager frame in the same forward and backward."""

    @torch.compiler.disable
    def _head(self, h):
        return self.fc2(h)

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.fc1(x))
        return ((self._head(h) - y) ** 2).mean()


class TiedEmbeddingLM(nn.Module):
    """Input embedding and output projection share one parameter."""

    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens, targets):
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LoRAMLP(MLP):
    """Frozen base weights, trainable low-rank adapters (only some parameters train)."""

    def __init__(self):
        super().__init__()
        for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight):
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(3, 7) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(13, 3) * 0.1)

    def forward(self, x, y):
        h = self.fc1(x) + x @ self.lora_a.t() @ self.lora_b.t()
        return ((self.fc2(torch.nn.functional.gelu(h)) - y) ** 2).mean()


class ViewAcrossBreakMLP(MLP):
    """A view of a parameter made before a graph break and used after it: the first graph
    returns the view, which aot_autograd would re-create from the (placeholder) parameter."""

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.fc1(x))
        w = self.fc2.weight.t()
        torch._dynamo.graph_break()
        return ((h @ w + self.fc2.bias - y) ** 2).mean()


class _BrokenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(7, 7)
        self.outer = nn.Linear(7, 7)

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        torch._dynamo.graph_break()
        return x + self.outer(h)


class RepeatedBrokenBlocks(nn.Module):
    """Identical blocks with a graph break inside each: Dynamo compiles each half of the block's
    forward once and calls that code for every block, with that block's parameters."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_BrokenBlock() for _ in range(3)])
        self.head = nn.Linear(7, 5)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return ((self.head(x) - y) ** 2).mean()


# A grouped matmul as a custom operator whose backward reads the group offsets on the host, like
# transformers' grouped-mm expert fallback (5.17): aot_autograd cannot trace that backward, so a
# graph containing the op cannot be compiled and Dynamo runs the op eagerly between graphs.
@torch.library.custom_op("dc_parity::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], weight.shape[2])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[expert]
        start = end
    return out


@grouped_mm.register_fake
def _(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[2])


def _grouped_mm_setup(ctx, inputs, output):
    x, weight, offsets = inputs
    ctx.save_for_backward(x, weight)
    ctx.offsets = offsets


def _grouped_mm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
    start = 0
    for expert, end in enumerate(ctx.offsets.tolist()):
        if end > start:
            grad_x[start:end] = grad[start:end] @ weight[expert].t()
            grad_w[expert] = x[start:end].t() @ grad[start:end]
        start = end
    return grad_x, grad_w, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


class _GroupedExperts(nn.Module):
    def __init__(self, experts=3, dim=7):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim, dim) * 0.3)  # (expert, out, in)

    def forward(self, h, expert_ids):
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids, minlength=self.weight.shape[0])
        offsets = torch.cumsum(counts, 0)
        out = grouped_mm(h[order], self.weight.transpose(-2, -1), offsets)
        return torch.empty_like(out).index_copy(0, order, out)


class _ExpertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(7, 3)
        self.experts = _GroupedExperts()

    def forward(self, h):
        return h + self.experts(h, self.router(h).argmax(-1))


class CustomOpExpertsMLP(nn.Module):
    """Two routed expert layers computed by ``grouped_mm`` (two layers: the same frames run
    for both, with different parameters)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 7)
        self.layers = nn.ModuleList([_ExpertLayer(), _ExpertLayer()])
        self.fc2 = nn.Linear(7, 5)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        for layer in self.layers:
            h = layer(h)
        return ((self.fc2(h) - y) ** 2).mean()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=61, hidden_size=24, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def tiny_qwen2_moe():
    """Qwen2-MoE with every expert kernel transformers picks for it: on CPU/fp32 its grouped-mm
    fallback, a custom op that needs its inputs' exact strides and takes a view of a parameter."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=61, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2MoeForCausalLM(cfg)


class LlamaLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama()

    def forward(self, tokens, targets):
        # Training builds no KV cache (transformers' default would fill one per forward).
        return self.model(input_ids=tokens, labels=targets, use_cache=False).loss


class Qwen2MoeLoss(LlamaLoss):
    def __init__(self):
        nn.Module.__init__(self)
        self.model = tiny_qwen2_moe()


MODELS: Dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "graph_break": GraphBreakMLP,
    "view_across_break": ViewAcrossBreakMLP,
    "repeated_broken_blocks": RepeatedBrokenBlocks,
    "custom_op_experts": CustomOpExpertsMLP,
    "disabled_forward": DisabledForwardMLP,
    "partly_disabled": PartlyDisabledMLP,
    "tied": TiedEmbeddingLM,
    "lora": LoRAMLP,
    "llama": LlamaLoss,
    "qwen2_moe": Qwen2MoeLoss,
}
TOKEN_MODELS = {"tied": 11, "llama": 61, "qwen2_moe": 61}


def build_model(name: str, dtype=torch.float32, device="cpu") -> nn.Module:
    torch.manual_seed(1234)
    return MODELS[name]().to(device=device, dtype=dtype)


def batch(name: str, step: int, device="cpu", dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    if name in TOKEN_MODELS:
        tokens = torch.randint(0, TOKEN_MODELS[name], (GLOBAL_BATCH, 8), generator=g)
        return tokens.to(device), tokens.to(device)
    x = torch.randn(GLOBAL_BATCH, 7, generator=g)
    y = torch.randn(GLOBAL_BATCH, 5, generator=g)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


OPTIMIZERS = ("adamw", "sgd_momentum")


def make_optimizer(params, kind: str = "adamw") -> torch.optim.Optimizer:
    """The parity suites' optimizers. AdamW is what training uses, but its update m/sqrt(v) is
    nearly blind to a uniform gradient scale (a sum instead of a mean, a doubled reduction,
    clipping that never binds change it only through eps). SGD with momentum moves each parameter
    in proportion to its gradient, so the same errors change every update by their factor; the
    core cases run with both."""
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if kind != "adamw":
        raise ValueError(f"unknown optimizer {kind!r}; known: {OPTIMIZERS}")
    # Adam divides by sqrt(v): a near-zero gradient whose last bits differ between the sharded and
    # the single-process sum turns into a full +-lr update. eps=1e-3 damps that amplification of
    # summation-order noise (seen on GPUs at 3e-4 after one step). It does not make Adam see a
    # uniform gradient scale: assert_parity compares the gradient norms for that.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-3)


# ---- training loops ------------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    losses: List[float]
    params: Dict[str, torch.Tensor]
    # The global L2 norm of each optimizer step's gradients before clipping (None: not recorded).
    # The losses and parameters of an AdamW run hardly see a uniform gradient scale; these do.
    grad_norms: Optional[List[float]] = None


def global_grad_norm(params, clip: float = 0.0) -> float:
    """Single process: the global L2 norm of the gradients of ``params`` before clipping (what
    ``engine.step()`` returns), clipping them to ``clip`` when it is positive."""
    grads = [p for p in params if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(grads, clip if clip > 0 else float("inf")).item()


def train_reference(name: str, steps: int, gas: int = 1, clip: float = 0.0, device="cpu",
                    optimizer: str = "adamw") -> RunResult:
    """Single process, fp32, whole batches, on ``device``."""
    model = build_model(name, device=device)
    opt = make_optimizer([p for p in model.parameters()], optimizer)
    losses, norms = [], []
    for step in range(steps):
        loss = model(*batch(name, step, device=device))
        (loss / gas).backward()
        losses.append(loss.item())
        if (step + 1) % gas == 0:
            # max_norm inf when not clipping: the norm is computed, the gradients scaled by 1.
            norms.append(global_grad_norm(model.parameters(), clip))
            opt.step()
            opt.zero_grad()
    params = {k: v.detach().float().cpu() for k, v in model.named_parameters(remove_duplicate=False)}
    return RunResult(losses, params, norms)


# DC_TEST_OFFLOAD: run a whole parity suite with offload kinds on ("opt_states", "params",
# "activations", comma-separated, or "all"), each where it applies: parameter offload to ZeRO-3,
# activation offload and free_activation to compiled engines.
TEST_OFFLOAD_KINDS = ("opt_states", "params", "activations")


def with_test_offload(config: dict, compiled: bool) -> dict:
    wanted = os.environ.get("DC_TEST_OFFLOAD", "")
    kinds = TEST_OFFLOAD_KINDS if wanted == "all" else tuple(k for k in wanted.split(",") if k)
    unknown = set(kinds) - set(TEST_OFFLOAD_KINDS)
    if unknown:
        raise ValueError(f"DC_TEST_OFFLOAD: unknown kinds {sorted(unknown)}; known: {TEST_OFFLOAD_KINDS} or all")
    extra = {}
    if "opt_states" in kinds:
        extra["offload_opt_states"] = True
    if "params" in kinds and config.get("zero_optimization", {}).get("stage") == 3:
        extra["offload_parameters"] = True
    if "activations" in kinds and compiled:
        extra.update(offload_activation=True, free_activation=True)
    return {**config, "compile": {**config.get("compile", {}), **extra}} if extra else config


def train_engine(
    name: str,
    steps: int,
    config: dict,
    backend: Optional[str],
    device: torch.device,
    dtype=torch.float32,
    use_torch_compile_api: bool = False,
    regional: bool = False,
    optimizer: str = "adamw",
):
    """Distributed run through deepcompile; returns (RunResult, engine). ``regional``: compile
    each decoder layer on its own (engine.compile(regional=True)); DC_TEST_REGIONAL=1 turns it on
    for every case whose model names its layers (``_no_split_modules``)."""
    import deepcompile

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(name, dtype=dtype, device=device)
    if os.environ.get("DC_DEBUG_CHECKS") == "1":  # run a whole suite with compile.debug_checks on
        config = {**config, "compile": {**config.get("compile", {}), "debug_checks": True}}
    config = with_test_offload(config, compiled=backend is not None or use_torch_compile_api)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters(), optimizer), config)
    if use_torch_compile_api:
        compiled = torch.compile(engine.module, backend="deepcompile", options={"inner": backend})
        engine._compiled = compiled
    elif backend is not None:
        if os.environ.get("DC_TEST_REGIONAL") == "1" and _has_blocks(model):
            regional = True
        engine.compile(backend=backend, regional=regional)
    return run_steps(engine, name, steps, device, dtype=dtype), engine


def _has_blocks(model: nn.Module) -> bool:
    return any(getattr(m, "_no_split_modules", None) for m in model.modules())


def run_steps(engine, name: str, steps: int, device: torch.device, dtype=torch.float32,
              after_step=None) -> RunResult:
    """Train ``engine`` for ``steps`` micro-steps on this rank's slice of each global batch; the
    losses are averaged over the ranks, the parameters gathered on every rank, the gradient norm
    of every optimizer step kept. ``after_step(engine, step)`` runs after each ``engine.step()``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = GLOBAL_BATCH // world
    losses, norms = [], []
    for step in range(steps):
        a, b = batch(name, step, device=device, dtype=dtype)
        loss = engine(a[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n])
        engine.backward(loss)
        norm = engine.step()
        if norm is not None:  # an optimizer step (the accumulation boundary)
            norms.append(norm.item())
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if after_step is not None:
            after_step(engine, step)
    params = {k: v.float() for k, v in engine.full_state_dict(all_ranks=True).items()}
    return RunResult(losses, params, norms)


def assert_parity(got: RunResult, ref: RunResult, rtol: float, atol: float) -> None:
    """Losses, final parameters and, where both runs recorded them, the gradient norm of every
    optimizer step, against the reference. The norms are compared relatively only (``rtol``, no
    ``atol``): a scale error (unaveraged, doubled, summed over micro-steps) is a factor, which an
    absolute slack would hide in a small norm. A result that records norms against one that does
    not fails: a run that forgets them must not pass silently."""
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"{m}\nlosses:    {got.losses}\nreference: {ref.losses}")
    if (got.grad_norms is None) != (ref.grad_norms is None):
        which = "the run" if got.grad_norms is None else "the reference"
        raise AssertionError(f"{which} recorded no gradient norms; record them on both sides (RunResult.grad_norms)")
    if got.grad_norms is not None:
        assert len(got.grad_norms) == len(ref.grad_norms), \
            f"{len(got.grad_norms)} optimizer steps against {len(ref.grad_norms)} in the reference"
        torch.testing.assert_close(torch.tensor(got.grad_norms, dtype=torch.float64),
                                   torch.tensor(ref.grad_norms, dtype=torch.float64), rtol=rtol, atol=0,
                                   msg=lambda m: f"global gradient norms: {m}\nnorms:     {got.grad_norms}\n"
                                                 f"reference: {ref.grad_norms}")
    missing = set(ref.params) - set(got.params)
    assert not missing, f"full_state_dict lacks {sorted(missing)}"
    for key in ref.params:
        torch.testing.assert_close(got.params[key], ref.params[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
