// The small-float decoders, on host and device alike (the same code): float8 elements (F8_E4M3, F8_E5M2, F8_E8M0:
// gg_dq1), and the E2M1 (OCP MX FP4) types: GGUF's MXFP4 and NVFP4 blocks and the packed F4_E2M1 rows of NVIDIA
// ModelOpt's NVFP4 checkpoints (gg_dq8; their E4M3 block scales and float32 global scale are the scaled gather's,
// gather.cu). Every value is assembled from its bits, or is an exact product, so no rounding mode, contraction or
// flush-to-zero setting can change it.
#pragma once
#define GG_FLOAT8_INCLUDED 1
#ifndef GG_DEQUANT_INCLUDED
#include "dequant.cuh"
#endif

// ---- scale fields of GGUF's E2M1 blocks --------------------------------------------------------------------------
// MXFP4 shared exponent: 2^(e-127) * 0.5 (gguf MXFP4.e8m0_to_fp32_half, ggml_e8m0_to_fp32_half).
GG_HD float gg_e8m0_half(uint32_t e) { return gg_f32(e < 2 ? 0x00200000u << e : (e - 1) << 23); }
// NVFP4 sub-block scale: unsigned e4m3 (bias 7) * 0.5; 0 and 0x7F decode to 0 (gguf NVFP4.ue4m3_to_fp32).
GG_HD float gg_ue4m3_half(uint32_t x) {
    if (x == 0 || x == 0x7f) return 0.0f;
    const uint32_t e = (x >> 3) & 15, m = x & 7;
    if (e == 0) return gg_i2f((int)m) * 0.0009765625f;       // m * 2^-9 * 0.5, exact
    return gg_f32(((e + 119) << 23) | (m << 20));      // (1 + m/8) * 2^(e-7) * 0.5
}

// ---- float8 elements ------------------------------------------------------------------------------------------
// float8 bytes, exactly (quants.fp8_lut): the float32 bits are assembled directly; the one arithmetic step, a
// subnormal's m * 2^-9 (e4m3) or m * 2^-16 (e5m2), is an exact product of normal numbers. NaN is the quiet NaN
// with the byte's sign (0x7fc00000 | sign), as numpy's copysign(nan) gives it; -0 keeps its sign.
GG_HD float gg_e4m3(uint32_t x) {                      // OCP e4m3fn: bias 7, no infinities, S.1111.111 is NaN
    const uint32_t sign = (x & 0x80u) << 24, e = (x >> 3) & 15u, m = x & 7u;
    if ((x & 0x7fu) == 0x7fu) return gg_f32(sign | 0x7fc00000u);
    if (e == 0) return gg_f32(sign | gg_bits(gg_i2f((int)m) * 0.001953125f));
    return gg_f32(sign | ((e + 120u) << 23) | (m << 20));
}
GG_HD float gg_e5m2(uint32_t x) {                      // bias 15, S.11111.00 is infinity, S.11111.mm NaN
    const uint32_t sign = (x & 0x80u) << 24, e = (x >> 2) & 31u, m = x & 3u;
    if (e == 31) return gg_f32(sign | (m ? 0x7fc00000u : 0x7f800000u));
    if (e == 0) return gg_f32(sign | gg_bits(gg_i2f((int)m) * 1.52587890625e-05f));
    return gg_f32(sign | ((e + 112u) << 23) | (m << 21));
}
// UE8M0: 2^(e-127); e = 0 is the float32 subnormal 2^-127 (bits 0x00400000, made from bits: nothing flushes it),
// 0xFF is NaN.
GG_HD float gg_e8m0(uint32_t e) { return gg_f32(e == 255 ? 0x7fc00000u : e ? e << 23 : 0x00400000u); }
template <> GG_HD float gg_dq1<GG_F8_E4M3>(const uint8_t* p) { return gg_e4m3(p[0]); }
template <> GG_HD float gg_dq1<GG_F8_E5M2>(const uint8_t* p) { return gg_e5m2(p[0]); }
template <> GG_HD float gg_dq1<GG_F8_E8M0>(const uint8_t* p) { return gg_e8m0(p[0]); }

// ---- GGUF's E2M1 blocks ------------------------------------------------------------------------------------------
// MXFP4: e8m0 exponent, qs[16]; values are kvalues_mxfp4 (doubled e2m1) * 2^(e-127) * 0.5.
template <> GG_HD void gg_dq8<GG_MXFP4>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                        float* __restrict__ y) {
    const float d = gg_e8m0_half(b[0]);
    const int8_t* kv = reinterpret_cast<const int8_t*>(tab + GG_OFF_KV_MXFP4);
    const uint8_t* q = b + 1 + 8 * (i & 1);
    const int sh = 4 * (i >> 1);
    for (int k = 0; k < 8; ++k) y[k] = gg_mul(d, gg_i2f(kv[(q[k] >> sh) & 15]));   // d may be subnormal
}

// NVFP4: 4 ue4m3 scales, qs[32]; sub-block s (16 elements): element 16s + j is the low nibble of qs[8s + j]
// for j < 8, the high nibble of qs[8s + j - 8] otherwise.
template <> GG_HD void gg_dq8<GG_NVFP4>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__ tab,
                                        float* __restrict__ y) {
    const int s = i >> 1;
    const float d = gg_ue4m3_half(b[s]);
    const int8_t* kv = reinterpret_cast<const int8_t*>(tab + GG_OFF_KV_NVFP4);
    const uint8_t* q = b + 4 + 8 * s;
    const int sh = 4 * (i & 1);
    for (int k = 0; k < 8; ++k) y[k] = d * gg_i2f(kv[(q[k] >> sh) & 15]);
}

// ---- packed E2M1 (F4_E2M1): 8 elements in 4 bytes ---------------------------------------------------------------
// E2M1: bit 3 the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
// by the low 3 bits. From 2 up, the float32 bits of magnitude code m are 0x3f000000 + (m << 22) (the code's
// exponent and mantissa bits land on float32's); 0 and 0.5 are 0 x and 1 x 0x3f000000. -0 keeps its sign.
GG_HD float gg_e2m1(uint32_t n) {
    const uint32_t m = n & 7u;
    return gg_f32(((n & 8u) << 28) | (m > 1u ? 0x3f000000u + (m << 22) : m * 0x3f000000u));
}
// Element k of a row is nibble k % 2 of byte k / 2, the low nibble first (vLLM's break_fp4_bytes); the 8 elements
// of "block" i (always 0: a block is one 8-element item) are the nibbles of one little-endian 32-bit word.
template <> GG_HD void gg_dq8<GG_F4_E2M1>(const uint8_t* __restrict__ b, int i, const uint8_t* __restrict__,
                                          float* __restrict__ y) {
    const uint32_t w = gg_ld32(b + 4 * i);
    for (int k = 0; k < 8; ++k) y[k] = gg_e2m1(w >> (4 * k));
}
