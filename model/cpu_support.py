"""What this CPU's kernels can do, asked once per process: every CPU kernel and format choice reads `support()`.

The machines we run on differ (an AVX2-only EPYC, a Zen 4 with AVX-512 + avx512_bf16, a Xeon with AMX), and some
of PyTorch's CPU kernels refuse a CPU outright instead of running slowly: oneDNN packs a bf16 weight only with
AVX512BW/VL/DQ or AVX-NE-CONVERT ("bf16 path needs the cpu support ..."). So the choices ask, and fall back to a
path that works everywhere (docs/api.md, "Formats per CPU").

The answers come from the kernels themselves where they can be tried (a tiny call, once), so they follow what
the libraries will do under `ONEDNN_MAX_CPU_ISA` / `ATEN_CPU_CAPABILITY` too: `make test-cpu-isa` runs the
kernel-choice tests as an AVX2 host would on any bigger one. Tests that need a capability skip on this same
answer (`tests/test_cpu_support.py` forces it to cover the fallbacks on every host).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 dot products in hardware; elsewhere bf16 math is emulated
PACKED_BF16_NEEDS = "avx512bw + avx512vl + avx512dq or avx_ne_convert"  # oneDNN's bf16 reorder, its own words
FLAGS_REPORTED = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
                  "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_bf16", "amx_int8", "amx_tile")


@dataclass(frozen=True)
class CpuSupport:
    capability: str  # ATen's vector ISA for its own kernels (DEFAULT, AVX2, AVX512, ...)
    flags: frozenset[str]  # the feature flags of /proc/cpuinfo that our choices read (FLAGS_REPORTED)
    onednn_linear: bool  # oneDNN's fused linear op is in this torch build
    packed_fp32: bool  # oneDNN reorders an fp32 weight into its blocked layout
    packed_bf16: bool  # ... and a bf16 one (PACKED_BF16_NEEDS)
    fbgemm: bool  # fbgemm's int8 kernels (x86 with AVX2)
    int4_pack: bool  # PyTorch's CPU int4 pack and matmul run here

    @property
    def native_bf16(self) -> bool:
        """bf16 computed in hardware and packed by oneDNN: the only CPUs where bf16 can beat fp32."""
        return self.packed_bf16 and bool(self.flags & set(BF16_FLAGS))

    @property
    def int8_dot(self) -> bool:
        """int8 dot products in hardware under an AVX-512 capability (AVX512-VNNI or AMX-INT8), which inductor's
        int8 GEMM uses: where a compiled int8 decode step's matmuls are inductor's (model.linear.Int8Traced; 2.1x
        fbgemm's eager step on a Zen 4). Elsewhere they are fbgemm's own kernel called from the step
        (Int8Extern): on an AVX2-only EPYC (Zen 3) inductor's timed 2.8x slower than eager (docs/performance.md,
        "The AVX2 host class, measured"). AVX2 with AVX-VNNI and AVX-512 without VNNI are not measured."""
        return self.capability.startswith("AVX512") and bool(self.flags & {"avx512_vnni", "amx_int8"})

    def packs(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN's packed weight serves this dtype here (fp16 never: oneDNN's fp16 needs AVX512-FP16/AMX
        and is not chosen by `model.linear.convert`)."""
        return {torch.float32: self.packed_fp32, torch.bfloat16: self.packed_bf16}.get(dtype, False)

    def describe(self) -> dict:
        """For /info and bench results."""
        return {"capability": self.capability, "flags": sorted(self.flags), "onednn_linear": self.onednn_linear,
                "packed_fp32": self.packed_fp32, "packed_bf16": self.packed_bf16, "native_bf16": self.native_bf16,
                "fbgemm": self.fbgemm, "int8_dot": self.int8_dot, "int4_pack": self.int4_pack}


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


DEFAULT_LLC_BYTES = 32 << 20


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs, cpu0), else 32 MiB: whether a model's weights stay in cache between
    two decode steps (model.linear.tune times its kernels accordingly)."""
    import glob

    sizes = []
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{d}/size") as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            continue
    return max(sizes) if sizes else DEFAULT_LLC_BYTES


def _runs(fn) -> bool:
    try:
        fn()
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def _onednn_packs(dtype: torch.dtype) -> bool:
    w = torch.zeros(16, 16, dtype=dtype)

    def call():
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=dtype), packed, None, "none", [], "")

    return torch.backends.mkldnn.is_available() and _runs(call)


def _int4_runs() -> bool:
    def call():
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 32, dtype=torch.int32), 1)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 32, dtype=torch.bfloat16), packed, 32,
                                                   torch.zeros(1, 16, 2, dtype=torch.bfloat16))

    return _runs(call)


@functools.cache
def support() -> CpuSupport:
    """This CPU's answers, probed on first use (a few tiny kernel calls, ~ms)."""
    with torch.inference_mode():
        return CpuSupport(
            capability=torch.backends.cpu.get_cpu_capability(),
            flags=frozenset(cpu_flags() & set(FLAGS_REPORTED)),
            onednn_linear=torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"),
            packed_fp32=_onednn_packs(torch.float32),
            packed_bf16=_onednn_packs(torch.bfloat16),
            fbgemm="fbgemm" in torch.backends.quantized.supported_engines,
            int4_pack=_int4_runs(),
        )
