// Per-type GGUF block dequantizers, shared by the CUDA gather (NVRTC/nvcc) and the host check (g++).
//
// One signature for every quantized type:
//     template <int T> gg_dq8(const uint8_t* blk, int i, const uint8_t* tab, float* y)
// writes elements [8*i, 8*i + 8) of the block at `blk` (i in [0, QK/8)). A GPU thread calls it once per
// 8 outputs; the host check loops i over the block. Float types (F32/F16/BF16 and the float8 types: "blocks" of
// one element) use gg_dq1<T>(p) instead. The small-float types (float8 elements; E2M1 ones: MXFP4, NVFP4, packed
// F4_E2M1) are decoded in float8.cuh, which builds on this file (gather.cu includes both; tables.py assembles the
// NVRTC unit as dequant.cuh, float8.cuh, gather.cu).
//
// Every value is computed with gguf.quants' float32 operation order (gguf-py/gguf/quants.py
// dequantize_blocks), so host and device results are bit-identical to gguf.quants.dequantize:
//   * integer parts are formed exactly, then converted to float exactly (gg_i2f);
//   * products are grouped as numpy groups them, e.g. Q6_K (d*sc)*q, IQ2_XXS (d*(0.5+s))*0.25*grid*sign;
//   * every product that is followed by an add is exact (fp16 scale x small integer), so FMA contraction
//     cannot change a result; the sources are compiled with contraction off anyway (nvcc/NVRTC --fmad=false,
//     g++ -ffp-contract=off);
//   * subnormals: only MXFP4 (e8m0 exponent 0 or 1), the block scales and the output scale (gather.cu) can meet
//     them, and those products go through gg_mul, which is IEEE on the device even when CuPy compiles with
//     -ftz=true.
// fp16 and bf16 fields are decoded by bit manipulation (the same code on host and device), as float8.cuh's are.
//
// Lookup tables (IQ grids, ksigns, kvalues, IQ1 deltas) are not in this file: gds_gather.gpu.tables builds
// one byte blob from gguf.quants at load time and defines GG_OFF_<NAME> (byte offset of each table in it).
#pragma once
#define GG_DEQUANT_INCLUDED 1

#if defined(__CUDACC_RTC__)
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <cstdint>
#include <cstring>
#endif
#if defined(__HIP__) && !defined(__HIPCC_RTC__)   // hipcc (cupy's hiprtc path adds this include itself)
#include <hip/hip_runtime.h>
#endif

// Compilers: nvcc/NVRTC define __CUDACC__; hipcc/hiprtc (clang -x hip) define __HIP__ (and __HIPCC__), not
// __CUDACC__. GG_DEVICE is set in device compilation passes of either, where CUDA/HIP intrinsics exist.
#if !defined(__CUDACC__) && !defined(__HIP__)   // plain C++ (g++): the CUDA qualifiers mean nothing
#define __host__
#define __device__
#define __global__
#endif
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define GG_DEVICE 1
#endif
#define GG_HD __host__ __device__ inline

#if !defined(GG_OFF_IQ2XXS) || !defined(GG_OFF_IQ2XS) || !defined(GG_OFF_IQ2S) || !defined(GG_OFF_IQ3XXS) || \
    !defined(GG_OFF_IQ3S) || !defined(GG_OFF_IQ1S) || !defined(GG_OFF_KSIGNS) || !defined(GG_OFF_KV_IQ4NL) || \
    !defined(GG_OFF_KV_MXFP4) || !defined(GG_OFF_KV_NVFP4) || !defined(GG_OFF_IQ1S_DELTA) || \
    !defined(GG_OFF_IQ1M_DELTA)
#error "GG_OFF_* table offsets are defined by gds_gather.gpu.dequant.defines() (built from gguf.quants)"
#endif

// ---- row types: X(name, type id, elements per block, bytes per block) --------------------------------------
// GGML types: ids and geometry are gguf.GGML_QUANT_SIZES facts; tests check them against the installed gguf.
// The float8 types (one byte per element) and F4_E2M1 (two elements per byte; "blocks" of 8 elements in 4 bytes,
// so the gather decodes them with gg_dq8) carry ids GGML does not use: gds_gather.formats.quants.FP8_IDS,
// FP4_IDS.
#define GG_TYPE_LIST(X)                                                                                      \
    X(F32, 0, 1, 4) X(F16, 1, 1, 2) X(BF16, 30, 1, 2)                                                        \
    X(F8_E4M3, 1000, 1, 1) X(F8_E5M2, 1001, 1, 1) X(F8_E8M0, 1002, 1, 1) X(F4_E2M1, 1003, 8, 4)             \
    X(Q4_0, 2, 32, 18) X(Q4_1, 3, 32, 20) X(Q5_0, 6, 32, 22) X(Q5_1, 7, 32, 24) X(Q8_0, 8, 32, 34)           \
    X(Q2_K, 10, 256, 84) X(Q3_K, 11, 256, 110) X(Q4_K, 12, 256, 144) X(Q5_K, 13, 256, 176)                   \
    X(Q6_K, 14, 256, 210) X(IQ2_XXS, 16, 256, 66) X(IQ2_XS, 17, 256, 74) X(IQ3_XXS, 18, 256, 98)             \
    X(IQ1_S, 19, 256, 50) X(IQ4_NL, 20, 32, 18) X(IQ3_S, 21, 256, 110) X(IQ2_S, 22, 256, 82)                 \
    X(IQ4_XS, 23, 256, 136) X(IQ1_M, 29, 256, 56) X(TQ1_0, 34, 256, 54) X(TQ2_0, 35, 256, 66)                \
    X(MXFP4, 39, 32, 17) X(NVFP4, 40, 64, 36)

#define GG_ENUM(name, id, qk, ts) GG_##name = id,
enum GGType { GG_TYPE_LIST(GG_ENUM) };
#undef GG_ENUM

template <int T> struct GGTraits;
#define GG_TRAITS(name, id, qk, ts) \
    template <> struct GGTraits<id> { static constexpr int QK = qk, TS = ts; };
GG_TYPE_LIST(GG_TRAITS)
#undef GG_TRAITS

// ---- bits ---------------------------------------------------------------------------------------------------
GG_HD float gg_f32(uint32_t u) {
#if defined(GG_DEVICE)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

GG_HD uint32_t gg_bits(float f) {
#if defined(GG_DEVICE)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

// IEEE a * b in integer arithmetic: round to nearest even, subnormal operands and results kept, NaN as x86 SSE
// and numpy give it (the first NaN operand, quieted; inf * 0 is the default NaN 0xFFC00000). Used where no
// explicit-rounding instruction is available (HIP: cupy compiles with -fcuda-flush-denormals-to-zero, and HIP
// has no inline PTX); checked bit for bit against numpy float32 products by the host build (GG_SOFT_MUL).
GG_HD float gg_soft_mul(float fa, float fb) {
    const uint32_t a = gg_bits(fa), b = gg_bits(fb), sign = (a ^ b) & 0x80000000u;
    const uint32_t aa = a & 0x7fffffffu, ab = b & 0x7fffffffu;
    if (aa > 0x7f800000u) return gg_f32(a | 0x00400000u);
    if (ab > 0x7f800000u) return gg_f32(b | 0x00400000u);
    if (aa == 0x7f800000u || ab == 0x7f800000u) return gg_f32((aa == 0 || ab == 0) ? 0xffc00000u : sign | 0x7f800000u);
    if (aa == 0 || ab == 0) return gg_f32(sign);
    int ea = (int)(aa >> 23), eb = (int)(ab >> 23);
    uint32_t ma = aa & 0x7fffffu, mb = ab & 0x7fffffu;
    if (ea) ma |= 0x800000u; else ea = 1;               // subnormal: exponent 1, no implicit bit
    if (eb) mb |= 0x800000u; else eb = 1;
    while (!(ma & 0x800000u)) { ma <<= 1; --ea; }      // normalize: mantissas in [2^23, 2^24)
    while (!(mb & 0x800000u)) { mb <<= 1; --eb; }
    uint64_t p = (uint64_t)ma * mb;                     // in [2^46, 2^48)
    int e = ea + eb - 127;                              // biased exponent if p is in [2^46, 2^47)
    if (p >> 47) ++e; else p <<= 1;                     // now p in [2^47, 2^48): value = p / 2^47 * 2^(e-127)
    int shift = 24;                                     // keep 24 bits: mantissa with its implicit bit
    if (e < 1) shift += 1 - e;                          // subnormal result: keep fewer bits
    uint64_t m = 0;                                     // shift >= 49: below half the smallest subnormal
    if (shift < 49) {
        m = p >> shift;
        const uint64_t rem = p & ((1ull << shift) - 1), half = 1ull << (shift - 1);
        if (rem > half || (rem == half && (m & 1))) ++m;
    }
    if (e < 1) return gg_f32(sign | (uint32_t)m);      // subnormal (m == 2^23 rounds up into the smallest normal)
    if (m >> 24) { m >>= 1; ++e; }                      // rounding carried into a new binade
    if (e >= 255) return gg_f32(sign | 0x7f800000u);
    return gg_f32(sign | ((uint32_t)e << 23) | ((uint32_t)m & 0x7fffffu));
}

// a * b, rounded to nearest even, subnormal operands and results kept. On NVIDIA devices this is an explicit
// mul.rn.f32: CuPy appends -ftz=true to every NVRTC compile (after our --ftz=false), and the products that can
// meet subnormals (MXFP4 with e8m0 exponent 0 or 1; a block scale, e.g. e8m0 2^-127; the optional output scale,
// e.g. on F32/BF16 subnormals) must not be flushed. Every other operation here only sees normal values (fp16
// scales are multiples of 2^-24).
// On HIP devices (and in the host build with GG_SOFT_MUL) the hardware multiply is used only where operands and
// exact product are all normal (exponent sum >= 2^-125: flushing cannot apply, IEEE rounding is the same), and
// gg_soft_mul otherwise.
GG_HD float gg_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#elif defined(__HIP_DEVICE_COMPILE__) || defined(GG_SOFT_MUL)
    const uint32_t ea = (gg_bits(a) >> 23) & 0xffu, eb = (gg_bits(b) >> 23) & 0xffu;
    if (ea - 1u < 254u && eb - 1u < 254u && ea + eb >= 129u) return a * b;
    return gg_soft_mul(a, b);
#else
    return a * b;
#endif
}

// Small integer (|x| < 2^22) to float, exactly, without the quarter-rate I2F instruction: the float with bits
// 0x4B400000 + x is 1.5 * 2^23 + x, and subtracting 1.5 * 2^23 is exact.
GG_HD float gg_i2f(int x) { return gg_f32(0x4B400000u + (uint32_t)x) - 12582912.0f; }

// Little-endian loads at any byte alignment (rows sit at arbitrary offsets inside O_DIRECT windows).
GG_HD uint32_t gg_ld16(const uint8_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }
GG_HD uint32_t gg_ld32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
// Aligned table loads (every table in the blob starts at a multiple of 16 bytes, rows are 4 or 8 bytes).
GG_HD uint32_t gg_tab32(const uint8_t* p) {
#if defined(GG_DEVICE)
    return __ldg(reinterpret_cast<const unsigned int*>(p));
#else
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
#endif
}
GG_HD uint64_t gg_tab64(const uint8_t* p) {
#if defined(GG_DEVICE)
    return __ldg(reinterpret_cast<const unsigned long long*>(p));
#else
    uint64_t u;
    memcpy(&u, p, 8);
    return u;
#endif
}

// IEEE half -> float, exact (subnormals renormalized by one exact subtraction; NaN payloads kept, as numpy does).
GG_HD float gg_half(uint32_t h) {
    uint32_t o = (h & 0x7fffu) << 13;
    const uint32_t e = o & 0x0f800000u;
    o += 0x38000000u;                                  // rebias 15 -> 127
    if (e == 0x0f800000u) o += 0x38000000u;            // inf / nan
    else if (e == 0) o = gg_bits(gg_f32(o + 0x00800000u) - gg_f32(0x38800000u));   // zero / subnormal
    return gg_f32(o | ((h & 0x8000u) << 16));
}
GG_HD float gg_bf16(uint32_t h) { return gg_f32(h << 16); }

// ---- float types: one element --------------------------------------------------------------------------------
template <int T> GG_HD float gg_dq1(const uint8_t* p);
template <> GG_HD float gg_dq1<GG_F32>(const uint8_t* p) { return gg_f32(gg_ld32(p)); }
template <> GG_HD float gg_dq1<GG_F16>(const uint8_t* p) { return gg_half(gg_ld16(p)); }
template <> GG_HD float gg_dq1<GG_BF16>(const uint8_t* p) { return gg_bf16(gg_ld16(p)); }

// ---- quantized types: elements [8i, 8i+8) of one block --------------------------------------------------------
template <int T> GG_HD void gg_dq8(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                   float* __restrict__ y);

// 32-element 4-bit types: element j < 16 is the low nibble of qs[j], element j + 16 the high nibble; so the
// 8 elements of chunk i are nibble (i >> 1) of qs[8 * (i & 1) + k].

template <> GG_HD void gg_dq8<GG_Q4_0>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const uint8_t* q = b + 2 + 8 * (i & 1);
    const int sh = 4 * (i >> 1);
    for (int k = 0; k < 8; ++k) y[k] = d * gg_i2f((int)((int)((q[k] >> sh) & 15) - 8));
}

template <> GG_HD void gg_dq8<GG_Q4_1>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b)), m = gg_half(gg_ld16(b + 2));
    const uint8_t* q = b + 4 + 8 * (i & 1);
    const int sh = 4 * (i >> 1);
    for (int k = 0; k < 8; ++k) y[k] = d * gg_i2f((int)((q[k] >> sh) & 15)) + m;
}

template <> GG_HD void gg_dq8<GG_Q5_0>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const uint32_t qh = b[2 + i];                      // bits 8i..8i+7 of the u32 qh
    const uint8_t* q = b + 6 + 8 * (i & 1);
    const int sh = 4 * (i >> 1);
    for (int k = 0; k < 8; ++k) y[k] = d * gg_i2f((int)((int)(((q[k] >> sh) & 15) | (((qh >> k) & 1) << 4)) - 16));
}

template <> GG_HD void gg_dq8<GG_Q5_1>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b)), m = gg_half(gg_ld16(b + 2));
    const uint32_t qh = b[4 + i];
    const uint8_t* q = b + 8 + 8 * (i & 1);
    const int sh = 4 * (i >> 1);
    for (int k = 0; k < 8; ++k) y[k] = d * gg_i2f((int)(((q[k] >> sh) & 15) | (((qh >> k) & 1) << 4))) + m;
}

template <> GG_HD void gg_dq8<GG_Q8_0>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    for (int k = 0; k < 8; ++k) y[k] = gg_i2f((int8_t)b[2 + 8 * i + k]) * d;
}

// Q2_K: scales[16] (lo4 scale, hi4 min), qs[64], d, dmin. Element e: qs[32*(e/128) + e%32] >> 2*((e/32)%4).
template <> GG_HD void gg_dq8<GG_Q2_K>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b + 80)), dmin = gg_half(gg_ld16(b + 82));
    const uint32_t sc = b[i >> 1];
    const float dl = d * gg_i2f((int)(sc & 15)), ml = dmin * gg_i2f((int)(sc >> 4));
    const int e0 = 8 * i;
    const uint8_t* q = b + 16 + 32 * (e0 >> 7) + (e0 & 31);
    const int sh = 2 * ((e0 >> 5) & 3);
    for (int k = 0; k < 8; ++k) y[k] = dl * gg_i2f((int)((q[k] >> sh) & 3)) - ml;
}

// Q3_K: hmask[32], qs[64], scales[12] (16 x 6 bits), d.
template <> GG_HD void gg_dq8<GG_Q3_K>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b + 108));
    const int s = i >> 1;                              // scale index (16 elements each)
    const uint32_t lo = (b[96 + (s & 7)] >> (4 * (s >> 3))) & 15;
    const uint32_t hi = (b[104 + (s & 3)] >> (2 * (s >> 2))) & 3;
    const float dl = d * gg_i2f((int)((int)(lo | (hi << 4)) - 32));
    const int e0 = 8 * i;
    const uint8_t* q = b + 32 + 32 * (e0 >> 7) + (e0 & 31);
    const int sh = 2 * ((e0 >> 5) & 3), hb = e0 >> 5;
    const uint8_t* hm = b + (e0 & 31);
    for (int k = 0; k < 8; ++k) {
        const int ql = (q[k] >> sh) & 3;
        const int h = (hm[k] >> hb) & 1;               // the offset 4 applies when the hmask bit is 0
        y[k] = dl * gg_i2f((int)(ql - ((h ^ 1) << 2)));
    }
}

// Q4_K / Q5_K 6-bit scale and min of sub-block j (get_scale_min_k4).
GG_HD void gg_scale_min_k4(const uint8_t* s, int j, uint32_t& sc, uint32_t& mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

// Q4_K: d, dmin, scales[12], qs[128]. Element e: qs[32*(e/64) + e%32] >> 4*((e/32)%2).
template <> GG_HD void gg_dq8<GG_Q4_K>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b)), dmin = gg_half(gg_ld16(b + 2));
    const int e0 = 8 * i, j = e0 >> 5;
    uint32_t sc, mn;
    gg_scale_min_k4(b + 4, j, sc, mn);
    const float dl = d * gg_i2f((int)sc), dm = dmin * gg_i2f((int)mn);
    const uint8_t* q = b + 16 + 32 * (e0 >> 6) + (e0 & 31);
    const int sh = 4 * (j & 1);
    for (int k = 0; k < 8; ++k) y[k] = dl * gg_i2f((int)((q[k] >> sh) & 15)) - dm;
}

// Q5_K: d, dmin, scales[12], qh[32], qs[128]. High bit of element e: qh[e%32] >> (e/32).
template <> GG_HD void gg_dq8<GG_Q5_K>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b)), dmin = gg_half(gg_ld16(b + 2));
    const int e0 = 8 * i, j = e0 >> 5;
    uint32_t sc, mn;
    gg_scale_min_k4(b + 4, j, sc, mn);
    const float dl = d * gg_i2f((int)sc), dm = dmin * gg_i2f((int)mn);
    const uint8_t* q = b + 48 + 32 * (e0 >> 6) + (e0 & 31);
    const uint8_t* qh = b + 16 + (e0 & 31);
    const int sh = 4 * (j & 1);
    for (int k = 0; k < 8; ++k) y[k] = dl * gg_i2f((int)(((q[k] >> sh) & 15) | (((qh[k] >> j) & 1) << 4))) - dm;
}

// Q6_K: ql[128], qh[64], scales int8[16], d. Low 4 bits of e: ql[64*(e/128) + e%64] >> 4*((e/64)%2);
// high 2 bits: qh[32*(e/128) + e%32] >> 2*((e/32)%4).
template <> GG_HD void gg_dq8<GG_Q6_K>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                       float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b + 208));
    const float dl = d * gg_i2f((int8_t)b[192 + (i >> 1)]);
    const int e0 = 8 * i;
    const uint8_t* ql = b + 64 * (e0 >> 7) + (e0 & 63);
    const uint8_t* qh = b + 128 + 32 * (e0 >> 7) + (e0 & 31);
    const int sl = 4 * ((e0 >> 6) & 1), sh = 2 * ((e0 >> 5) & 3);
    for (int k = 0; k < 8; ++k) y[k] = dl * gg_i2f((int)((int)(((ql[k] >> sl) & 15) | (((qh[k] >> sh) & 3) << 4)) - 32));
}

// Sign s (0/1) as gguf's float factor.
GG_HD float gg_sign(uint32_t bits, int k) { return ((bits >> k) & 1) ? -1.0f : 1.0f; }

// IQ2_XXS: d, then 8 x (4 grid bytes, u32: 4 x 7-bit ksigns index, 4-bit scale in bits 28..31).
template <> GG_HD void gg_dq8<GG_IQ2_XXS>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                          float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const uint8_t* g = b + 2 + 8 * (i >> 2);
    const uint32_t aux1 = gg_ld32(g + 4);
    const float db = d * (0.5f + gg_i2f((int)(aux1 >> 28))) * 0.25f;
    const uint32_t signs = tab[GG_OFF_KSIGNS + ((aux1 >> (7 * (i & 3))) & 127)];
    const uint64_t grid = gg_tab64(tab + GG_OFF_IQ2XXS + 8 * g[i & 3]);
    for (int k = 0; k < 8; ++k) y[k] = db * gg_i2f((int)((grid >> (8 * k)) & 0xff)) * gg_sign(signs, k);
}

// IQ2_XS: d, qs u16[32] (9-bit grid index, 7-bit ksigns index), scales[8] (16 x 4 bits).
template <> GG_HD void gg_dq8<GG_IQ2_XS>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                         float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const uint32_t q = gg_ld16(b + 2 + 2 * i);
    const uint32_t s = (b[66 + (i >> 2)] >> (4 * ((i >> 1) & 1))) & 15;
    const float db = d * (0.5f + gg_i2f((int)s)) * 0.25f;
    const uint32_t signs = tab[GG_OFF_KSIGNS + (q >> 9)];
    const uint64_t grid = gg_tab64(tab + GG_OFF_IQ2XS + 8 * (q & 511));
    for (int k = 0; k < 8; ++k) y[k] = db * gg_i2f((int)((grid >> (8 * k)) & 0xff)) * gg_sign(signs, k);
}

// IQ2_S: d, qs[32] (grid index low 8 bits), signs[32], qh[8] (2 high bits each), scales[8].
template <> GG_HD void gg_dq8<GG_IQ2_S>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                        float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const uint32_t idx = b[2 + i] | (((b[66 + (i >> 2)] >> (2 * (i & 3))) & 3) << 8);
    const uint32_t signs = b[34 + i];
    const uint32_t s = (b[74 + (i >> 2)] >> (4 * ((i >> 1) & 1))) & 15;
    const float db = d * (0.5f + gg_i2f((int)s)) * 0.25f;
    const uint64_t grid = gg_tab64(tab + GG_OFF_IQ2S + 8 * idx);
    for (int k = 0; k < 8; ++k) y[k] = db * gg_i2f((int)((grid >> (8 * k)) & 0xff)) * gg_sign(signs, k);
}

// IQ3_XXS: d, qs[64] (grid indices, 4 values each), 8 x u32 (4 x 7-bit ksigns index, 4-bit scale).
template <> GG_HD void gg_dq8<GG_IQ3_XXS>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                          float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const uint32_t aux = gg_ld32(b + 66 + 4 * (i >> 2));
    const float db = d * (0.5f + gg_i2f((int)(aux >> 28))) * 0.5f;
    const uint32_t signs = tab[GG_OFF_KSIGNS + ((aux >> (7 * (i & 3))) & 127)];
    const uint32_t g0 = gg_tab32(tab + GG_OFF_IQ3XXS + 4 * b[2 + 2 * i]);
    const uint32_t g1 = gg_tab32(tab + GG_OFF_IQ3XXS + 4 * b[3 + 2 * i]);
    for (int k = 0; k < 4; ++k) y[k] = db * gg_i2f((int)((g0 >> (8 * k)) & 0xff)) * gg_sign(signs, k);
    for (int k = 0; k < 4; ++k) y[4 + k] = db * gg_i2f((int)((g1 >> (8 * k)) & 0xff)) * gg_sign(signs, 4 + k);
}

// IQ3_S: d, qs[64] (grid index low 8 bits), qh[8] (1 high bit each), signs[32], scales[4] (8 x 4 bits).
template <> GG_HD void gg_dq8<GG_IQ3_S>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                        float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const int ib = i >> 2;
    const uint32_t s = (b[106 + (ib >> 1)] >> (4 * (ib & 1))) & 15;
    const float db = d * gg_i2f((int)(1 + 2 * s));
    const uint32_t qh = b[66 + (i >> 2)];
    const uint32_t i0 = b[2 + 2 * i] | (((qh >> ((2 * i) & 7)) & 1) << 8);
    const uint32_t i1 = b[3 + 2 * i] | (((qh >> ((2 * i + 1) & 7)) & 1) << 8);
    const uint32_t signs = b[74 + i];
    const uint32_t g0 = gg_tab32(tab + GG_OFF_IQ3S + 4 * i0), g1 = gg_tab32(tab + GG_OFF_IQ3S + 4 * i1);
    for (int k = 0; k < 4; ++k) y[k] = db * gg_i2f((int)((g0 >> (8 * k)) & 0xff)) * gg_sign(signs, k);
    for (int k = 0; k < 4; ++k) y[4 + k] = db * gg_i2f((int)((g1 >> (8 * k)) & 0xff)) * gg_sign(signs, 4 + k);
}

// IQ1 grid rows are int8 values -1, 0, 1.
GG_HD float gg_i8(uint64_t v, int k) { return gg_i2f((int8_t)(uint8_t)((v >> (8 * k)) & 0xff)); }

// IQ1_S: d, qs[32], qh u16[8] (4 x 3 high grid bits, 3-bit scale in 12..14, delta sign in bit 15).
template <> GG_HD void gg_dq8<GG_IQ1_S>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                        float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const uint32_t qh = gg_ld16(b + 34 + 2 * (i >> 2));
    const float dl = d * gg_i2f((int)(2 * ((qh >> 12) & 7) + 1));
    const float delta = gg_f32(gg_tab32(tab + GG_OFF_IQ1S_DELTA));
    const float dt = (qh & 0x8000) ? -delta : delta;
    const uint32_t idx = b[2 + i] | (((qh >> (3 * (i & 3))) & 7) << 8);
    const uint64_t grid = gg_tab64(tab + GG_OFF_IQ1S + 8 * idx);
    for (int k = 0; k < 8; ++k) y[k] = dl * (gg_i8(grid, k) + dt);
}

// IQ1_M: qs[32], qh[16] (per 8 elements: 3 high grid bits + delta sign), scales u16[4] (16 x 3 bits);
// the fp16 super-scale is the top nibbles of the 4 scale words.
template <> GG_HD void gg_dq8<GG_IQ1_M>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                        float* __restrict__ y) {
    const uint32_t s0 = gg_ld16(b + 48), s1 = gg_ld16(b + 50), s2 = gg_ld16(b + 52), s3 = gg_ld16(b + 54);
    const float d = gg_half((s0 >> 12) | ((s1 & 0xf000) >> 8) | ((s2 & 0xf000) >> 4) | (s3 & 0xf000));
    const int si = i >> 1;                             // 16-element scale index
    const uint32_t sw = gg_ld16(b + 48 + 2 * (si >> 2));
    const float dl = d * gg_i2f((int)(2 * ((sw >> (3 * (si & 3))) & 7) + 1));
    const uint32_t h = (b[32 + (i >> 1)] >> (4 * (i & 1))) & 15;
    const float delta = gg_f32(gg_tab32(tab + GG_OFF_IQ1M_DELTA));
    const float dt = (h & 8) ? -delta : delta;
    const uint32_t idx = b[i] | ((h & 7) << 8);
    const uint64_t grid = gg_tab64(tab + GG_OFF_IQ1S + 8 * idx);
    for (int k = 0; k < 8; ++k) y[k] = dl * (gg_i8(grid, k) + dt);
}

template <> GG_HD void gg_dq8<GG_IQ4_NL>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                         float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const int8_t* kv = reinterpret_cast<const int8_t*>(tab + GG_OFF_KV_IQ4NL);
    const uint8_t* q = b + 2 + 8 * (i & 1);
    const int sh = 4 * (i >> 1);
    for (int k = 0; k < 8; ++k) y[k] = d * gg_i2f(kv[(q[k] >> sh) & 15]);
}

// IQ4_XS: d, scales_h u16, scales_l[4], qs[128]; sub-block j (32 elements): element 32j + 16h + l is
// nibble h of qs[16j + l].
template <> GG_HD void gg_dq8<GG_IQ4_XS>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                         float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b));
    const int j = i >> 2;
    const uint32_t ls = ((b[4 + (j >> 1)] >> (4 * (j & 1))) & 15) | (((gg_ld16(b + 2) >> (2 * j)) & 3) << 4);
    const float dl = d * gg_i2f((int)((int)ls - 32));
    const int8_t* kv = reinterpret_cast<const int8_t*>(tab + GG_OFF_KV_IQ4NL);
    const uint8_t* q = b + 8 + 16 * j + 8 * (i & 1);
    const int sh = 4 * ((i >> 1) & 1);
    for (int k = 0; k < 8; ++k) y[k] = dl * gg_i2f(kv[(q[k] >> sh) & 15]);
}

// TQ1_0: qs[48], qh[4], d. Base-3 digits: byte * 3^n (mod 256), then (x * 3) >> 8 is the digit.
template <> GG_HD void gg_dq8<GG_TQ1_0>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                        float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b + 52));
    const int e0 = 8 * i;
    const uint8_t* q;
    int n;                                             // digit n of byte q[k] (n of element k: n + nk[k])
    if (e0 < 160) { n = e0 >> 5; q = b + (e0 & 31); }              // qs[0..32): 5 digits, 32 elements each
    else if (e0 < 240) { n = (e0 - 160) >> 4; q = b + 32 + ((e0 - 160) & 15); }   // qs[32..48): 16 each
    else { n = (e0 - 240) >> 2; q = b + 48; }                      // qh[0..4): 4 digits, 4 elements each
    const bool tail = e0 >= 240;
    for (int k = 0; k < 8; ++k) {
        const int nk = tail ? n + (k >> 2) : n;
        uint32_t pow3 = 1;
        for (int t = 0; t < nk; ++t) pow3 *= 3;
        const uint32_t x = ((uint32_t)q[tail ? (k & 3) : k] * pow3) & 0xff;
        y[k] = d * gg_i2f((int)((int)((x * 3) >> 8) - 1));
    }
}

// TQ2_0: qs[64], d. Element e: qs[32*(e/128) + e%32] >> 2*((e/32)%4), minus 1.
template <> GG_HD void gg_dq8<GG_TQ2_0>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                        float* __restrict__ y) {
    const float d = gg_half(gg_ld16(b + 64));
    const int e0 = 8 * i;
    const uint8_t* q = b + 32 * (e0 >> 7) + (e0 & 31);
    const int sh = 2 * ((e0 >> 5) & 3);
    for (int k = 0; k < 8; ++k) y[k] = d * gg_i2f((int)((int)((q[k] >> sh) & 3) - 1));
}
