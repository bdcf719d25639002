// Copies whose size the device reads from memory, for the device-resident row cache (gds_gather/gpu/devcache.py).
//
// A CUDA graph's memcpy node has a fixed size, so a captured prefill that copied its fresh rows with one would move
// the largest ubatch's bytes every time, hits included. These kernels run with a fixed grid (captured once) and
// take their counts from a small int64 control array the graph copies up per ubatch:
//     ctl[0] = 8-byte words of fresh rows to copy from (GPU-mapped, pinned) host memory into the pool,
//     ctl[1] = rows to copy inside the pool, from the fresh area into their cache slots (admissions).
// Work beyond a count is skipped, so a scrubbed control array (zeros) makes both kernels do nothing.
//
// Plain C/C++ (hipcc alone needs its runtime header): NVRTC, nvcc, hipcc/hiprtc (clang -x hip) and a host C++ compiler (the test
// defines __global__ and the thread indices) all build it.

#if defined(__HIP__) && !defined(__HIPCC_RTC__)   // hipcc (cupy's hiprtc path adds this include itself)
#include <hip/hip_runtime.h>
#endif

extern "C" __global__ void gg_copy_words(const unsigned long long* src, unsigned long long* dst,
                                         const long long* ctl) {
    const long long n = ctl[0];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}

// src[r], dst[r]: byte offsets in `pool` of row r's fresh copy and of its cache slot (never overlapping: slots lie
// before the fresh area). One CTA per row at a time; 8-byte moves where row and offsets allow, bytes otherwise.
extern "C" __global__ void gg_copy_rows(unsigned char* pool, const long long* src, const long long* dst,
                                        const long long* ctl, long long row_bytes) {
    const long long n = ctl[1];
    for (long long r = blockIdx.x; r < n; r += gridDim.x) {
        const long long s = src[r], d = dst[r];
        if (((s | d | row_bytes) & 7) == 0) {
            const unsigned long long* a = (const unsigned long long*)(pool + s);
            unsigned long long* b = (unsigned long long*)(pool + d);
            for (long long w = threadIdx.x; w < row_bytes / 8; w += blockDim.x) b[w] = a[w];
        } else {
            for (long long w = threadIdx.x; w < row_bytes; w += blockDim.x) pool[d + w] = pool[s + w];
        }
    }
}
