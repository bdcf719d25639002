// Host build of the dequantizers and of the gather's per-item routine, so both are checked bit for bit against
// gguf.quants on machines without a GPU. Plain C++: g++ -x c++ -std=c++17 -ffp-contract=off -shared -fPIC
// (gds_gather.gpu.dequant.host_library() builds and loads it through ctypes).
#include "dequant.cuh"
#include "float8.cuh"
#include "gather.cu"

namespace {

template <int T>
void dequant_blocks(const uint8_t* blocks, long long n_blocks, const uint8_t* tab, float* out) {
    constexpr int QK = GGTraits<T>::QK, TS = GGTraits<T>::TS;
    for (long long b = 0; b < n_blocks; ++b) {
        const uint8_t* blk = blocks + b * TS;
        if constexpr (QK == 1) {
            out[b] = gg_dq1<T>(blk);
        } else {
            for (int i = 0; i < QK / 8; ++i) gg_dq8<T>(blk, i, tab, out + b * QK + 8 * i);
        }
    }
}

// The gather kernel's body over every (row, item); S = GG_NO_SCALE for gg_gather, a scale type for
// gg_gather_scaled.
template <int T, int S, int OD, typename I>
void gather_rows(const uint8_t* staging, const long long* offsets, const void* inverse, void* out,
                 const uint8_t* tab, long long n_rows, int row_elems, int seg, float scale, int has_scale,
                 const uint8_t* sstaging, const long long* soffsets, int sblock, float smul) {
    const int items = (row_elems + 7) / 8;
    for (long long r = 0; r < n_rows; ++r)
        for (int k = 0; k < items; ++k)
            gg_gather_item<T, S, OD, I>(staging, offsets, static_cast<const I*>(inverse), out, tab, n_rows,
                                        row_elems, seg, scale, has_scale, sstaging, soffsets, sblock, smul, r, k);
}

template <int T, int S>
int gather_type(int od, int idx64, const uint8_t* staging, const long long* offsets, const void* inverse,
                void* out, const uint8_t* tab, long long n_rows, int row_elems, int seg, float scale,
                int has_scale, const uint8_t* sstaging, const long long* soffsets, int sblock, float smul) {
#define GG_CASE(o, I)                                                                                         \
    if (od == o) {                                                                                            \
        gather_rows<T, S, o, I>(staging, offsets, inverse, out, tab, n_rows, row_elems, seg, scale, has_scale, \
                                sstaging, soffsets, sblock, smul);                                            \
        return 0;                                                                                             \
    }
    if (idx64) {
        GG_CASE(0, long long) GG_CASE(1, long long) GG_CASE(2, long long)
    } else {
        GG_CASE(0, int) GG_CASE(1, int) GG_CASE(2, int)
    }
#undef GG_CASE
    return -2;
}

}  // namespace

extern "C" {

// Elements and bytes per block of a GGML type id; -1 for a type this source does not know.
int gg_geometry(int type, int* qk, int* ts) {
    switch (type) {
#define GG_GEO(name, id, q, t) \
    case id: *qk = q; *ts = t; return 0;
        GG_TYPE_LIST(GG_GEO)
#undef GG_GEO
    }
    return -1;
}

// Dequantize n_blocks blocks of `type` into float32 (n_blocks * QK values); tab is the table blob.
int gg_host_dequant(int type, const uint8_t* blocks, long long n_blocks, const uint8_t* tab, float* out) {
    switch (type) {
#define GG_DQ(name, id, q, t) \
    case id: dequant_blocks<id>(blocks, n_blocks, tab, out); return 0;
        GG_TYPE_LIST(GG_DQ)
#undef GG_DQ
    }
    return -1;
}

// The gather kernel's body run over every (row, item) on the host: same arguments as gg_gather<T, od, I>.
int gg_host_gather(int type, int od, int idx64, const uint8_t* staging, const long long* offsets, const void* inverse,
                   void* out, const uint8_t* tab, long long n_rows, int row_elems, int seg, float scale,
                   int has_scale) {
    switch (type) {
#define GG_GA(name, id, q, t) \
    case id: return gather_type<id, GG_NO_SCALE>(od, idx64, staging, offsets, inverse, out, tab, n_rows, row_elems, \
                                                 seg, scale, has_scale, nullptr, nullptr, 1, 1.0f);
        GG_TYPE_LIST(GG_GA)
#undef GG_GA
    }
    return -1;
}

// The same for gg_gather_scaled<T, stype, od, I> (its arguments: gg_gather's, then sstaging, soffsets, sblock,
// smul); -1 for a (type, stype) pair without a scaled kernel.
int gg_host_gather_scaled(int type, int stype, int od, int idx64, const uint8_t* staging, const long long* offsets,
                          const void* inverse, void* out, const uint8_t* tab, long long n_rows, int row_elems,
                          int seg, float scale, int has_scale, const uint8_t* sstaging, const long long* soffsets,
                          int sblock, float smul) {
#define GG_GS(sname)                                                                                           \
    if (stype == GG_##sname)                                                                                   \
        return gather_type<T, GG_##sname>(od, idx64, staging, offsets, inverse, out, tab, n_rows, row_elems, seg, \
                                          scale, has_scale, sstaging, soffsets, sblock, smul);
#define GG_GT(tname)                                                                                           \
    if (type == GG_##tname) {                                                                                  \
        constexpr int T = GG_##tname;                                                                          \
        GG_SCALE_TYPES(GG_GS)                                                                                  \
    }
    GG_SCALED_TYPES(GG_GT)
#undef GG_GT
#undef GG_GS
    return -1;
}

// out[i] = gg_mul(a[i], b[i]): the device multiply as this build compiles it (GG_SOFT_MUL: HIP's path).
void gg_host_mul(const float* a, const float* b, float* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = gg_mul(a[i], b[i]);
}

}  // extern "C"
