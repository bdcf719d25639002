/* Native helpers for gds_gather, compiled on first use and loaded with ctypes (see native.py).
 *
 * gg_pread_pool: a pool of threads issuing pread(2) for a batch of extents, the way llama.cpp's on-direct
 *   reader does (and the engine's fallback where io_uring is missing). Short reads continue, EINTR/EAGAIN
 *   retry, the first error stops every thread and is reported with the extent's index.
 * gg_madvise_ranges: one madvise(2) per range of a mapping (batched readahead hints).
 * gg_publish_i32: a release store of a flag that the GPU polls, ordered after every earlier store.
 * gg_copy_rows: rows at byte offsets of one buffer copied to byte offsets of another, with no temporary (numpy's
 *   gather then scatter allocates one, and fresh memory's first touch costs more than the copy), by one thread or
 *   several.
 * gg_hash_get, gg_hash_insert: rowcache.HashIndex's look-up and insertion (the same table, hash and probe order
 *   as its numpy code), one key at a time: a batch's probe rounds cost a dozen numpy calls each there.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct {
    int fd;
    const int64_t *off, *len, *expect, *dst_off;
    uint8_t *dst;
    int64_t n, align;
    int64_t inject_index;   /* tests: extent whose first read fails with inject_err (-1: none) */
    int inject_err;         /* errno to inject, or -2: a short read of half the extent */
    atomic_long next;
    atomic_int stop;
    atomic_long err_index;
    atomic_int err_code;    /* errno, or -1 for an unexpected end of file */
} job_t;

static void fail(job_t *j, int64_t i, int code) {
    long none = -1;
    if (atomic_compare_exchange_strong(&j->err_index, &none, (long)i)) atomic_store(&j->err_code, code);
    atomic_store(&j->stop, 1);
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (;;) {
        if (atomic_load(&j->stop)) return NULL;
        int64_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n) return NULL;
        int64_t got = 0, want = j->len[i];
        int injected = (i == j->inject_index);
        while (got < j->expect[i]) {
            ssize_t r;
            if (injected && j->inject_err == -2) {          /* simulated short read */
                int64_t half = want / 2 / j->align * j->align;
                r = pread(j->fd, j->dst + j->dst_off[i], (size_t)(half > 0 ? half : want), j->off[i]);
                injected = 0;
            } else if (injected) {
                injected = 0;
                errno = j->inject_err;
                r = -1;
            } else {
                r = pread(j->fd, j->dst + j->dst_off[i] + got, (size_t)(want - got), j->off[i] + got);
            }
            if (r < 0) {
                if (errno == EINTR || errno == EAGAIN) continue;
                fail(j, i, errno);
                return NULL;
            }
            if (r == 0) { fail(j, i, -1); return NULL; }
            int64_t start = got;
            got += r;
            if (got < j->expect[i]) {
                got -= got % j->align;                      /* O_DIRECT: resume at an aligned offset */
                if (got <= start) { fail(j, i, -1); return NULL; }  /* file ends in this block: would loop */
            }
        }
    }
}

int64_t gg_pread_pool(int fd, const int64_t *off, const int64_t *len, const int64_t *expect, uint8_t *dst,
                      const int64_t *dst_off, int64_t n, int64_t align, int nthreads, int64_t inject_index,
                      int inject_err, int *err_code) {
    job_t j = {fd, off, len, expect, dst_off, dst, n, align > 0 ? align : 1, inject_index, inject_err};
    atomic_init(&j.next, 0);
    atomic_init(&j.stop, 0);
    atomic_init(&j.err_index, -1);
    atomic_init(&j.err_code, 0);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 1024) nthreads = 1024;
    if (nthreads > n) nthreads = (int)(n > 0 ? n : 1);
    pthread_t th[1024];
    int started = 0;
    for (; started < nthreads - 1; started++)
        if (pthread_create(&th[started], NULL, worker, &j) != 0) break;
    worker(&j);                                 /* the calling thread works too */
    for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
    *err_code = atomic_load(&j.err_code);
    return atomic_load(&j.err_index);          /* -1: every extent read */
}

int gg_madvise_ranges(uint8_t *base, const int64_t *off, const int64_t *len, int64_t n, int advice) {
    for (int64_t i = 0; i < n; i++)
        if (madvise(base + off[i], (size_t)len[i], advice) != 0) return errno;
    return 0;
}

/* out[i] = 1 where every page of [first[i], first[i] + count[i]) of the mapping at `base` is in the page cache
   (mincore), else 0: the residency of a batch's rows in one call, without a map of the whole file. */
void gg_mincore_rows(uint8_t *base, const int64_t *first, const int64_t *count, int64_t n, int64_t page,
                     uint8_t *out) {
    unsigned char vec[256];
    for (int64_t i = 0; i < n; i++) {
        int ok = 1;
        for (int64_t p = first[i], left = count[i]; left > 0 && ok;) {
            int64_t k = left < 256 ? left : 256;
            if (mincore(base + p * page, (size_t)(k * page), vec) != 0) ok = 0;
            for (int64_t j = 0; j < k && ok; j++) ok = vec[j] & 1;
            p += k;
            left -= k;
        }
        out[i] = (uint8_t)ok;
    }
}

/* Store `value` into `*flag` after every store this thread made or saw before it (the staging a GPU wait-value node
   releases): a sequentially consistent fence (mfence on x86-64, dmb ish on arm64), on arm64 also dmb sy so that an
   observer outside the inner-shareable domain (the GPU on GB10's C2C link) sees the same order, then a release
   store. A mutex lock/unlock is no store-store barrier: stores before the lock may pass the flag store. */
void gg_publish_i32(int32_t *flag, int32_t value) {
    atomic_thread_fence(memory_order_seq_cst);
#if defined(__aarch64__)
    __asm__ __volatile__("dmb sy" ::: "memory");
#endif
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
}

typedef struct {
    const uint8_t *src;
    const int64_t *src_off, *dst_off;
    uint8_t *dst;
    int64_t n, row_bytes, chunk;
    atomic_long next;       /* the first row of the next chunk a thread takes */
} copy_t;

static void *copy_part(void *arg) {
    copy_t *c = arg;
    for (;;) {
        int64_t lo = atomic_fetch_add(&c->next, c->chunk);
        if (lo >= c->n) break;
        int64_t hi = lo + c->chunk < c->n ? lo + c->chunk : c->n;
        for (int64_t i = lo; i < hi; i++)
            memcpy(c->dst + c->dst_off[i], c->src + c->src_off[i], (size_t)c->row_bytes);
    }
    return NULL;
}

/* dst + dst_off[i] <- src + src_off[i], row_bytes each, for every i (bounds checked by the caller, native.py), by
   nthreads threads taking chunks of GG_COPY_CHUNK rows in turn (where src is a fresh mapping of the page cache, the
   copy is its page faults, which threads take in parallel; a thread whose CPU is slow, as a VM's can be for a
   while, takes fewer chunks instead of holding up a fixed share). */
#define GG_COPY_CHUNK 256
void gg_copy_rows(const uint8_t *src, const int64_t *src_off, uint8_t *dst, const int64_t *dst_off, int64_t n,
                  int64_t row_bytes, int nthreads) {
    if (nthreads > 16) nthreads = 16;
    if (nthreads > n) nthreads = (int)n;
    if (nthreads < 1) nthreads = 1;
    copy_t c = {src, src_off, dst_off, dst, n, row_bytes, nthreads > 1 ? GG_COPY_CHUNK : (n > 0 ? n : 1), 0};
    pthread_t th[16];
    int started = 0;
    for (; started < nthreads - 1; started++)
        if (pthread_create(&th[started], NULL, copy_part, &c) != 0) break;
    copy_part(&c);                              /* the calling thread copies too (all of it, with no thread) */
    for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
}

/* rowcache.HashIndex: keys int64 (-1 empty, -2 deleted), vals int32, 2^bits entries, home = (key * GOLD) >> shift,
   linear probing. */
#define GG_GOLD 0x9E3779B97F4A7C15ULL
/* The insertions and counters below touch a random place of a table of up to tens of MiB per key: their loops ask
   for the place of the key GG_AHEAD keys on, so a batch's cache misses overlap (25-40% less time on a 2.2M-slot
   cache; gg_hash_get's look-up was slower with it: docs/decisions/row-cache-policy.md). */
#define GG_AHEAD 32
#if defined(__GNUC__) || defined(__clang__)
#define GG_PREFETCH(addr, rw) __builtin_prefetch((addr), (rw))
#else
#define GG_PREFETCH(addr, rw) ((void)0)
#endif

void gg_hash_get(const int64_t *keys, const int32_t *vals, int64_t mask, int shift, const int64_t *q, int64_t n,
                 int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t p = ((uint64_t)q[i] * GG_GOLD) >> shift;
        for (;;) {
            int64_t k = keys[p];
            if (k == q[i]) { out[i] = vals[p]; break; }
            if (k == -1) { out[i] = -1; break; }
            p = (p + 1) & (uint64_t)mask;
        }
    }
}

/* Insert distinct absent keys at the first empty or deleted entry of their probe; returns the deleted entries
   reused. */
int64_t gg_hash_insert(int64_t *keys, int32_t *vals, int64_t mask, int shift, const int64_t *k, const int64_t *v,
                       int64_t n) {
    int64_t reused = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + GG_AHEAD < n) {
            uint64_t a = ((uint64_t)k[i + GG_AHEAD] * GG_GOLD) >> shift;
            GG_PREFETCH(&keys[a], 1);
            GG_PREFETCH(&vals[a], 1);
        }
        uint64_t p = ((uint64_t)k[i] * GG_GOLD) >> shift;
        while (keys[p] >= 0) p = (p + 1) & (uint64_t)mask;
        reused += keys[p] == -2;
        keys[p] = k[i];
        vals[p] = (int32_t)v[i];
    }
    return reused;
}

/* rowcache.FreqSketch: 4 rows of `width` uint8 counters, row d's counter of key k at (k * seed[d]) >> shift. add:
   one saturating increment per key and row (every key counts, colliding ones too); min: each key's estimate. */
void gg_sketch_add(uint8_t *table, int64_t width, int shift, const uint64_t *seeds, const int64_t *k, int64_t n) {
    for (int d = 0; d < 4; d++) {
        uint8_t *row = table + d * width;
        uint64_t seed = seeds[d];
        for (int64_t i = 0; i < n; i++) {
            if (i + GG_AHEAD < n) GG_PREFETCH(row + (((uint64_t)k[i + GG_AHEAD] * seed) >> shift), 1);
            uint8_t *c = row + (((uint64_t)k[i] * seed) >> shift);
            *c += *c < 255;
        }
    }
}

void gg_sketch_min(const uint8_t *table, int64_t width, int shift, const uint64_t *seeds, const int64_t *k,
                   int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (i + GG_AHEAD < n)
            for (int d = 0; d < 4; d++)
                GG_PREFETCH(&table[d * width + (((uint64_t)k[i + GG_AHEAD] * seeds[d]) >> shift)], 0);
        uint8_t m = 255;
        for (int d = 0; d < 4; d++) {
            uint8_t c = table[d * width + (((uint64_t)k[i] * seeds[d]) >> shift)];
            m = c < m ? c : m;
        }
        out[i] = m;
    }
}
