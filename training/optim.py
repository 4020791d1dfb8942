"""The optimizers and their schedules: AdamW alone (`optimizer=adamw`), or Muon on the transformer blocks' 2-D
matrices beside AdamW on everything else (`optimizer=muon`), behind one `Optimizers` object the loops step,
checkpoint and resume; warmup + cosine learning rates, each group from its own peak, and Muon's momentum warm-up.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from model.gpt import Block
from training.config import TrainConfig
from training.errors import TrainError


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup for warmup_iters steps, then cosine decay to min_lr at decay_iters, then min_lr."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.decay_iters:
        return cfg.min_lr
    ratio = (step - cfg.warmup_iters) / max(1, cfg.decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def muon_momentum_at(step: int, cfg: TrainConfig) -> float:
    """Muon's momentum: linear from muon_momentum_start to muon_momentum over muon_momentum_warmup steps
    (modded-nanogpt warms 0.85 -> 0.95 over 300 steps), then constant."""
    if step >= cfg.muon_momentum_warmup:
        return cfg.muon_momentum
    frac = step / cfg.muon_momentum_warmup
    return cfg.muon_momentum_start + frac * (cfg.muon_momentum - cfg.muon_momentum_start)


def _newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                   eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalisation, in the gradient's own dtype."""
    a, b, c = coefficients
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon (same state, same update), with the Newton-Schulz iteration in fp32 on a CPU: torch's is
    always bf16, which a CPU without bf16 matmul units runs ~30x slower (docs/performance.md)."""

    @torch.no_grad()
    def step(self, closure=None):
        if not any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        assert closure is None, "closures are not supported"
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            for p, g, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                update = _newton_schulz(update.float(), group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-torch.optim._muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return None


def split_params(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the transformer blocks' 2-D matrices: attention and MLP weights, for Muon; everything else: the tied
    embedding/head, position table, biases, LayerNorms, a task head)."""
    matrices = {id(p) for m in model.modules() if isinstance(m, Block) for p in m.parameters()
                if p.requires_grad and p.dim() == 2}
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) in matrices], [p for p in params if id(p) not in matrices]


class Optimizers:
    """The run's optimizers as one: step, zero_grad, the schedule, and a state dict that says which optimizer it
    belongs to (`--resume` refuses the other's)."""

    def __init__(self, kind: str, parts: dict[str, torch.optim.Optimizer]) -> None:
        self.kind, self.parts = kind, parts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.parts.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def schedule(self, step: int, cfg: TrainConfig) -> float:
        """Set this step's learning rates (the warmup + cosine schedule from each optimizer's own peak:
        learning_rate for AdamW, muon_lr for Muon) and Muon's momentum; returns AdamW's learning rate."""
        lr = lr_at(step, cfg)
        for group in self.parts["adamw"].param_groups:
            group["lr"] = lr
        if "muon" in self.parts:
            for group in self.parts["muon"].param_groups:
                group["lr"] = cfg.muon_lr * lr / cfg.learning_rate
                group["momentum"] = muon_momentum_at(step, cfg)
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **{name: opt.state_dict() for name, opt in self.parts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kind = state.get("kind", "adamw")  # checkpoints from before optimizer=muon hold AdamW's state dict alone
        if kind != self.kind:
            raise TrainError(f"--resume: the run's optimizer state is {kind}'s, not {self.kind}'s; continue it "
                             f"with --set optimizer={kind}, or start a new run from its weights with --init-from")
        if "kind" not in state:
            state = {"adamw": state}
        for name, opt in self.parts.items():
            opt.load_state_dict(state[name])


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> Optimizers:
    """AdamW (weight decay on 2-D tensors only, never on biases or LayerNorm) on all parameters, or on all but the
    blocks' matrices, which Muon then optimises (optimizer=muon)."""
    params = [p for p in model.parameters() if p.requires_grad]
    parts: dict[str, torch.optim.Optimizer] = {}
    if cfg.optimizer == "muon":
        matrices, params = split_params(model)
        parts["muon"] = Muon(matrices, lr=cfg.muon_lr,
                             weight_decay=cfg.muon_weight_decay, momentum=muon_momentum_at(0, cfg),
                             adjust_lr_fn=cfg.muon_adjust_lr)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    parts["adamw"] = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), **extra)
    return Optimizers(cfg.optimizer, parts)
