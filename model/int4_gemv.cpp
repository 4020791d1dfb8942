// int4 weights x int8 activations, one row at a time: what model/int4_kernel.py builds and calls for Int4Linear on
// a CPU (llama.cpp's q4_0 x q8_0 dot product, in our int4 format: asymmetric groups of 32-256, w = (q - 8) s + z).
//
// Scales and zero points are bf16 (as aten's int4 layout keeps them). Each row of x is quantized to int8 in blocks
// of 32 inputs (symmetric: d = max|x| / 127). Every block's integer dot products with 16 outputs' nibbles are exact
// (int32); the block then adds d (S - 8 sum(xq)) s + d sum(xq) z to each output's fp32 sum, blocks in order. So a row's outputs are the same bits whatever the ISA path (AVX-512 VNNI,
// AVX2, scalar: the same fp32 operations in the same order, fused where the scalar path calls fmaf), the number of
// rows beside it and the threads: a seeded request draws the same tokens alone or in a batch, eager or compiled.
//
// Weight layout (`pack` in model/int4_kernel.py): outputs in blocks of 16; per block, K/32 input blocks of 256 bytes,
// 4 tiles of 64: tile t holds inputs 8t..8t+7 of the block, byte 4n + i is output n's inputs 8t + i (low nibble) and
// 8t + 4 + i (high nibble), the operand layout of vpdpbusd (4 bytes a 32-bit lane, one lane an output).
// x86-64 only (immintrin.h): elsewhere the build fails and Int4Linear keeps aten's kernel (model/int4_kernel.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <torch/library.h>

namespace {

constexpr int QB = 32;  // inputs per activation block

void quantize_row(const float* x, int K, int8_t* xq, float* xd, int32_t* xs) {
    for (int b = 0; b < K / QB; ++b) {
        const float* v = x + b * QB;
        float amax = 0.f;
        for (int i = 0; i < QB; ++i) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t s = 0;
        for (int i = 0; i < QB; ++i) {
            const int q = (int)nearbyintf(v[i] * id);
            xq[b * QB + i] = (int8_t)q;
            s += q;
        }
        xd[b] = d;
        xs[b] = s;
    }
}

// the same quantization through vectors (a libm call an input cost GPT-2's 3,072-wide rows ~12 us serially): the
// block's max |x|, x * (127 / max) rounded to nearest even by the MXCSR's default mode as nearbyintf rounds, exact sums
__attribute__((target("avx512f"))) void quantize_row_avx512(const float* x, int K, int8_t* xq, float* xd,
                                                            int32_t* xs) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    for (int b = 0; b < K / QB; ++b) {
        const __m512 a0 = _mm512_loadu_ps(x + b * QB), a1 = _mm512_loadu_ps(x + b * QB + 16);
        const __m512 m = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a0), abs_mask)),
                                       _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a1), abs_mask)));
        const float amax = _mm512_reduce_max_ps(m);
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, vid)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, vid));
        _mm_storeu_si128((__m128i*)(xq + b * QB), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(xq + b * QB + 16), _mm512_cvtsepi32_epi8(q1));
        xd[b] = d;
        xs[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

__attribute__((target("avx2"))) void quantize_row_avx2(const float* x, int K, int8_t* xq, float* xd, int32_t* xs) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    for (int b = 0; b < K / QB; ++b) {
        __m256 a[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            a[j] = _mm256_loadu_ps(x + b * QB + 8 * j);
            m = _mm256_max_ps(m, _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(a[j]), abs_mask)));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        float amax = 0.f;
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, lanes[i]);
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        const __m256 vid = _mm256_set1_ps(id);
        int32_t q[QB];
        for (int j = 0; j < 4; ++j) _mm256_storeu_si256((__m256i*)(q + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(a[j], vid)));
        int32_t s = 0;
        for (int i = 0; i < QB; ++i) {
            xq[b * QB + i] = (int8_t)q[i];
            s += q[i];
        }
        xd[b] = d;
        xs[b] = s;
    }
}

// one block of 16 outputs, scalar: the reference the vector paths equal bit for bit
inline float bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void block_scalar(const uint8_t* w, const int8_t* xq, const float* xd, const int32_t* xs, const uint16_t* sc,
                  const uint16_t* zr, int N, int K, int group, float* y) {
    float acc[16] = {0};
    for (int b = 0; b < K / QB; ++b) {
        int32_t s[16] = {0};
        for (int t = 0; t < 4; ++t) {
            const uint8_t* tile = w + (b * 4 + t) * 64;
            const int8_t* xv = xq + b * QB + 8 * t;
            for (int n = 0; n < 16; ++n)
                for (int i = 0; i < 4; ++i) {
                    const uint8_t byte = tile[4 * n + i];
                    s[n] += (byte & 15) * xv[i] + (byte >> 4) * xv[4 + i];
                }
        }
        const int g = b * QB / group;
        const float d = xd[b], dz = xd[b] * (float)xs[b];
        for (int n = 0; n < 16; ++n) {
            const float f = (float)(s[n] - 8 * xs[b]);
            acc[n] = fmaf(f * d, bf16(sc[g * N + n]), acc[n]);
            acc[n] = fmaf(bf16(zr[g * N + n]), dz, acc[n]);
        }
    }
    memcpy(y, acc, sizeof acc);
}

__attribute__((target("avx512f"))) inline __m512 bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

__attribute__((target("avx2"))) inline __m256 bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// NB blocks of 16 outputs at once (independent chains hide vpdpbusd's latency)
template <int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void blocks_vnni(
    const uint8_t* w, long bstride, const int8_t* xq, const float* xd, const int32_t* xs, const uint16_t* sc,
    const uint16_t* zr, int N, int K, int group, float* y) {
    const __m512i lo = _mm512_set1_epi8(15);
    __m512 acc[NB];
    for (int j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
    for (int b = 0; b < K / QB; ++b) {
        const int32_t* xb = (const int32_t*)(xq + b * QB);
        __m512i s[NB];
        for (int j = 0; j < NB; ++j) s[j] = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t) {
            const __m512i x0 = _mm512_set1_epi32(xb[2 * t]), x1 = _mm512_set1_epi32(xb[2 * t + 1]);
            for (int j = 0; j < NB; ++j) {
                const __m512i v = _mm512_loadu_si512(w + j * bstride + (b * 4 + t) * 64);
                s[j] = _mm512_dpbusd_epi32(s[j], _mm512_and_si512(v, lo), x0);
                s[j] = _mm512_dpbusd_epi32(s[j], _mm512_and_si512(_mm512_srli_epi16(v, 4), lo), x1);
            }
        }
        const int g = b * QB / group;
        const __m512 d = _mm512_set1_ps(xd[b]), dz = _mm512_set1_ps(xd[b] * (float)xs[b]);
        const __m512i x8 = _mm512_set1_epi32(8 * xs[b]);
        for (int j = 0; j < NB; ++j) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[j], x8));
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(f, d), bf16x16(sc + g * N + 16 * j), acc[j]);
            acc[j] = _mm512_fmadd_ps(bf16x16(zr + g * N + 16 * j), dz, acc[j]);
        }
    }
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(y + 16 * j, acc[j]);
}

// AVX2: a block of 16 outputs as two halves of 8 (bytes 0-31 and 32-63 of each tile), vpmaddubsw + vpmaddwd
template <int NB>
__attribute__((target("avx2,fma"))) void blocks_avx2(const uint8_t* w, long bstride, const int8_t* xq,
                                                     const float* xd, const int32_t* xs, const uint16_t* sc,
                                                     const uint16_t* zr, int N, int K, int group, float* y) {
    const __m256i lo = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[2 * NB];
    for (int j = 0; j < 2 * NB; ++j) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < K / QB; ++b) {
        const int32_t* xb = (const int32_t*)(xq + b * QB);
        __m256i s[2 * NB];
        for (int j = 0; j < 2 * NB; ++j) s[j] = _mm256_setzero_si256();
        for (int t = 0; t < 4; ++t) {
            const __m256i x0 = _mm256_set1_epi32(xb[2 * t]), x1 = _mm256_set1_epi32(xb[2 * t + 1]);
            for (int j = 0; j < 2 * NB; ++j) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(w + (j / 2) * bstride + (b * 4 + t) * 64 +
                                                                      32 * (j % 2)));
                const __m256i p0 = _mm256_maddubs_epi16(_mm256_and_si256(v, lo), x0);
                const __m256i p1 = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo), x1);
                s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
            }
        }
        const int g = b * QB / group;
        const __m256 d = _mm256_set1_ps(xd[b]), dz = _mm256_set1_ps(xd[b] * (float)xs[b]);
        const __m256i x8 = _mm256_set1_epi32(8 * xs[b]);
        for (int j = 0; j < 2 * NB; ++j) {
            const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[j], x8));
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(f, d), bf16x8(sc + g * N + 8 * j), acc[j]);
            acc[j] = _mm256_fmadd_ps(bf16x8(zr + g * N + 8 * j), dz, acc[j]);
        }
    }
    for (int j = 0; j < 2 * NB; ++j) _mm256_storeu_ps(y + 8 * j, acc[j]);
}

int best_isa() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
        return 3;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
    return 1;
}

}  // namespace

// y (M x N) = x (M x K) times the packed weights; sc, zr: (K / group) x N bf16; isa 0: this CPU's best path.
// work: M * (K + K / 32 * 8) bytes of the caller's (the rows' int8 copies, block scales and sums).
static void int4_rows(const float* x, const uint8_t* w, const uint16_t* sc, const uint16_t* zr, float* y, int M, int N, int K,
                 int group, int threads, int isa, void* work) {
    if (isa == 0) isa = best_isa();
    const int nq = K / QB;
    int8_t* xq = (int8_t*)work;
    float* xd = (float*)(xq + (long)M * K);
    int32_t* xs = (int32_t*)(xd + (long)M * nq);
    void (*quantize)(const float*, int, int8_t*, float*, int32_t*) =
        isa == 3 ? quantize_row_avx512 : isa == 2 ? quantize_row_avx2 : quantize_row;
    for (int m = 0; m < M; ++m) quantize(x + (long)m * K, K, xq + (long)m * K, xd + (long)m * nq, xs + (long)m * nq);
    const long bstride = (long)nq * 256;  // bytes of one block of 16 outputs
    const int blocks = N / 16, NB = 4, chunks = (blocks + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int c = 0; c < chunks; ++c) {
        const int b0 = c * NB, nb = blocks - b0 < NB ? blocks - b0 : NB;
        for (int m = 0; m < M; ++m) {
            const int8_t* q = xq + (long)m * K;
            const float* d = xd + (long)m * nq;
            const int32_t* s = xs + (long)m * nq;
            float* out = y + (long)m * N + 16 * b0;
            const uint8_t* wb = w + b0 * bstride;
            if (isa == 3 && nb == 4) {
                blocks_vnni<4>(wb, bstride, q, d, s, sc + 16 * b0, zr + 16 * b0, N, K, group, out);
            } else if (isa == 2 && nb == 4) {
                blocks_avx2<2>(wb, bstride, q, d, s, sc + 16 * b0, zr + 16 * b0, N, K, group, out);
                blocks_avx2<2>(wb + 2 * bstride, bstride, q, d, s, sc + 16 * b0 + 32, zr + 16 * b0 + 32, N, K,
                               group, out + 32);
            } else {
                for (int j = 0; j < nb; ++j) {
                    const uint8_t* wj = wb + j * bstride;
                    const uint16_t *scj = sc + 16 * (b0 + j), *zrj = zr + 16 * (b0 + j);
                    if (isa == 3)
                        blocks_vnni<1>(wj, bstride, q, d, s, scj, zrj, N, K, group, out + 16 * j);
                    else if (isa == 2)
                        blocks_avx2<1>(wj, bstride, q, d, s, scj, zrj, N, K, group, out + 16 * j);
                    else
                        block_scalar(wj, q, d, s, scj, zrj, N, K, group, out + 16 * j);
                }
            }
        }
    }
}

namespace {

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group, int64_t isa) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_matmul: x must be 2-D fp32");
    TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kBFloat16 &&
                zeros.scalar_type() == at::kBFloat16, "int4_matmul: packed uint8, scales and zeros bf16");
    const at::Tensor xc = x.contiguous(), sc = scales.contiguous(), zr = zeros.contiguous();
    const int64_t m = xc.size(0), k = xc.size(1), n = sc.size(1);
    TORCH_CHECK(k % QB == 0 && n % 16 == 0 && packed.numel() == n * k / 2 && sc.size(0) == k / group,
                "int4_matmul: shapes do not match");
    TORCH_CHECK(isa >= 0 && isa <= best_isa(), "int4_matmul: this CPU has no path ", isa);
    at::Tensor y = at::empty({m, n}, xc.options());
    at::Tensor work = at::empty({m * (k + k / QB * 8)}, xc.options().dtype(at::kByte));
    int4_rows(xc.data_ptr<float>(), packed.data_ptr<uint8_t>(), (const uint16_t*)sc.data_ptr(),
              (const uint16_t*)zr.data_ptr(), y.data_ptr<float>(), (int)m, (int)n, (int)k, (int)group,
              at::get_num_threads(), (int)isa, work.data_ptr());
    return y;
}

int64_t int4_isa() { return best_isa(); }

}  // namespace

// the dispatcher's operators: eager layers and compiled steps (AOTInductor calls them from C++) alike
TORCH_LIBRARY_FRAGMENT(gpt_serve, m) {
    m.def("int4_matmul(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group, int isa=0) -> Tensor");
    m.def("int4_isa() -> int");
}

TORCH_LIBRARY_IMPL(gpt_serve, CPU, m) { m.impl("int4_matmul", &int4_matmul); }
TORCH_LIBRARY_IMPL(gpt_serve, CatchAll, m) { m.impl("int4_isa", &int4_isa); }
