"""The matmul behind every Linear layer: weight formats and CPU kernels, chosen at load, never on a request.

The network (model/gpt.py) is built of plain nn.Linear layers and calls `linear(x, layer, act)`. For serving,
`convert(model, fmt)` swaps each block's nn.Linear for a module of this file holding ONE copy of its weight, in
the layout its kernel reads (gpt-fast's quantize.py: `WeightOnlyInt8Linear` swapped in at load):

- `PackedLinear`  fp32 or bf16 on a CPU whose oneDNN packs that dtype (`model.cpu_support`: bf16 needs AVX-512 or
                  AVX-NE-CONVERT; elsewhere the plain nn.Linear stays, through F.linear): the weight in oneDNN's
                  blocked layout (the plain copy is freed). oneDNN
                  reordered a plain weight on every batched call; the packed copy saves that (docs/performance.md).
- `Int8Linear`    int8 per output channel (symmetric, scale = max|w| / 127). On a CPU with fbgemm (x86), the weight
                  goes to fbgemm's packed int8 layout and activations are quantized per call (dynamic W8A8, as
                  llama.cpp's q8_0 dot product quantizes its activations); elsewhere the weight-only kernel.
- `Int4Linear`    int4 in groups along the input (asymmetric: scale and zero point per group of 32-256). On a CPU
                  through model/int4_kernel.py (each row quantized to int8 in blocks of 32, integer dot products, as
                  llama.cpp's q4_0 x q8_0; aten's `_weight_int4pack_mm_for_cpu`, bf16 activations, where that
                  kernel cannot be built), on CUDA through `_weight_int4pack_mm`.
- `traceable()`   each quantized module's twin for a compiled decode step (engine/compiled_decode.py): `Int8Traced`
                  (fbgemm's arithmetic as the quantization ops inductor fuses into its int8 GEMM; CPUs with int8 dot
                  products), `Int8Extern` (the ops around the matmul, fbgemm's kernel called from the step; other
                  CPUs), `Int4Traced`, `Int8Table` (the tied table's lookup).

Measured with `bench/kernels.py` (the table is in docs/performance.md): on an AVX-512 CPU oneDNN's packed copy
beats MKL at every row count (a column-major copy for MKL's GEMV, which an Intel Xeon ran faster at one row, is
made only where `tune` measures it faster: one copy by default), the int8 kernel is fbgemm's at every row count,
and int4's own kernel (model/int4_kernel.py) matches aten's at one row read from memory and beats it from 4 rows
(1.5x at 16, 1.7x at 64), though fbgemm's int8 is faster than either from 16 rows.
`tune(model)` times the small-row choice per weight shape at warm-up (the engine's), never on a request.

The tied output head / embedding: quantized formats keep it in int8 per row (one int8 table: the embedding reads
its rows, the head its fbgemm-packed copy where fbgemm is used; both reported by `weight_bytes`), because at GPT-2's
size the head is a third of the weights read per token; int4 mode keeps the head at int8 too (llama.cpp's q4 types
keep `output` at 6 bits).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import cpu_support, int4_kernel

FORMATS = ("none", "int8", "int4")
INT4_GROUPS = (32, 64, 128, 256)
DEFAULT_INT4_GROUP = 32  # llama.cpp's q4_0 block; 128 measured faster at one row (docs/performance.md)


class FormatError(ValueError):
    """A weight format that cannot be applied (bad name, a shape the kernel refuses); one line."""


def _onednn_linear_op():
    """oneDNN's fused linear (what inductor uses on CPU), or None where this torch build lacks it."""
    if os.environ.get("GPT_ONEDNN_LINEAR", "1") == "0" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


# On CPU, fp32 nn.Linear goes to MKL, whose GEMV on AMD machines uses one core and whose small-batch GEMM is slow;
# oneDNN's inner product reads the same (out, in) weights, no copy, over both threads (docs/performance.md). It has
# no autograd formula, so it serves only passes that need no gradient.
ONEDNN_LINEAR = _onednn_linear_op()
log = logging.getLogger(__name__)


def _post_op(act: nn.Module | None) -> tuple[str, str] | None:
    """The oneDNN post-op computing `act` inside the matmul, or None where there is none."""
    if act is None:
        return "none", ""
    if type(act) is nn.GELU:
        return ("gelu", "tanh") if act.approximate == "tanh" else ("gelu", "none")
    if type(act) is nn.ReLU:
        return "relu", ""
    return None


def _act(y: torch.Tensor, act: nn.Module | None) -> torch.Tensor:
    return act(y) if act is not None else y


def linear(x: torch.Tensor, layer: nn.Module, act: nn.Module | None = None) -> torch.Tensor:
    """act(layer(x)). A plain nn.Linear runs through oneDNN when no gradient is needed on a CPU fp32 tensor (same
    math, faster, the activation fused); a module of this file runs its own kernel."""
    if type(layer) is not nn.Linear:
        if isinstance(layer, _Served):
            return layer(x, act)
        return _act(layer(x), act)  # another swapped-in module (adapter, ...)
    w, b = layer.weight, layer.bias
    if (ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.compiler.is_dynamo_compiling()  # inductor lowers F.linear itself (engine/compiled_decode.py)
            and w.dtype == torch.float32 and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        post = _post_op(act)
        if post is not None:
            return ONEDNN_LINEAR(x, w, b, post[0], [], post[1])
        return act(ONEDNN_LINEAR(x, w, b, "none", [], ""))
    return _act(F.linear(x, w, b), act)


class _Served(nn.Module):
    """An inference-only Linear: forward(x, act) → act(x Wᵀ + b) in the input's dtype."""

    in_features: int
    out_features: int

    bias: torch.Tensor | None

    def weight_bytes(self) -> int:
        return self.matrix_bytes() + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def matrix_bytes(self) -> int:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class PackedLinear(_Served):
    """fp32 / bf16 on a CPU: oneDNN's blocked copy of the weight, the only one kept. At one row, MKL's GEMV on a
    column-major copy where `tune` measured it faster for this shape (that copy exists only then)."""

    def __init__(self, layer: nn.Linear, keep_plain: bool = False) -> None:
        super().__init__()
        w = layer.weight.detach()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.dtype = w.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
        # keep_plain: the plain weight too, as loaded, until `drop_plain`: tune's column-major copies and a compiled
        # step (engine/compiled_decode.py) are made from it; the packed tensor is opaque to the compiler
        self.register_buffer("weight", w if keep_plain else None, persistent=False)
        self.bias = None if layer.bias is None else layer.bias.detach().clone()
        self.column_major: torch.Tensor | None = None  # MKL's one-row copy, only where tune() kept it
        self.one_row_as_two = False  # tune(): oneDNN rounds this shape's one-row product unlike a batch's

    def matrix_bytes(self) -> int:  # the opaque packed tensor holds the plain weight's elements (plus padding)
        n = self.in_features * self.out_features * (1 + (self.column_major is not None))
        return n * torch.empty((), dtype=self.dtype).element_size()

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        x = x.to(self.dtype)
        if x.numel() == x.shape[-1]:  # one row
            if self.column_major is not None:
                return _act(F.linear(x, self.column_major, self.bias), act)
            if self.one_row_as_two:  # the batch's path, so a row gets the result it gets beside others
                return self.forward(x.reshape(1, -1).expand(2, -1).contiguous(), act)[:1].reshape(x.shape[:-1] + (-1,))
        post = _post_op(act)
        if post is not None:
            return ONEDNN_LINEAR(x, self.packed, self.bias, post[0], [], post[1])
        return act(ONEDNN_LINEAR(x, self.packed, self.bias, "none", [], ""))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q int8 (out, in), scale fp32 (out,)), w ≈ q · scale."""
    w = w.detach().float()
    # max |w| without a copy of |w|, one temporary rounded and clamped in place: the same bytes, GPT-2's 49 weights
    # 0.48 → 0.24 s in-process (a served start, the front's imports sharing the CPU, moved within its noise)
    lo, hi = torch.aminmax(w, dim=1)
    scale = (torch.maximum(hi, -lo) / 127).clamp_(min=1e-12)
    q = torch.div(w, scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of `group` inputs: (q uint8 (out, in) in 0..15, scale, zero fp32 (out, in/group));
    w ≈ (q - 8) · scale + zero, the convention of PyTorch's int4 kernels (zero is the group's midpoint)."""
    check_int4_shape(tuple(w.shape), group)
    out, inp = w.shape
    wg = w.detach().float().reshape(out, inp // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(out, inp)
    return q, scale, lo + 8 * scale


def check_int4_shape(shape: tuple[int, int], group: int, where: str = "") -> None:
    if group not in INT4_GROUPS:
        raise FormatError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUPS))}, got {group}")
    out, inp = shape
    if inp % group or out % 16:
        raise FormatError(f"int4 needs input dims divisible by the group size ({group}) and output dims by 16; "
                          f"{where or 'a weight'} is {out}x{inp}")


def int4_inner_k_tiles(in_features: int) -> int:
    """The inner k-tiles of CUDA's int4 layout (torch's tinygemm kernels: 2, 4 or 8; 8 loads 16 bytes at a time):
    its packer needs the input dim divisible by 16 x this. 8 alone failed GPT-2 XL's 1600 (= 12.5 x 128) at load;
    the group sizes (multiples of 32) make 2 always possible, so every shape check_int4_shape admits packs."""
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    raise FormatError(f"int4 on CUDA needs input dims divisible by 32, got {in_features}")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(out, in) values 0..15 → (out, in/2) bytes, the even column in the low nibble (how checkpoints store int4)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    q = torch.empty(p.shape[0], p.shape[1] * 2, dtype=torch.uint8, device=p.device)
    q[:, 0::2], q[:, 1::2] = p & 15, p >> 4
    return q


def int8_kernel_off_cpu() -> bool:
    """Whether int8 off a CPU runs torch's `_weight_int8pack_mm` (CUDA since torch 2.9: one warp per output
    element on CUDA cores, fp32 accumulation) instead of the int8 values dequantized once into the served dtype
    (cuBLAS; no memory saved). The dequantized copy until a GPU run measures the kernel (bench/gpu_offline.py's
    int8 parts): the per-call dequantization it replaces made a bf16 copy of every weight on every call.
    GPT_INT8_KERNEL=1 picks the kernel."""
    return os.environ.get("GPT_INT8_KERNEL", "0") == "1"


@functools.cache
def _note_dequantized(device: str) -> None:
    log.warning("int8 on %s: the weights are dequantized once into the served dtype (int8's values, no memory "
                "saved) until torch's int8 kernel is measured there; GPT_INT8_KERNEL=1 uses the kernel", device)


class Int8Linear(_Served):
    """int8 weights, one scale per output row. On an x86 CPU, fbgemm's packed int8 weight (the only copy) with the
    activations quantized per call; on another CPU the int8 (out, in) tensor through PyTorch's weight-only kernel;
    elsewhere (CUDA) the int8 values dequantized once into the served dtype, or that kernel (int8_kernel_off_cpu).

    fbgemm quantizes its input with one scale for the whole tensor, from its min and max: a row's result would
    depend on the other rows of the batch (a seeded request's tokens would change with its neighbours). So each row
    is scaled to a max |x| of ROW_SPAN and gets two more inputs, +ROW_SPAN and -ROW_SPAN, against zero weight
    columns: every row then spans exactly [-63.5, 63.5], fbgemm's scale is 1 and its zero point 64 whatever the
    batch, and the int32 products are exact, so a row's output is bit-identical alone or batched (tested). Its
    activations are quantized relative to its own range (finer than one scale for all rows). At an activation scale
    of 1 fbgemm's output is fl(float(int32 sum) x packed scale), the packed scales being the row scales / ROW_SPAN,
    which the compiled step's twin (Int8Traced) computes bit for bit; both then multiply by the row's max."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.dtype = dtype
        self.bias = None if bias is None else bias.detach().to(torch.float32, copy=True)
        self.fbgemm = None
        self.q = self.scale = self.weight = None
        if q.device.type == "cpu" and cpu_support.support().fbgemm:
            q2 = torch.cat([q, torch.zeros(q.shape[0], 2, dtype=torch.int8)], 1)  # the ±ROW_SPAN inputs' weights
            with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm's kernels still take them (2.13)
                warnings.simplefilter("ignore", UserWarning)
                qw = torch._make_per_channel_quantized_tensor(q2, packed_scale(scale).double(),
                                                              torch.zeros_like(scale, dtype=torch.long), 0)
            self.fbgemm = torch.ops.quantized.linear_prepack(qw, None)
            self.row_scale = scale.float()  # as quantized (int8_weight): fbgemm keeps only the quotients
            self._pm = torch.tensor([1.0, -1.0])
        elif q.device.type == "cpu" or int8_kernel_off_cpu():
            self.q, self.scale = q, scale.float()
        else:  # the int8 values in the served dtype, made once (see int8_kernel_off_cpu)
            self.weight = (q.float() * scale.float()[:, None]).to(dtype)
            if self.bias is not None:
                self.bias = self.bias.to(dtype)
            _note_dequantized(str(q.device.type))

    def matrix_bytes(self) -> int:  # int8 weights and fp32 scales (opaque in fbgemm's copy, the same count)
        if self.weight is not None:
            return self.weight.numel() * self.weight.element_size()
        return self.out_features * (self.in_features + 4)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 (out, in), scale fp32 (out,)) as quantized: read back from fbgemm's packed copy where that is the
        only one (a new tensor), else the kept ones."""
        if self.fbgemm is not None:
            qw, _ = torch.ops.quantized.linear_unpack(self.fbgemm)
            return qw.int_repr()[:, : self.in_features].contiguous(), self.row_scale
        if self.q is None:
            raise FormatError("this int8 layer keeps only its dequantized weight")
        return self.q, self.scale

    def traceable(self, extern: bool | None = None) -> Int8Traced | Int8Extern:
        """This layer as the ops a compiler reads (engine/compiled_decode.py), rounding as fbgemm's path does: its
        matmul as inductor's int8 GEMM (Int8Traced) where the CPU has int8 dot products, else a call of fbgemm's
        kernel (Int8Extern); `extern` chooses."""
        if self.fbgemm is None:
            raise FormatError("only fbgemm's int8 path (an x86 CPU) has a traceable twin")
        if _extern_twin(extern):
            return Int8Extern(self)
        return Int8Traced(*self.int8_weight(), self.bias)

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1])
        if self.fbgemm is not None:
            y = fbgemm_rows(x.float(), self._pm, self.bias,
                            lambda xn: torch.ops.quantized.linear_dynamic(xn, self.fbgemm, True))
        elif self.weight is not None:
            y = F.linear(x, self.weight, self.bias)
        elif x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale.to(torch.bfloat16))
            y = y.float() if self.bias is None else y.float() + self.bias
        else:  # torch's kernel reads the int8 bytes (GPT_INT8_KERNEL=1), fp32 accumulation, in x's dtype
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return _act(y.reshape(*shape[:-1], self.out_features).to(dtype), act)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's max |x| (rows, 1), what Int8Linear divides a row by before fbgemm quantizes it; never 0."""
    return x.abs().amax(-1, keepdim=True).clamp_(min=1e-30)


def fbgemm_rows(x: torch.Tensor, pm: torch.Tensor, bias: torch.Tensor | None, matmul) -> torch.Tensor:
    """fbgemm's int8 rows as Int8Linear computes them, eager or traced (Int8Extern): each row of x (fp32, 2-D)
    scaled to span ROW_SPAN and padded with the two ±ROW_SPAN inputs (`pm`: [1, -1]), `matmul` (fbgemm's kernel on
    the packed weight), then times the row's max, plus the bias."""
    m = _row_max(x)
    # scaled in place by a Python scalar: new tensors for the scalings cost GPT-2's 48 one-row int8 matmuls 8%
    xn = torch.cat([x / m, pm.expand(x.shape[0], 2)], -1).mul_(ROW_SPAN)
    y = matmul(xn).mul_(m)
    return y if bias is None else y.add_(bias)


def _extern_twin(extern: bool | None) -> bool:
    """Whether an int8 layer's compiled twin calls fbgemm (Int8Extern) rather than inductor's int8 GEMM
    (Int8Traced): as asked, else where the CPU has no int8 dot products (cpu_support's `int8_dot`)."""
    return extern if extern is not None else not cpu_support.support().int8_dot


# fbgemm's quantization of Int8Linear's rows, scaled to span exactly [-ROW_SPAN, ROW_SPAN]: with reduce_range its
# scale is 127 / 127 = 1 and its zero point 64, into the whole uint8 range (x = 63.5 → 128), each value rounded as
# fl(x + 64) to even. At a scale of 1 no division or reciprocal can round apart; Int8Traced rounds the same sum and
# equals fbgemm's output bit for bit (tests/test_linear.py, tests/test_compiled_decode.py)
ROW_SPAN = 63.5
ACT_SCALE, ACT_ZERO = 1.0, 64


def packed_scale(scale: torch.Tensor) -> torch.Tensor:
    """The per-row scales fbgemm's copy holds (and Int8Traced multiplies by): the row scales / ROW_SPAN, which undo
    the activations' scale-up inside the kernel's own multiply."""
    return scale.float() / ROW_SPAN


class Int8Traced(_Served):
    """Int8Linear's arithmetic as the ops inductor's freezing passes fuse into its u8 x s8 GEMM (PT2E's pattern:
    activations dequantized per tensor, the weight per channel, then linear): each row scaled to ROW_SPAN, rounded
    as fbgemm rounds it, the exact int32 sums (unit weight scales in the GEMM: inductor's zero-point correction is
    then exact in float while |sum| < 2^24, bounded by 128 x a row's sum of |q|: 1.3e7 at most in the random GPT-2's
    layers; past it the two differ by an ulp, not a step) times the row scales / ROW_SPAN, as fbgemm scales them
    at an activation scale of 1, then times the row's max: the same bits as Int8Linear. What
    engine/compiled_decode.py traces in place of fbgemm's packed weight, which is opaque to the compiler; eager
    serving never runs it. On an AVX-512 VNNI host inductor's int8 micro-kernel ran GPT-2's 48 int8 matmuls, these
    ops included, in 1.3-1.6 ms, fbgemm's kernels alone in 2.0 and the eager path in 2.9-3.1 (docs/performance.md,
    "int8 and int4 inside the compiled step")."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers the quantized_decomposed ops (~0.1 s)
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.float())
        self.register_buffer("zero", torch.zeros(q.shape[0], dtype=torch.long), persistent=False)
        self.register_buffer("one", torch.ones(q.shape[0]), persistent=False)
        self.register_buffer("scale_over_span", packed_scale(self.scale), persistent=False)
        self.register_buffer("bias", bias)

    def matrix_bytes(self) -> int:
        return self.out_features * (self.in_features + 4)

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1]).float()
        qd = torch.ops.quantized_decomposed
        m = _row_max(x)
        xq = (x / m * ROW_SPAN + ACT_ZERO).round_().clamp_(0, 255).to(torch.uint8)
        x = qd.dequantize_per_tensor.default(xq, ACT_SCALE, ACT_ZERO, 0, 255, torch.uint8)
        w = qd.dequantize_per_channel.default(self.q, self.one, self.zero, 0, -128, 127, torch.int8)
        y = F.linear(x, w) * self.scale_over_span * m
        if self.bias is not None:
            y = y + self.bias
        return _act(y.reshape(*shape[:-1], self.out_features).to(dtype), act)


# the fbgemm-packed int8 layers a compiled step calls (`int8_matmul`), by their weights' digest (`Int8Extern`)
_EXTERN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def weights_digest(*tensors: torch.Tensor | None) -> int:
    """A 63-bit digest of the tensors' shapes and bytes: how a compiled step names the int8 layer it calls (the
    same weights in another process, or loaded twice, get the same name; other weights another)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        if t is not None:
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return int.from_bytes(h.digest(), "little") >> 1


def _int8_matmul(x: torch.Tensor, weight: int, out_features: int) -> torch.Tensor:
    """fbgemm's int8 matmul of x (rows scaled and padded as Int8Linear.forward pads them) with the packed weight of
    the Int8Linear whose digest is `weight` (`Int8Extern`): the eager kernel, called from a compiled step's C++ code
    (AOTInductor's proxy executor), its bits the eager step's by construction."""
    layer = _EXTERN.get(weight)
    if layer is None:
        raise RuntimeError(f"int8_matmul: no int8 layer with weights {weight:x} in this process")
    return torch.ops.quantized.linear_dynamic(x, layer.fbgemm, True)


# an operator of the dispatcher's own, not `torch.library.custom_op`, whose Python wrapper cost ~10 us more a call
# from a compiled step (one 768 -> 768 row: 68.5 against 58.4 us, fbgemm alone 59; from Python 59 against 32), once
# for each of GPT-2's 49 int8 layers a token (docs/performance.md, "int8 compiled without int8 dot products")
_LIB = torch.library.Library("gpt_serve", "FRAGMENT")
_LIB.define("int8_matmul(Tensor x, int weight, int out_features) -> Tensor")
_LIB.impl("int8_matmul", _int8_matmul, "CPU")


@torch.library.register_fake("gpt_serve::int8_matmul", lib=_LIB)
def _(x: torch.Tensor, weight: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class Int8Extern(_Served):
    """Int8Linear in a compiled step on a CPU without int8 dot products (cpu_support's `int8_dot`): the ops around
    the matmul traced, so that inductor fuses them (eager runs them as ~6 small ATen ops a layer, 4-8 us each on an
    AVX2 EPYC: GPT-2's 49 int8 layers spent ~80 us a call around fbgemm's 41), the matmul fbgemm's own kernel on the
    layer's packed weight (`int8_matmul`). Where inductor's int8 GEMM has no VNNI it made GPT-2's compiled step 2.8x
    slower than eager (docs/performance.md, "The AVX2 host class, measured"). The same ops as Int8Linear.forward
    (`fbgemm_rows`, shared): the same bits. Holds the layer's digest (a compile key hashes it), not its weights."""

    def __init__(self, layer: Int8Linear) -> None:
        super().__init__()
        self.out_features, self.in_features = layer.out_features, layer.in_features
        self.weight_id = weights_digest(*layer.int8_weight(), layer.bias)
        _EXTERN[self.weight_id] = layer
        self.register_buffer("digest", torch.tensor([self.weight_id]))
        self.register_buffer("bias", layer.bias)
        self.register_buffer("pm", layer._pm.clone(), persistent=False)

    def matrix_bytes(self) -> int:
        return 0  # the layer's

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        y = fbgemm_rows(x.reshape(-1, shape[-1]).float(), self.pm, self.bias,
                        lambda xn: torch.ops.gpt_serve.int8_matmul(xn, self.weight_id, self.out_features))
        return _act(y.reshape(*shape[:-1], self.out_features).to(dtype), act)


class Int4Linear(_Served):
    """int4 weights in groups along the input: on a CPU our int4 x int8 kernel's layout (`model.int4_kernel`; a row's
    outputs the same bits alone or among others, eager or compiled), else packed for PyTorch's int4 kernels (bf16
    activations)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, group: int) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group, self.dtype = group, dtype
        self.bias = None if bias is None else bias.detach().to(torch.float32, copy=True)
        self.kernel = (q.device.type == "cpu" and int4_kernel.supports(self.out_features, self.in_features)
                       and int4_kernel.available())
        if self.kernel:
            self.packed = int4_kernel.pack(q)
            # (in/group, out) each, bf16 (as aten's layout rounds them): the kernel's
            self.scales_zeros = torch.stack([scale.t(), zero.t()]).to(torch.bfloat16).contiguous()
            return
        # (in/group, out, 2): scale and zero of each group, aten's layout
        self.scales_zeros = torch.stack([scale.t(), zero.t()], -1).contiguous().to(torch.bfloat16)
        if q.device.type == "cpu":
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:
            packed = pack_nibbles(q)  # CUDA's packer wants two nibbles per byte, the even column high
            packed = ((packed & 15) << 4) | (packed >> 4)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(packed, int4_inner_k_tiles(self.in_features))

    def matrix_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.nbytes

    def traceable(self) -> Int4Traced:
        """This layer with its tensors as buffers, the form a compiler reads (engine/compiled_decode.py)."""
        return Int4Traced(self)

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        shape = x.shape
        if self.kernel:
            y = torch.ops.gpt_serve.int4_matmul(x.reshape(-1, shape[-1]).float(), self.packed, self.scales_zeros[0],
                                                self.scales_zeros[1], self.group)
        else:
            x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
            if x.device.type == "cpu":
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros)
            else:
                y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group, self.scales_zeros)
        y = y.float() if self.bias is None else y.float() + self.bias
        return _act(y.reshape(*shape[:-1], self.out_features).to(x.dtype), act)


class Int4Traced(Int4Linear):
    """Int4Linear's tensors as buffers: a compiled step's constants (its cache key hashes them); the same kernel."""

    def __init__(self, layer: Int4Linear) -> None:
        _Served.__init__(self)
        self.out_features, self.in_features, self.group, self.dtype = (layer.out_features, layer.in_features,
                                                                       layer.group, layer.dtype)
        self.kernel = layer.kernel
        self.register_buffer("packed", layer.packed)
        self.register_buffer("scales_zeros", layer.scales_zeros)
        self.register_buffer("bias", layer.bias)


class Int8Embedding(nn.Module):
    """The tied embedding / output head in int8 per row: one table; the embedding dequantizes the rows it looks up,
    the head (`head`) is an Int8Linear over the same rows (fbgemm's packed copy of them on an x86 CPU)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self._set(*quantize_int8(weight), dtype)

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Int8Embedding:
        emb = cls.__new__(cls)
        nn.Module.__init__(emb)
        emb._set(q, scale.float(), dtype)
        return emb

    def _set(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.q, self.scale, self.dtype = q, scale, dtype
        self.num_embeddings, self.embedding_dim = q.shape
        self.head = Int8Linear(self.q, self.scale, None, dtype)
        if self.head.fbgemm is not None or self.head.weight is not None:  # a copy of its own
            self.head_bytes = self.head.weight_bytes()
        else:
            self.head_bytes = 0  # the head reads this table
            self.head.q, self.head.scale = self.q, self.scale

    def pad_rows(self, size: int) -> None:
        """Grow the table to `size` rows of zeros (GPT.pad_vocab); the head is remade over them."""
        if size <= self.num_embeddings:
            return
        q = torch.zeros(size, self.embedding_dim, dtype=torch.int8, device=self.q.device)
        scale = torch.ones(size, dtype=self.scale.dtype, device=self.scale.device)
        q[: self.num_embeddings], scale[: self.num_embeddings] = self.q, self.scale
        self._set(q, scale, self.dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _lookup(self.q, self.scale, idx, self.dtype)

    def weight_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4 + self.head_bytes

    def traceable(self, extern: bool | None = None) -> tuple[Int8Table, Int8Traced | Int8Extern]:
        """The table and the head as the ops a compiler reads (Int8Linear.traceable): the head over the table's
        tensors, or where it calls fbgemm (`extern`), over the head's packed copy."""
        table = Int8Table(self.q, self.scale, self.dtype)
        if self.head.fbgemm is not None and _extern_twin(extern):
            return table, Int8Extern(self.head)
        return table, Int8Traced(table.q, table.scale, None)


class Int8Table(nn.Module):
    """Int8Embedding's lookup with its tensors as buffers (a compiled step's constants): no head of its own."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _lookup(self.q, self.scale, idx, self.dtype)


def _lookup(q: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q[idx].to(dtype) * scale[idx, None].to(dtype)


def block_linears(model: nn.Module):
    for name, m in model.named_modules():
        for child_name, child in m.named_children():
            if type(child) is nn.Linear and child_name != "lm_head":
                yield (f"{name}.{child_name}" if name else child_name), m, child_name, child


def convert(model: nn.Module, fmt: str = "none", group: int = DEFAULT_INT4_GROUP, keep_plain: bool = False) -> dict:
    """Swap the block Linears (and the tied head: for none a packed copy beside the embedding, for int8/int4 one
    quantized table shared with it) for served modules, in place. fmt: none (PackedLinear on a CPU in fp32, and in
    bf16 where this CPU packs it; nothing elsewhere), int8, int4. Returns what it did (`swapped` counts the block
    Linears). keep_plain: packed layers keep their plain weight too, as loaded, until `drop_plain`."""
    if fmt not in FORMATS:
        raise FormatError(f"unknown weight format {fmt!r}: use one of {', '.join(FORMATS)}")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    stored = quantized_format(model)
    if stored is not None:  # a checkpoint saved quantized (model/quantize.py) comes back in its format
        if fmt not in ("none", stored):
            raise FormatError(f"the checkpoint's weights are stored as {stored}: serve it with --quantize {stored} "
                              f"(or none), or quantize its fp32 source to {fmt}")
        return {"format": stored, "swapped": 0, "group": None}
    if fmt == "int4":
        if device.type == "cpu" and not cpu_support.support().int4_pack:
            raise FormatError(f"int4 needs PyTorch's CPU int4 kernels, which do not run on this CPU (ATen capability "
                              f"{cpu_support.support().capability}): use --quantize int8")
        for name, _, _, lin in block_linears(model):
            check_int4_shape(tuple(lin.weight.shape), group, name)
    # fp32 / bf16 go to oneDNN's packed layout where this CPU packs that dtype; elsewhere (bf16 without AVX-512 /
    # AVX-NE-CONVERT, fp16 everywhere) the plain nn.Linear stays and runs through F.linear (docs/api.md, formats)
    pack = fmt == "none" and device.type == "cpu" and ONEDNN_LINEAR is not None and cpu_support.support().packs(dtype)

    def served(name: str, make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        def run() -> nn.Module:
            try:
                return make()
            except RuntimeError as e:  # a kernel that refuses this CPU or device: name the step, not a later one
                raise FormatError(f"cannot prepare {name} ({fmt}, {str(dtype).removeprefix('torch.')}) for this "
                                  f"{device.type}'s kernels: {e}") from e
        return run

    jobs: dict[str, Callable[[], nn.Module]] = {}
    if fmt != "none":  # the largest first: the tied table and its head
        wte = model.transformer.wte
        jobs["transformer.wte"] = served("transformer.wte", lambda: Int8Embedding(wte.weight, dtype))
    places = {}
    for name, parent, child_name, lin in list(block_linears(model)):
        if fmt == "none" and not pack:
            continue
        places[name] = (parent, child_name)
        if fmt == "none":
            jobs[name] = served(name, functools.partial(PackedLinear, lin, keep_plain))
        elif fmt == "int8":
            jobs[name] = served(name, lambda lin=lin: Int8Linear(*quantize_int8(lin.weight), lin.bias, dtype))
        else:
            jobs[name] = served(name, lambda lin=lin: Int4Linear(*quantize_int4(lin.weight, group), lin.bias, dtype,
                                                                 group))
    if fmt == "none" and places and hasattr(model, "lm_head") and type(model.lm_head) is nn.Linear:
        # the tied head gets its own packed copy (the embedding keeps reading the plain rows): through the plain
        # weight oneDNN reorders 50k x 768 on every call (docs/performance.md has what that cost)
        jobs["lm_head"] = served("lm_head", functools.partial(PackedLinear, model.lm_head, keep_plain))
    made = _in_parallel(jobs) if device.type == "cpu" else {name: job() for name, job in jobs.items()}
    for name, (parent, child_name) in places.items():
        setattr(parent, child_name, made[name])  # the plain weight is freed with the old module
    swapped = len(places)
    if "lm_head" in made:
        model.lm_head = made["lm_head"]
    if fmt != "none":
        emb = made["transformer.wte"]
        model.transformer.wte = emb
        model.lm_head = emb.head
    # what stays plain (LayerNorms, position and token embeddings) gets storage of its own: loaded tensors are views
    # of the file's memory map (safetensors), which lives while any of them does; without this a GPT-2 XL server kept
    # its 6.2 GB of fp32 weights as loaded beside the served copy. Not the plain weights kept until `drop_plain`: they
    # go soon, and copying them was most of GPT-2's 1.35 s here (docs/performance.md, "Start-up")
    for p in model.parameters():  # each once (a tied head shares its Parameter with the embedding)
        p.data = p.data.clone()
    for m in model.modules():
        for name, b in m.named_buffers(recurse=False):
            if not (isinstance(m, PackedLinear) and name == "weight"):
                setattr(m, name, b.clone())
    return {"format": fmt, "swapped": swapped, "group": group if fmt == "int4" else None}


def _in_parallel(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run a conversion's layer jobs on the process's torch threads, a layer a thread and each of its ops on one:
    fbgemm's prepack runs a call on one thread, so GPT-2's int8 conversion took 1.0-1.1 s in order and 0.70-0.77 s
    so on 2 cores, the largest (the head) first (docs/performance.md, "Start-up"). Results by name, as given."""
    workers = torch.get_num_threads()
    if workers < 2 or len(jobs) < 2:
        return {name: job() for name, job in jobs.items()}
    torch.set_num_threads(1)  # the pool's threads take this count when they first run an op
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="convert") as pool:
            futures = {name: pool.submit(job) for name, job in jobs.items()}
            return {name: f.result() for name, f in futures.items()}
    finally:
        torch.set_num_threads(workers)


def drop_plain(model: nn.Module) -> None:
    """Free the plain weights `convert(keep_plain=True)` kept beside the packed copies, once `tune` has made its
    column-major copies from them and a compile (engine/compiled_decode.py) has read them."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.weight = None


def quantized_format(model: nn.Module) -> str | None:
    """int4 / int8 when the model already holds quantized modules, else None."""
    kinds = {type(m) for m in model.modules()}
    return "int4" if Int4Linear in kinds else "int8" if kinds & {Int8Linear, Int8Embedding} else None


def weight_bytes(model: nn.Module) -> int:
    """Bytes the served weights take: each tensor once, opaque packed layouts at their plain size."""
    heads = {id(m.head) for m in model.modules() if isinstance(m, Int8Embedding)}  # counted with their table
    total = sum(m.weight_bytes() for m in model.modules()
                if isinstance(m, (_Served, Int8Embedding)) and id(m) not in heads)
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return total + sum(t.numel() * t.element_size() for t in tensors.values())


@torch.inference_mode()
def small_linear_forced() -> bool:
    """GPT_SMALL_LINEAR=mkl|onednn: every one-row choice made by the user, none timed."""
    return os.environ.get("GPT_SMALL_LINEAR", "auto") in ("mkl", "onednn")


def tune(model: nn.Module, repeats: int = 7, known: dict | None = None) -> dict:
    """The one-row path of each PackedLinear shape, at the engine's warm-up (never a request's forward): where
    oneDNN rounds a lone 16-bit row unlike a batch's, the row runs as two (`_one_row_rounds_apart`); then, per
    shape of the fp32 ones, one row through oneDNN's packed copy is timed against MKL's GEMV on a column-major copy
    (interleaved, median ratio), and that copy (the weight's memory once more) is kept only where MKL is >= 10%
    faster.
    `GPT_SMALL_LINEAR=mkl|onednn` forces either; `known` gives choices measured before on this CPU (the engine keeps
    them on disk: engine.cpu_tuning.KernelChoices), which are not timed again. Returns {(out, in): "mkl" | "onednn"}."""
    forced = os.environ.get("GPT_SMALL_LINEAR", "auto") if small_linear_forced() else None
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    narrow = [m for m in packed if m.dtype != torch.float32]
    for key in dict.fromkeys((m.out_features, m.in_features, m.dtype) for m in narrow):
        alike = [m for m in narrow if (m.out_features, m.in_features, m.dtype) == key]
        as_two = _one_row_rounds_apart(alike[0])
        for m in alike:
            m.one_row_as_two = as_two
    layers = [m for m in packed if m.dtype == torch.float32]
    # a decode step reads every weight once: from cache only where they all fit in it, else from memory, and the
    # kernels are timed so (GPT-2's 3072 -> 768 timed in cache chose MKL, 1.15x slower in its decode: 33 vs 29 ms)
    cold = sum(m.in_features * m.out_features * 4 for m in layers) > cpu_support.last_level_cache_bytes()
    choice: dict[tuple, str] = {}
    for shape in dict.fromkeys((m.out_features, m.in_features) for m in layers):
        if forced:
            choice[shape] = forced
        elif known and shape in known:
            choice[shape] = known[shape]
        else:
            m = next(m for m in layers if (m.out_features, m.in_features) == shape)
            choice[shape] = "mkl" if _mkl_over_onednn(m, repeats, cold) < 0.9 else "onednn"
    copies = sorted((m for m in layers
                     if choice.get((m.out_features, m.in_features)) == "mkl" and m.column_major is None),
                    key=lambda m: -m.in_features * m.out_features)  # the largest (the head) first
    made = _in_parallel({str(i): functools.partial(_unpack_column_major, m) for i, m in enumerate(copies)})
    for i, m in enumerate(copies):  # GPT-2's 13 here: 0.21-0.27 s one after another, 0.16-0.17 on 2 threads
        m.column_major = made[str(i)]
    return choice


def _one_row_rounds_apart(m: PackedLinear, rows: int = 64) -> bool:
    """Whether oneDNN gives a row alone a result other than the same row in a batch (it takes another path for one
    row on some shapes, e.g. GPT-2's 3072 → 768 here: another summation order over the inputs; rows of 2 and more
    agree). In bf16 that rounding flips a seeded request's tokens with its neighbours (3 of 8 GPT-2 requests, with
    the attention's share), so such a layer runs a lone row as two (`PackedLinear.one_row_as_two`; GPT-2 bf16 batch
    1 was no slower). Checked for the 16-bit layers only: in fp32 the difference is ~1e-6 and running GPT-2's
    lone rows as two cost 5-10% at batch 1. 64 random rows: at 1 row in 6 apart, a miss is a 1e-5 chance."""
    x = torch.randn(rows, m.in_features).to(m.dtype)
    batch = ONEDNN_LINEAR(x, m.packed, m.bias, "none", [], "")
    return any(not torch.equal(ONEDNN_LINEAR(x[r:r + 1], m.packed, m.bias, "none", [], ""), batch[r:r + 1])
               for r in range(rows))


def _mkl_over_onednn(m: PackedLinear, repeats: int, cold: bool = False) -> float:
    """Median time ratio of one row through MKL's GEMV (column-major weight) to oneDNN's packed copy. `cold`: the
    weights come from memory, as in the decode step of a model larger than the cache (each call reads the next of
    enough copies to span twice the last-level cache; at most 256 MiB of copies)."""
    x = torch.randn(1, m.in_features)
    # the same layout a kept copy would have; from the weight itself where it was kept (randn: 0.24 s for GPT-2's head)
    cm = (m.weight.t().contiguous() if m.weight is not None else torch.randn(m.in_features, m.out_features)).t()
    nbytes = cm.numel() * 4
    n = max(1, min(-(-2 * cpu_support.last_level_cache_bytes() // nbytes), (256 << 20) // nbytes)) if cold else 1
    cms = [cm] + [cm.clone() for _ in range(n - 1)]
    packs = [m.packed] + [m.packed.clone() for _ in range(n - 1)]
    # in cache ~20 ms a library at most, even for a large head; from memory each call reads the next copy (GPT-2's
    # five shapes: under a second by count, at a machine's first start; kept on disk: engine.cpu_tuning.KernelChoices)
    calls = max(1, min(5, int(5e6 // cm.numel()))) * n
    next_cm, next_pack = itertools.cycle(cms), itertools.cycle(packs)
    runs = {"mkl": lambda: F.linear(x, next(next_cm), m.bias),
            "onednn": lambda: ONEDNN_LINEAR(x, next(next_pack), m.bias, "none", [], "")}
    for f in runs.values():  # first calls set up threads and primitives
        for _ in range(2):
            f()
    ratios = []
    for _ in range(repeats):
        t = {}
        for name, f in runs.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            t[name] = time.perf_counter() - t0
        ratios.append(t["mkl"] / t["onednn"])
    return sorted(ratios)[len(ratios) // 2]


@torch.inference_mode()
def time_dtypes(in_features: int, out_features: int, rows: tuple[int, ...] = (1, 16), repeats: int = 5) -> dict:
    """ms of one (rows × in) @ (in × out) matmul through oneDNN's packed weight in fp32 and in bf16, per row count
    (interleaved, medians): the measurement behind the server's `--dtype auto` on a CPU."""
    lin = nn.Linear(in_features, out_features)
    mods = {"fp32": PackedLinear(lin), "bf16": PackedLinear(lin.to(torch.bfloat16))}
    calls = max(2, min(50, int(2e7 // (in_features * out_features))))
    out: dict[str, dict[int, float]] = {name: {} for name in mods}
    for r in rows:
        xs = {name: torch.randn(r, in_features).to(m.dtype) for name, m in mods.items()}
        samples: dict[str, list[float]] = {name: [] for name in mods}
        for name, m in mods.items():  # first calls create the primitives
            m(xs[name])
        for _ in range(repeats):
            for name, m in mods.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    m(xs[name])
                samples[name].append((time.perf_counter() - t0) / calls * 1000)
        for name, s in samples.items():
            out[name][r] = sorted(s)[len(s) // 2]
    return out


def _unpack_column_major(m: PackedLinear) -> torch.Tensor:
    """The plain weight, stored column-major: from the plain copy where the layer kept one (`convert(keep_plain=
    True)`: a transpose), else back from oneDNN's packed copy (x = I through the matmul: a whole GEMM, 136 ms for
    one of GPT-2's layers here)."""
    if m.weight is not None:
        return m.weight.t().contiguous().t()
    eye = torch.eye(m.in_features, dtype=m.dtype)
    wt = ONEDNN_LINEAR(eye, m.packed, None, "none", [], "")  # (in, out) = Wᵀ, contiguous
    return wt.t()
