"""model/backward.py (the hand-written backward pass) against autograd on model.gpt.Block, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import backward as bw
from model.config import GPTConfig
from model.gpt import Block

TOL = 1e-8
# (batch, T, C, n_head)
SHAPES = [(2, 5, 8, 2), (1, 1, 4, 1), (3, 7, 12, 3), (2, 9, 16, 4)]
FORMS = [("post", "relu"), ("pre", "gelu"), ("pre", "relu"), ("post", "gelu")]  # seed's form, GPT-2's, mixes


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def make_block(C: int, n_head: int, norm: str, activation: str, bias: bool, seed: int) -> Block:
    """A float64 Block with every parameter random (not the all-ones / all-zeros LayerNorm defaults)."""
    torch.manual_seed(seed)
    config = GPTConfig(n_embd=C, n_head=n_head, norm=norm, activation=activation, bias=bias, dropout=0.0)
    block = Block(config).double().eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("ln_") and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("weight"):
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return block


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("norm,activation", FORMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_block_matches_autograd(shape, norm, activation, bias):
    B, T, C, H = shape
    block = make_block(C, H, norm, activation, bias, seed=B * 1000 + T * 100 + C)
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(B, T, C, dtype=torch.float64)

    out = block(x)
    (out * dout).sum().backward()  # L = <out, dout>, so dL/d(out) = dout

    params = params_of(block)
    out_hand, cache = bw.block_forward(x.detach(), params, H, norm, activation, block.ln_1.eps)
    dx, grads = bw.block_backward(dout, cache)

    assert rel_err(out_hand, out.detach()) <= 1e-12
    names = {n for n, _ in block.named_parameters()}
    assert set(grads) == names  # a gradient for every parameter, biases only where the block has them
    assert rel_err(dx, x.grad) <= TOL
    for name, p in block.named_parameters():
        assert grads[name].shape == p.shape, name
        assert rel_err(grads[name], p.grad) <= TOL, name


def test_causal_mask_blocks_the_future():
    """Changing the last position leaves every earlier output, and every earlier input's gradient from them, alone."""
    block = make_block(8, 2, "pre", "gelu", True, seed=1)
    params = params_of(block)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    x2 = x.clone()
    x2[:, -1] += 1.0
    out, cache = bw.block_forward(x, params, 2)
    out2, _ = bw.block_forward(x2, params, 2)
    assert torch.equal(out[:, :-1], out2[:, :-1])
    dout = torch.zeros_like(out)
    dout[:, 2] = 1.0  # a loss on position 2 only
    dx, _ = bw.block_backward(dout, cache)
    assert dx[:, 3:].abs().max() == 0 and dx[:, :3].abs().max() > 0


def test_no_autograd_graph():
    """Hand passes build no graph even when given tensors that require grad."""
    block = make_block(8, 2, "post", "relu", True, seed=2)
    params = {k: v.requires_grad_() for k, v in params_of(block).items()}
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    out, cache = bw.block_forward(x, params, 2, "post", "relu")
    dx, grads = bw.block_backward(torch.ones_like(out), cache)
    for t in [out, dx, *grads.values()]:
        assert t.grad_fn is None and not t.requires_grad


@pytest.mark.parametrize("bias", [True, False])
def test_head_cross_entropy(bias):
    torch.manual_seed(3)
    B, T, C, V = 3, 4, 8, 11
    h = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, C, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (B, T))
    targets[0, 1] = targets[2, 3] = -1  # ignored, as GPT.forward's ignore_index=-1

    logits = F.linear(h, w, b)
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1)
    loss.backward()

    b_hand = None if b is None else b.detach()
    logits_hand, loss_hand, cache = bw.head_loss_forward(h.detach(), w.detach(), targets, b_hand)
    dh, dw, db = bw.head_loss_backward(cache)
    assert rel_err(logits_hand, logits.detach()) <= 1e-12
    assert abs(loss_hand.item() - loss.item()) <= 1e-12 * abs(loss.item())
    assert rel_err(dh, h.grad) <= TOL
    assert rel_err(dw, w.grad) <= TOL
    assert (db is None) if b is None else rel_err(db, b.grad) <= TOL


@pytest.mark.parametrize("norm,activation", FORMS[:2])
def test_block_head_loss_end_to_end(norm, activation):
    """block → (ln_f for pre-norm, as GPT) → head → cross-entropy, backpropagated by hand from the loss."""
    B, T, C, H, V = 2, 6, 12, 3, 17
    block = make_block(C, H, norm, activation, True, seed=4)
    ln_f = nn.LayerNorm(C).double()
    torch.manual_seed(5)
    with torch.no_grad():
        ln_f.weight.copy_(1.0 + 0.3 * torch.randn(C))
        ln_f.bias.copy_(0.3 * torch.randn(C))
    w_head = torch.randn(V, C, dtype=torch.float64, requires_grad=True)
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T))

    h = block(x)
    if norm == "pre":
        h = ln_f(h)
    loss = F.cross_entropy(F.linear(h, w_head).view(-1, V), targets.view(-1))
    loss.backward()

    h_hand, cache = bw.block_forward(x.detach(), params_of(block), H, norm, activation)
    if norm == "pre":
        h_hand, ln_cache = bw.layernorm_forward(h_hand, ln_f.weight.detach(), ln_f.bias.detach())
    _, loss_hand, head_cache = bw.head_loss_forward(h_hand, w_head.detach(), targets)
    dh, dw_head, _ = bw.head_loss_backward(head_cache)
    if norm == "pre":
        dh, dw_lnf, db_lnf = bw.layernorm_backward(dh, ln_cache)
        assert rel_err(dw_lnf, ln_f.weight.grad) <= TOL
        assert rel_err(db_lnf, ln_f.bias.grad) <= TOL
    dx, grads = bw.block_backward(dh, cache)

    assert abs(loss_hand.item() - loss.item()) <= 1e-12 * abs(loss.item())
    assert rel_err(dw_head, w_head.grad) <= TOL
    assert rel_err(dx, x.grad) <= TOL
    for name, p in block.named_parameters():
        assert rel_err(grads[name], p.grad) <= TOL, name
