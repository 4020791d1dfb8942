"""model/int4_kernel.py: our int4 x int8 row kernel (model/int4_gemv.cpp), built once a machine, the operator that
eager layers and compiled steps both call."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from model import int4_kernel as K
from model import linear as L
from tests.helpers import REPO

pytestmark = pytest.mark.skipif(not K.available(), reason="no C++ compiler to build the int4 kernel")
PATHS = {"scalar": 1, "avx2": 2, "avx512_vnni": 3}


def weights(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q, scale, zero = L.quantize_int4(w, group)
    return q, scale, zero, K.pack(q), scale.t().contiguous().bfloat16(), zero.t().contiguous().bfloat16()


def dequantized(q, scale, zero, group):
    """The weight the kernel multiplies by: (q - 8) s + z with s and z rounded to bf16, as it keeps them."""
    n, k = q.shape
    s, z = scale.bfloat16().float(), zero.bfloat16().float()
    return ((q.float() - 8).reshape(n, k // group, group) * s[..., None] + z[..., None]).reshape(n, k)


def test_pack_puts_each_nibble_where_the_kernel_reads_it():
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    b = K.pack(q).reshape(2, 2, 4, 16, 4)  # output block, input block, tile, output, byte
    for n, k in [(0, 0), (5, 3), (17, 36), (31, 63), (16, 44)]:
        blk, tile, half, byte = k // 32, (k % 32) // 8, (k % 8) // 4, k % 4
        v = int(b[n // 16, blk, tile, n % 16, byte])
        assert (v >> 4 if half else v & 15) == q[n, k]


@pytest.mark.parametrize("group", [32, 128])
def test_the_kernel_multiplies_by_the_int4_weight_within_int8_rounding_of_the_row(group):
    q, scale, zero, packed, s, z = weights(64, 256, group)
    x = torch.randn(5, 256)
    y = torch.ops.gpt_serve.int4_matmul(x, packed, s, z, group)
    ref = x @ dequantized(q, scale, zero, group).t()
    err = ((y - ref).norm() / ref.norm()).item()
    assert 0 < err < 1e-2  # the rows' int8 blocks (32 inputs, max|x| / 127): ~5e-3


def test_every_path_of_this_cpu_gives_the_same_bits():
    q, scale, zero, packed, s, z = weights(96, 320, 64)  # 6 blocks of 16 outputs: one chunk of 4 and a tail of 2
    x = torch.randn(3, 320) * 3
    best = PATHS[K.isa()]
    outs = {isa: torch.ops.gpt_serve.int4_matmul(x, packed, s, z, 64, isa) for isa in range(1, best + 1)}
    assert len(outs) >= 1
    for isa, y in outs.items():
        assert torch.equal(y, outs[1]), f"path {isa} differs from the scalar path"
    with pytest.raises(RuntimeError, match="no path"):
        torch.ops.gpt_serve.int4_matmul(x, packed, s, z, 64, 4)


def test_a_row_is_the_same_bits_alone_in_a_batch_and_at_any_thread_count():
    _, _, _, packed, s, z = weights(128, 256, 32)
    x = torch.randn(7, 256)
    threads = torch.get_num_threads()
    try:
        batch = torch.ops.gpt_serve.int4_matmul(x, packed, s, z, 32)
        torch.set_num_threads(1)
        one_thread = torch.ops.gpt_serve.int4_matmul(x, packed, s, z, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread)
    for i in range(7):
        assert torch.equal(torch.ops.gpt_serve.int4_matmul(x[i:i + 1], packed, s, z, 32), batch[i:i + 1])


def test_zero_and_constant_rows_are_exact():
    q, scale, zero, packed, s, z = weights(16, 64, 32)
    assert torch.equal(torch.ops.gpt_serve.int4_matmul(torch.zeros(1, 64), packed, s, z, 32), torch.zeros(1, 16))
    ones = torch.ops.gpt_serve.int4_matmul(torch.ones(1, 64), packed, s, z, 32)  # 127 / 127 exactly: no rounding
    torch.testing.assert_close(ones, dequantized(q, scale, zero, 32).sum(1, keepdim=True).t(), rtol=1e-5, atol=1e-5)


def test_int4_linear_calls_the_kernel_on_a_cpu():
    lin = torch.nn.Linear(64, 48)
    m = L.Int4Linear(*L.quantize_int4(lin.weight, 32), lin.bias, torch.float32, 32)
    assert m.kernel and m.packed.dtype == torch.uint8 and m.packed.numel() == 48 * 64 // 2
    x = torch.randn(2, 64)
    with torch.inference_mode():
        y = torch.ops.gpt_serve.int4_matmul(x, m.packed, m.scales_zeros[0], m.scales_zeros[1], 32) + lin.bias
        assert torch.equal(m(x), y)


def test_a_bad_shape_is_refused_by_name():
    _, _, _, packed, s, z = weights(16, 64, 32)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.gpt_serve.int4_matmul(torch.randn(1, 96), packed, s, z, 32)


def run_fresh(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from model import int4_kernel as K, linear as L
        lin = torch.nn.Linear(64, 32)
        m = L.Int4Linear(*L.quantize_int4(lin.weight, 32), lin.bias, torch.float32, 32)
        print("kernel", m.kernel, K.isa())
        print("close", (m(torch.ones(1, 64)) - lin(torch.ones(1, 64))).abs().max().item() < 0.5)
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def test_the_library_is_built_once_a_machine_and_loaded_after(tmp_path):
    env = {"GPT_KERNEL_CACHE": str(tmp_path)}
    first = run_fresh(env)
    assert "kernel True" in first.stdout, first.stderr
    built = list(tmp_path.glob("int4-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob(".int4-*"))  # no temporary file left
    stamp = built[0].stat().st_mtime_ns
    second = run_fresh({**env, "CXX": "/nonexistent/c++"})  # a rebuild would fail: it loads the built one
    assert "kernel True" in second.stdout, second.stderr
    assert built[0].stat().st_mtime_ns == stamp


def test_without_a_compiler_int4_layers_keep_aten_s_kernel_and_say_so(tmp_path):
    out = run_fresh({"GPT_KERNEL_CACHE": str(tmp_path / "k"), "HOME": str(tmp_path), "GPT_COMPILE_CACHE": "",
                     "CXX": "/nonexistent/c++"})
    assert "kernel False none" in out.stdout and "close True" in out.stdout, out.stderr
    assert "int4 kernel unavailable (int4 layers use aten's bf16 kernel)" in out.stderr
    assert out.stderr.count("int4 kernel unavailable") == 1
    assert out.stderr.count("No such file") == 1  # a compiler's error is not tried again in the next folder


def test_a_folder_that_cannot_be_written_passes_to_the_next(tmp_path):
    (tmp_path / "file").write_text("")  # GPT_KERNEL_CACHE names a file: no folder can be made there
    out = run_fresh({"GPT_KERNEL_CACHE": str(tmp_path / "file"), "HOME": str(tmp_path)})
    assert "kernel True" in out.stdout, out.stderr
    assert len(list((tmp_path / ".cache" / "gpt-serve" / "kernels").glob("int4-*.so"))) == 1
