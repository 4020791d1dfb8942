"""One transformer block's forward and backward pass by hand: a reference for reading, not used in training.

Everything here is a matmul, an elementwise op or a sum over an axis; nothing is recorded for autograd
(every function runs under torch.no_grad and nothing calls .backward or autograd.grad). Each `*_forward`
returns its output and a cache of what the backward needs; each `*_backward` takes dL/d(output) and that
cache and returns dL/d(input) and the parameter gradients. The derivation, step by step, is docs/backward.md.

The block is model.gpt.Block, in both of its forms:
- pre-norm (GPT-2):          h = x + attn(LN1(x)),  out = h + mlp(LN2(h))
- post-norm (the original):  h = LN1(x + attn(x)),  out = LN2(h + mlp(h))
with mlp = c_proj(act(c_fc(·))), act = GELU (tanh approximation) or ReLU. Parameters are a dict keyed and
laid out as Block.state_dict() (weights (out_features, in_features) as nn.Linear; biases may be absent),
and the gradients come back under the same keys, so the tests check this file against autograd on
model.gpt.Block itself. The loss side (output layer logits = h Wᵀ + b, softmax cross-entropy) is here too.
"""

from __future__ import annotations

import math

import torch

# -----------------------------------------------------------------------------
# linear layer: y = x Wᵀ + b


@torch.no_grad()
def linear_forward(x, w, b=None):
    # x (..., in), w (out, in), b (out,) or None -> y (..., out)
    y = x @ w.T
    if b is not None:
        y = y + b
    return y, (x, w, b is not None)


@torch.no_grad()
def linear_backward(dy, cache):
    # dy (..., out) -> dx (..., in), dw (out, in), db (out,) or None
    x, w, has_bias = cache
    dx = dy @ w  # (..., out) @ (out, in)
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])  # every position is a row: (N, out), (N, in)
    dw = dy2.T @ x2  # (out, N) @ (N, in)
    db = dy2.sum(0) if has_bias else None
    return dx, dw, db


# -----------------------------------------------------------------------------
# activations


@torch.no_grad()
def relu_forward(u):
    return u * (u > 0), u


@torch.no_grad()
def relu_backward(dy, u):
    return dy * (u > 0)  # ReLU'(u) = 1 where u > 0, else 0


GELU_C = math.sqrt(2.0 / math.pi)


@torch.no_grad()
def gelu_forward(u):
    # GELU, tanh approximation (GPT-2): 0.5 u (1 + tanh(√(2/π) (u + 0.044715 u³)))
    t = torch.tanh(GELU_C * (u + 0.044715 * u**3))
    return 0.5 * u * (1.0 + t), (u, t)


@torch.no_grad()
def gelu_backward(dy, cache):
    u, t = cache
    ds_du = GELU_C * (1.0 + 3 * 0.044715 * u**2)  # s = √(2/π)(u + 0.044715 u³), t = tanh(s)
    dgelu = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t**2) * ds_du  # product rule, tanh' = 1 - tanh²
    return dy * dgelu


ACTIVATIONS = {"gelu": (gelu_forward, gelu_backward), "relu": (relu_forward, relu_backward)}


# -----------------------------------------------------------------------------
# LayerNorm over the last axis: y = x̂ ⊙ w + b, x̂ = (x - μ) / σ, σ = √(var + eps) (biased variance)


@torch.no_grad()
def layernorm_forward(x, w, b=None, eps=1e-5):
    # x (..., C), w (C,), b (C,) or None -> y (..., C)
    mu = x.mean(-1, keepdim=True)  # (..., 1)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)  # (..., 1)
    rstd = 1.0 / torch.sqrt(var + eps)  # 1/σ, (..., 1)
    xhat = (x - mu) * rstd  # (..., C)
    y = xhat * w
    if b is not None:
        y = y + b
    return y, (xhat, rstd, w, b is not None)


@torch.no_grad()
def layernorm_backward(dy, cache):
    # dy (..., C) -> dx (..., C), dw (C,), db (C,) or None
    xhat, rstd, w, has_bias = cache
    C = xhat.shape[-1]
    dw = (dy * xhat).reshape(-1, C).sum(0)
    db = dy.reshape(-1, C).sum(0) if has_bias else None
    dxhat = dy * w  # (..., C)
    # dx = (1/σ) (dx̂ - mean(dx̂) - x̂ ⊙ mean(dx̂ ⊙ x̂)), means over the C features of each position
    dx = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx, dw, db


# -----------------------------------------------------------------------------
# softmax over the last axis, and softmax cross-entropy


@torch.no_grad()
def softmax_forward(s):
    # s (..., n) -> p (..., n); entries of -inf (masked) get probability 0
    e = torch.exp(s - s.max(-1, keepdim=True).values)  # shift by the row max: same softmax, no overflow
    return e / e.sum(-1, keepdim=True)


@torch.no_grad()
def softmax_backward(dp, p):
    # dS_ij = P_ij (dP_ij - Σ_k dP_ik P_ik)
    return p * (dp - (dp * p).sum(-1, keepdim=True))


@torch.no_grad()
def cross_entropy_forward(logits, targets, ignore_index=-1):
    # logits (N, V), targets (N,) ints -> mean over the counted rows of -log softmax(logits)[target]
    N, V = logits.shape
    keep = targets != ignore_index  # (N,) rows that count, as F.cross_entropy(..., ignore_index=-1)
    n = keep.sum()
    m = logits.max(-1, keepdim=True).values
    logp = logits - m - torch.log(torch.exp(logits - m).sum(-1, keepdim=True))  # log softmax, (N, V)
    onehot = torch.zeros_like(logits)
    onehot[torch.arange(N)[keep], targets[keep]] = 1.0  # (N, V), rows of ignored targets stay 0
    loss = -(logp * onehot).sum() / n
    return loss, (torch.exp(logp), onehot, keep, n)


@torch.no_grad()
def cross_entropy_backward(cache, dloss=1.0):
    # dL/dlogits = (softmax - onehot) / n on counted rows, 0 on ignored ones
    probs, onehot, keep, n = cache
    return dloss * (probs - onehot) * keep[:, None] / n  # (N, V)


@torch.no_grad()
def head_loss_forward(h, w, targets, b=None, ignore_index=-1):
    # output layer and loss: h (B, T, C), w (V, C) -> logits (B, T, V) = h Wᵀ + b, mean cross-entropy
    logits, lin = linear_forward(h, w, b)
    loss, ce = cross_entropy_forward(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index)
    return logits, loss, (lin, ce, logits.shape)


@torch.no_grad()
def head_loss_backward(cache):
    # -> dh (B, T, C), dw (V, C), db (V,) or None
    lin, ce, shape = cache
    dlogits = cross_entropy_backward(ce).reshape(shape)
    return linear_backward(dlogits, lin)


# -----------------------------------------------------------------------------
# causal multi-head self-attention: fused qkv = x W_attnᵀ, per head softmax(q kᵀ/√D + mask) v, then c_proj


@torch.no_grad()
def split_heads(t, n_head):
    B, T, C = t.shape
    return t.reshape(B, T, n_head, C // n_head).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)


@torch.no_grad()
def merge_heads(t):
    B, H, T, D = t.shape
    return t.transpose(1, 2).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, C)


@torch.no_grad()
def attention_forward(x, w_attn, b_attn, w_proj, b_proj, n_head):
    # x (B, T, C), w_attn (3C, C), w_proj (C, C) -> y (B, T, C)
    B, T, C = x.shape
    qkv, lin_attn = linear_forward(x, w_attn, b_attn)  # (B, T, 3C)
    q, k, v = (split_heads(t, n_head) for t in qkv.split(C, dim=-1))  # each (B, H, T, D)
    scale = 1.0 / math.sqrt(C // n_head)
    s = (q @ k.transpose(-2, -1)) * scale  # scores (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # key j > query i: masked
    s = s.masked_fill(future, float("-inf"))
    p = softmax_forward(s)  # (B, H, T, T), exactly 0 above the diagonal
    z = merge_heads(p @ v)  # (B, H, T, T) @ (B, H, T, D) -> (B, T, C)
    y, lin_proj = linear_forward(z, w_proj, b_proj)
    return y, (lin_attn, q, k, v, p, scale, lin_proj)


@torch.no_grad()
def attention_backward(dy, cache):
    # dy (B, T, C) -> dx (B, T, C), dw_attn (3C, C), db_attn, dw_proj (C, C), db_proj
    lin_attn, q, k, v, p, scale, lin_proj = cache
    dz, dw_proj, db_proj = linear_backward(dy, lin_proj)  # (B, T, C)
    dz = split_heads(dz, q.shape[1])  # (B, H, T, D)
    dp = dz @ v.transpose(-2, -1)  # Z = P V: dP = dZ Vᵀ, (B, H, T, T)
    dv = p.transpose(-2, -1) @ dz  # dV = Pᵀ dZ, (B, H, T, D)
    ds = softmax_backward(dp, p)  # masked entries have P = 0, so dS = 0 there: the mask passes no gradient
    dq = (ds @ k) * scale  # S = Q Kᵀ/√D: dQ = dS K/√D
    dk = (ds.transpose(-2, -1) @ q) * scale  # dK = dSᵀ Q/√D
    dqkv = torch.cat([merge_heads(dq), merge_heads(dk), merge_heads(dv)], dim=-1)  # (B, T, 3C)
    dx, dw_attn, db_attn = linear_backward(dqkv, lin_attn)
    return dx, dw_attn, db_attn, dw_proj, db_proj


# -----------------------------------------------------------------------------
# MLP: c_proj(act(c_fc(x)))


@torch.no_grad()
def mlp_forward(x, w_fc, b_fc, w_proj, b_proj, activation="gelu"):
    # x (B, T, C), w_fc (4C, C), w_proj (C, 4C) -> y (B, T, C)
    u, lin_fc = linear_forward(x, w_fc, b_fc)  # (B, T, 4C)
    a, act = ACTIVATIONS[activation][0](u)
    y, lin_proj = linear_forward(a, w_proj, b_proj)
    return y, (lin_fc, activation, act, lin_proj)


@torch.no_grad()
def mlp_backward(dy, cache):
    # dy (B, T, C) -> dx (B, T, C), dw_fc, db_fc, dw_proj, db_proj
    lin_fc, activation, act, lin_proj = cache
    da, dw_proj, db_proj = linear_backward(dy, lin_proj)  # (B, T, 4C)
    du = ACTIVATIONS[activation][1](da, act)
    dx, dw_fc, db_fc = linear_backward(du, lin_fc)
    return dx, dw_fc, db_fc, dw_proj, db_proj


# -----------------------------------------------------------------------------
# the block


@torch.no_grad()
def _attn(x, params, n_head):
    return attention_forward(x, params["attn.c_attn.weight"], params.get("attn.c_attn.bias"),
                             params["attn.c_proj.weight"], params.get("attn.c_proj.bias"), n_head)


@torch.no_grad()
def _mlp(x, params, activation):
    return mlp_forward(x, params["mlp.c_fc.weight"], params.get("mlp.c_fc.bias"),
                       params["mlp.c_proj.weight"], params.get("mlp.c_proj.bias"), activation)


@torch.no_grad()
def _ln(x, params, name, eps):
    return layernorm_forward(x, params[f"{name}.weight"], params.get(f"{name}.bias"), eps)


@torch.no_grad()
def block_forward(x, params, n_head, norm="pre", activation="gelu", eps=1e-5):
    # x (B, T, C), params keyed as model.gpt.Block.state_dict() -> out (B, T, C)
    if norm == "pre":  # GPT-2: h = x + attn(LN1(x)), out = h + mlp(LN2(h))
        a, ln1 = _ln(x, params, "ln_1", eps)
        att, attn = _attn(a, params, n_head)
        h = x + att
        b, ln2 = _ln(h, params, "ln_2", eps)
        m, mlp = _mlp(b, params, activation)
        out = h + m
    elif norm == "post":  # h = LN1(x + attn(x)), out = LN2(h + mlp(h))
        att, attn = _attn(x, params, n_head)
        h, ln1 = _ln(x + att, params, "ln_1", eps)
        m, mlp = _mlp(h, params, activation)
        out, ln2 = _ln(h + m, params, "ln_2", eps)
    else:
        raise ValueError(f"norm must be 'pre' or 'post', got {norm!r}")
    return out, (norm, ln1, attn, ln2, mlp)


@torch.no_grad()
def block_backward(dout, cache):
    # dout = dL/d(out) (B, T, C) -> dL/dx (B, T, C), {param name: dL/d(param)} (biases only where present)
    norm, ln1, attn, ln2, mlp = cache
    g = {}
    if norm == "pre":
        # out = h + mlp(LN2(h)): the residual passes dout to h unchanged, the branch adds its own part
        db, g["mlp.c_fc.weight"], g["mlp.c_fc.bias"], g["mlp.c_proj.weight"], g["mlp.c_proj.bias"] = \
            mlp_backward(dout, mlp)
        dh_branch, g["ln_2.weight"], g["ln_2.bias"] = layernorm_backward(db, ln2)
        dh = dout + dh_branch
        # h = x + attn(LN1(x)): same again
        da, g["attn.c_attn.weight"], g["attn.c_attn.bias"], g["attn.c_proj.weight"], g["attn.c_proj.bias"] = \
            attention_backward(dh, attn)
        dx_branch, g["ln_1.weight"], g["ln_1.bias"] = layernorm_backward(da, ln1)
        dx = dh + dx_branch
    else:
        # out = LN2(r2), r2 = h + mlp(h)
        dr2, g["ln_2.weight"], g["ln_2.bias"] = layernorm_backward(dout, ln2)
        dh_branch, g["mlp.c_fc.weight"], g["mlp.c_fc.bias"], g["mlp.c_proj.weight"], g["mlp.c_proj.bias"] = \
            mlp_backward(dr2, mlp)
        dh = dr2 + dh_branch
        # h = LN1(r1), r1 = x + attn(x)
        dr1, g["ln_1.weight"], g["ln_1.bias"] = layernorm_backward(dh, ln1)
        dx_branch, g["attn.c_attn.weight"], g["attn.c_attn.bias"], g["attn.c_proj.weight"], g["attn.c_proj.bias"] = \
            attention_backward(dr1, attn)
        dx = dr1 + dx_branch
    return dx, {name: grad for name, grad in g.items() if grad is not None}
