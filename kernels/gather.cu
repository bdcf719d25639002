// Dequant-scatter gather: quantized rows in staging -> float32 / float16 / bfloat16 rows in GPU memory.
//
// gg_gather<T, OD, I>: T = row type id (GGML's, or a float8 id), OD = output dtype (0 float32, 1 float16,
// 2 bfloat16; 16-bit outputs are written as raw bits), I = index type of the inverse map (int or long long).
// gg_gather_scaled<T, S, OD, I>: the same for a table with block scales of element type S (GG_SCALE_TYPES), for
// the row types of GG_SCALED_TYPES; its arguments are gg_gather's, then sstaging, soffsets, sblock, smul.
//
//   staging   uint8 bytes holding the unique rows (compact: row u at u*row_bytes; O_DIRECT windows: anywhere)
//   offsets   int64 [U], byte offset of unique row u in staging (no alignment required)
//   inverse   I [n_rows], output row r takes unique row inverse[r]
//   out       output, element e of output row r goes to ((e / seg) * n_rows + r) * seg + e % seg:
//             seg == row_elems is the flat layout [n_rows, row_elems]; seg == 256 with row_elems = 256 * n_layer
//             is gemma's per-layer layout [n_layer, n_rows, 256]
//   value     out = dequant(row)[e] (* scale when has_scale), scale applied in float32 after dequantization,
//             then rounded to nearest even into the output dtype
// and, scaled:
//   sstaging  uint8 bytes holding the scale rows
//   soffsets  int64 [U], byte offset in sstaging of unique row u's scale row (unique rows may share one: a 2-D
//             block of scales covers several rows)
//   sblock    elements per scale along the row: element e of unique row u takes scale e / sblock of its scale
//             row, which holds ceil(row_elems / sblock) scales
//   smul      multiplies every block scale: scale_e = dequant(scale e / sblock) * smul (NVFP4's per-tensor global
//             scale; 1 otherwise, which changes no value)
//   value     out = dequant(row)[e] * scale_e, each product one float32 multiply rounded to nearest even with
//             subnormals kept (vLLM's NVFP4 order: e2m1 * (e4m3 scale * global)), then as above (* scale when
//             has_scale, then the output rounding)
//
// Work unit ("item"): 8 consecutive elements of one row. A CTA of 256 threads takes `rows_per_cta` consecutive
// output rows and strides over their items, so neighbouring threads read neighbouring bytes and write
// neighbouring 32/16-byte pieces of one output row. The same per-item routine (gg_gather_item) is compiled
// for the host by host_check.cu, which is how the whole gather is checked on machines without a GPU.
#ifndef GG_DEQUANT_INCLUDED
#include "dequant.cuh"
#endif
#ifndef GG_FLOAT8_INCLUDED
#include "float8.cuh"
#endif

// ---- output rounding --------------------------------------------------------------------------------------
// Round to nearest even. Host (and GG_SOFT_CVT / pre-sm_80 device code): these bit routines, equal to numpy
// astype(float16) and to gguf's BF16 quantizer (= torch .to(bfloat16)) for every non-NaN input. sm_80+
// device code: the cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32 instructions (IEEE RNE, the same non-NaN results;
// NaN payloads differ: the hardware writes a canonical NaN).
GG_HD uint32_t gg_to_half_bits(float f) {
    const uint32_t x = gg_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) {                                        // NaN: numpy keeps the top payload bits
        const uint32_t p = (a >> 13) & 0x3ffu;
        return sign | 0x7c00u | (p ? p : 1u);
    }
    if (a == 0x7f800000u) return sign | 0x7c00u;
    if (a >= 0x477ff000u) return sign | 0x7c00u;                  // rounds past 65504: inf
    if (a < 0x38800000u) {                                        // f16 subnormal or zero: exact float add rounds
        const float r = gg_f32(a) + 0.5f;                         // ulp(0.5f) = 2^-24, the f16 subnormal step:
        return sign | (gg_bits(r) - 0x3f000000u);                 // the add rounds to it (RNE), exactly
    }
    const uint32_t odd = (a >> 13) & 1u;
    return sign | ((a + 0xc8000fffu + odd) >> 13);                // rebias 127 -> 15 and round (wraps mod 2^32)
}
GG_HD uint32_t gg_to_bf16_bits(float f) {
    const uint32_t x = gg_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (x >> 16) | 0x40u;   // NaN stays NaN (quiet)
    return (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}

template <int OD> GG_HD uint32_t gg_pack2(float lo, float hi);   // two 16-bit results, lo in the low half
template <> GG_HD uint32_t gg_pack2<1>(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(GG_SOFT_CVT)
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));   // first source -> upper half
    return r;
#else
    return gg_to_half_bits(lo) | (gg_to_half_bits(hi) << 16);
#endif
}
template <> GG_HD uint32_t gg_pack2<2>(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(GG_SOFT_CVT)
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return gg_to_bf16_bits(lo) | (gg_to_bf16_bits(hi) << 16);
#endif
}
template <int OD> GG_HD uint32_t gg_one16(float v) { return gg_pack2<OD>(v, 0.0f) & 0xffffu; }

// log2 of a power of two.
GG_HD int gg_log2(int x) {
#if defined(GG_DEVICE)
    return 31 - __clz(x);
#else
    int r = 0;
    while ((1 << (r + 1)) <= x) ++r;
    return r;
#endif
}

// Store 8 consecutive values at element index `at` of `out`; vector stores when the address allows.
template <int OD> GG_HD void gg_store8(void* __restrict__ out, long long at, const float* v) {
    if constexpr (OD == 0) {
        float* p = static_cast<float*>(out) + at;
#if defined(GG_DEVICE)
        if ((reinterpret_cast<unsigned long long>(p) & 15) == 0) {
            reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
            reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
            return;
        }
#endif
        for (int k = 0; k < 8; ++k) p[k] = v[k];
    } else {
        uint16_t* p = static_cast<uint16_t*>(out) + at;
        const uint32_t w0 = gg_pack2<OD>(v[0], v[1]), w1 = gg_pack2<OD>(v[2], v[3]);
        const uint32_t w2 = gg_pack2<OD>(v[4], v[5]), w3 = gg_pack2<OD>(v[6], v[7]);
#if defined(GG_DEVICE)
        if ((reinterpret_cast<unsigned long long>(p) & 15) == 0) {
            reinterpret_cast<uint4*>(p)[0] = make_uint4(w0, w1, w2, w3);
            return;
        }
#endif
        const uint32_t w[4] = {w0, w1, w2, w3};
        for (int k = 0; k < 4; ++k) {
            p[2 * k] = (uint16_t)(w[k] & 0xffffu);
            p[2 * k + 1] = (uint16_t)(w[k] >> 16);
        }
    }
}

template <int OD> GG_HD void gg_store1(void* __restrict__ out, long long at, float v) {
    if constexpr (OD == 0) static_cast<float*>(out)[at] = v;
    else static_cast<uint16_t*>(out)[at] = (uint16_t)gg_one16<OD>(v);
}

// ---- one item: output row `row`, elements [8*item, 8*item + 8) ------------------------------------------------
// The row types with a block-scaled variant, and the scale element types (F32, BF16, UE8M0, E4M3).
#define GG_SCALED_TYPES(X) X(F8_E4M3) X(F8_E5M2) X(F4_E2M1)
#define GG_SCALE_TYPES(X) X(F32) X(BF16) X(F8_E8M0) X(F8_E4M3)
#define GG_NO_SCALE (-1)                               // S of an unscaled table: no sstaging, soffsets, sblock, smul

template <int T, int S, int OD, typename I>
GG_HD void gg_gather_item(const uint8_t* __restrict__ staging, const long long* __restrict__ offsets,
                          const I* __restrict__ inverse, void* __restrict__ out, const uint8_t* __restrict__ tab,
                          long long n_rows, int row_elems, int seg, float scale, int has_scale,
                          const uint8_t* __restrict__ sstaging, const long long* __restrict__ soffsets, int sblock,
                          float smul, long long row, int item) {
    constexpr unsigned QK = GGTraits<T>::QK, TS = GGTraits<T>::TS;
    const long long u = (long long)inverse[row];
    const uint8_t* src = staging + offsets[u];
    const unsigned e0 = 8u * (unsigned)item;
    float v[8];
    int n = 8;
    if constexpr (QK == 1) {                           // float types: any width, so the last item may be short
        n = row_elems - (int)e0 < 8 ? row_elems - (int)e0 : 8;
        for (int k = 0; k < 8; ++k) v[k] = k < n ? gg_dq1<T>(src + (unsigned long long)(e0 + k) * TS) : 0.0f;
    } else {
        gg_dq8<T>(src + (unsigned long long)(e0 / QK) * TS, (int)((e0 % QK) >> 3), tab, v);
    }
    if constexpr (S != GG_NO_SCALE) {                  // element e0 + k takes scale (e0 + k) / sblock
        // Each block scale times smul first, then the element times that (vLLM's NVFP4 order); smul = 1 leaves
        // every scale as it is (x * 1 is exact), so one path serves every scaled table.
        constexpr unsigned STS = GGTraits<S>::TS;
        const unsigned si = e0 / (unsigned)sblock;
        const uint8_t* sp = sstaging + soffsets[u] + si * STS;     // the scale of element e0, then of the next ones
        unsigned left = (si + 1) * (unsigned)sblock - e0;     // elements of this item before the next scale
        float sc = gg_mul(gg_dq1<S>(sp), smul);
        for (int k = 0; k < n; ++k) {                  // only the row's elements: no scale read past the row's
            if ((unsigned)k == left) {
                sp += STS;
                left += (unsigned)sblock;
                sc = gg_mul(gg_dq1<S>(sp), smul);
            }
            v[k] = gg_mul(v[k], sc);
        }
    }
    if (has_scale)
        for (int k = 0; k < 8; ++k) v[k] = gg_mul(v[k], scale);
    int l = 0, j = (int)e0;                            // flat layout: seg == row_elems
    if (seg != row_elems) {
        if ((seg & (seg - 1)) == 0) {                  // gemma: seg = 256
            l = (int)(e0 >> gg_log2(seg));
            j = (int)(e0 & (unsigned)(seg - 1));
        } else {
            l = (int)e0 / seg;
            j = (int)e0 - l * seg;
        }
    }
    if (n == 8 && j + 8 <= seg) {
        gg_store8<OD>(out, ((long long)l * n_rows + row) * seg + j, v);
    } else {
        for (int k = 0; k < n; ++k) {
            const int e = e0 + k, lk = e / seg;
            gg_store1<OD>(out, ((long long)lk * n_rows + row) * seg + (e - lk * seg), v[k]);
        }
    }
}

// ---- the kernel -----------------------------------------------------------------------------------------------
// CUDA (nvcc/NVRTC) and HIP (hipcc/hiprtc): the same kernel. HIP's second __launch_bounds__ argument means
// waves per execution unit, not CTAs per SM, so HIP gets the thread bound alone.
#if defined(__CUDACC__) || defined(__HIP__)
#define GG_BLOCK 256
#ifndef GG_MIN_CTAS
#define GG_MIN_CTAS 6   // resident CTAs per SM the registers must allow: 40 registers, no spills on sm_90
#endif
#if defined(__HIP__)
#define GG_LAUNCH_BOUNDS __launch_bounds__(GG_BLOCK)
#else
#define GG_LAUNCH_BOUNDS __launch_bounds__(GG_BLOCK, GG_MIN_CTAS)
#endif
// The CTA's share of the gather: rows [row0, row0 + rows_per_cta), every item of each.
template <int T, int S, int OD, typename I>
__device__ __forceinline__ void gg_gather_cta(const uint8_t* __restrict__ staging,
                                              const long long* __restrict__ offsets, const I* __restrict__ inverse,
                                              void* __restrict__ out, const uint8_t* __restrict__ tab,
                                              long long n_rows, int row_elems, int seg, int rows_per_cta,
                                              float scale, int has_scale, const uint8_t* __restrict__ sstaging,
                                              const long long* __restrict__ soffsets, int sblock,
                                              float smul) {
    const int items = (row_elems + 7) >> 3;
    const long long row0 = (long long)blockIdx.x * rows_per_cta;
    const long long left = n_rows - row0;
    const int total = (left < rows_per_cta ? (int)left : rows_per_cta) * items;
    const int step_r = GG_BLOCK / items, step_k = GG_BLOCK - step_r * items;
    int li = threadIdx.x;
    int r = li / items, k = li - r * items;
    for (; li < total; li += GG_BLOCK) {
        gg_gather_item<T, S, OD, I>(staging, offsets, inverse, out, tab, n_rows, row_elems, seg, scale, has_scale,
                                    sstaging, soffsets, sblock, smul, row0 + r, k);
        r += step_r;
        k += step_k;
        if (k >= items) {
            k -= items;
            ++r;
        }
    }
}

template <int T, int OD, typename I>
__global__ void GG_LAUNCH_BOUNDS
gg_gather(const uint8_t* __restrict__ staging, const long long* __restrict__ offsets, const I* __restrict__ inverse,
          void* __restrict__ out, const uint8_t* __restrict__ tab, long long n_rows, int row_elems, int seg,
          int rows_per_cta, float scale, int has_scale) {
    gg_gather_cta<T, GG_NO_SCALE, OD, I>(staging, offsets, inverse, out, tab, n_rows, row_elems, seg, rows_per_cta,
                                         scale, has_scale, nullptr, nullptr, 1, 1.0f);
}

template <int T, int S, int OD, typename I>
__global__ void GG_LAUNCH_BOUNDS
gg_gather_scaled(const uint8_t* __restrict__ staging, const long long* __restrict__ offsets,
                 const I* __restrict__ inverse, void* __restrict__ out, const uint8_t* __restrict__ tab,
                 long long n_rows, int row_elems, int seg, int rows_per_cta, float scale, int has_scale,
                 const uint8_t* __restrict__ sstaging, const long long* __restrict__ soffsets, int sblock,
                 float smul) {
    gg_gather_cta<T, S, OD, I>(staging, offsets, inverse, out, tab, n_rows, row_elems, seg, rows_per_cta, scale,
                               has_scale, sstaging, soffsets, sblock, smul);
}

// Compile checks (nvcc, hipcc): GG_INSTANTIATE_ALL builds every kernel the Python side names (30 row types x 3
// output dtypes x 2 index types, and the scaled kernels: 3 scaled types x 4 scale types x 3 x 2);
// GG_INSTANTIATE_EACH_TYPE builds one per type (int indices, output dtype id % 3, so every dequantizer and every
// output path is compiled) plus Q4_0's other five, and one scaled kernel per (type, scale type) pair, over
// every output dtype and both index types: 35 + 12, for slower compilers.
#define GG_INST1(id, od, I)                                                                                      \
    template __global__ void gg_gather<id, od, I>(const uint8_t* __restrict__, const long long* __restrict__,  \
                                                  const I* __restrict__, void* __restrict__,                   \
                                                  const uint8_t* __restrict__, long long, int, int, int, float, int);
#define GG_INST_SCALED1(t, s, od, I)                                                                             \
    template __global__ void gg_gather_scaled<GG_##t, GG_##s, od, I>(                                           \
        const uint8_t* __restrict__, const long long* __restrict__, const I* __restrict__, void* __restrict__,  \
        const uint8_t* __restrict__, long long, int, int, int, float, int, const uint8_t* __restrict__,         \
        const long long* __restrict__, int, float);
#if defined(GG_INSTANTIATE_ALL)
#define GG_INST(name, id, qk, ts)                                                                                \
    GG_INST1(id, 0, int) GG_INST1(id, 1, int) GG_INST1(id, 2, int)                                               \
    GG_INST1(id, 0, long long) GG_INST1(id, 1, long long) GG_INST1(id, 2, long long)
GG_TYPE_LIST(GG_INST)
#undef GG_INST
#define GG_INST_S(s, t)                                                                                          \
    GG_INST_SCALED1(t, s, 0, int) GG_INST_SCALED1(t, s, 1, int) GG_INST_SCALED1(t, s, 2, int)                    \
    GG_INST_SCALED1(t, s, 0, long long) GG_INST_SCALED1(t, s, 1, long long) GG_INST_SCALED1(t, s, 2, long long)
#define GG_INST_E4M3(s) GG_INST_S(s, F8_E4M3)
#define GG_INST_E5M2(s) GG_INST_S(s, F8_E5M2)
#define GG_INST_E2M1(s) GG_INST_S(s, F4_E2M1)
GG_SCALE_TYPES(GG_INST_E4M3)
GG_SCALE_TYPES(GG_INST_E5M2)
GG_SCALE_TYPES(GG_INST_E2M1)
#undef GG_INST_E4M3
#undef GG_INST_E5M2
#undef GG_INST_E2M1
#undef GG_INST_S
#elif defined(GG_INSTANTIATE_EACH_TYPE)
#define GG_INST(name, id, qk, ts) GG_INST1(id, id % 3, int)
GG_TYPE_LIST(GG_INST)
#undef GG_INST
GG_INST1(2, 0, int) GG_INST1(2, 1, int) GG_INST1(2, 0, long long) GG_INST1(2, 1, long long) GG_INST1(2, 2, long long)
GG_INST_SCALED1(F8_E4M3, F32, 0, int) GG_INST_SCALED1(F8_E4M3, BF16, 1, long long)
GG_INST_SCALED1(F8_E4M3, F8_E8M0, 2, int) GG_INST_SCALED1(F8_E4M3, F8_E4M3, 0, long long)
GG_INST_SCALED1(F8_E5M2, F32, 1, int) GG_INST_SCALED1(F8_E5M2, BF16, 2, long long)
GG_INST_SCALED1(F8_E5M2, F8_E8M0, 0, long long) GG_INST_SCALED1(F8_E5M2, F8_E4M3, 1, int)
GG_INST_SCALED1(F4_E2M1, F32, 2, int) GG_INST_SCALED1(F4_E2M1, BF16, 0, long long)
GG_INST_SCALED1(F4_E2M1, F8_E8M0, 1, long long) GG_INST_SCALED1(F4_E2M1, F8_E4M3, 2, long long)
#endif
#undef GG_INST1
#undef GG_INST_SCALED1
#endif  // __CUDACC__ || __HIP__
