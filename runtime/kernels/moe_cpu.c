/* Host expert kernels of tiered-moe: one grouped MoE call per layer (gate/up -> SwiGLU -> down for
 * every expert of the layer and its token rows), reading the stored expert bytes as they are: bf16 /
 * fp16 / fp32 input-major [in, out] operands, and MXFP4, INT4 (compressed-tensors pack-quantized) and
 * FP8 E4M3 (block scales) output-major [out, in] codes, decoded in registers - no float32 copy of a
 * weight is ever written to memory. Plus a bf16 GEMV for dense (non-expert) weights kept in bf16.
 *
 * Activations and accumulators are float32. A quantized weight element is decoded to its exact float32
 * value (code value x scale: both small enough that the product is exact), so the result differs from
 * dequantize-then-matmul only by the order of the float32 sums.
 *
 * Built by runtime/kernels/__init__.py with gcc -O3 -mavx2 -mfma -mf16c -fopenmp when the CPU has them;
 * threads: a pool of our own (below: workers spin for a while after each job, then sleep), work split
 * by output rows or column blocks of every expert, so at decode's one token per expert every thread
 * streams weights. */
#if defined(__aarch64__)
#include "neon_x86.h"     /* the AVX2 path's intrinsics on NEON: one source for both machines */
#else
#include <immintrin.h>
#endif
#include <math.h>
#include "moe_cpu.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define AI inline __attribute__((always_inline))
/* Weights stream from memory once per use: a software prefetch PFD bytes ahead keeps enough lines in
 * flight that one thread reads at close to its memory bandwidth (the hardware prefetcher alone stops
 * short). Into L2 (T1), not L1 (NTA): on this project's AMD EPYC machine, 2048 x 2048 int4 x q8 rows from
 * DRAM at one thread ran 11 GB/s with NTA and 21 GB/s with T1 (int8 11 -> 27, bf16 18 -> 23; decode of the
 * wide 128-expert shape with --dense-quant int4 19.4 -> 11.3 ms CPU per token; bench/results/prefetch_hint.md).
 * Our reading, not measured: NTA lines go to L1 and evict the activations and scales the dots reread.
 * PFH overrides the hint at build (-DPFH=_MM_HINT_NTA for the A/B). */
#ifndef PFD
#define PFD 8192
#endif
#ifndef PFH
#define PFH _MM_HINT_T1
#endif
#define PF(p) _mm_prefetch((const char *)(p) + PFD, PFH)
#define BY_R(R, CALL) switch (R) { case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); }


/* The ABI's version: runtime/kernels/__init__.py refuses a library of another one (the cache key is the
 * source, so only a library from elsewhere can be stale). 3: capacities in tm_moe_t / tm_lin_t /
 * tm_layer_t / tm_step_t, and error codes from every entry point. */
int tm_version(void) { return 6; }

/* Error codes of the exported entry points, all checked before any work (O(experts + rows + keys),
 * never per element). runtime/kernels/__init__.py mirrors the numbers and raises KernelError naming the
 * entry point and the code with tm_strerror's text. */
enum {
    TM_E_LAYOUT = -1,     /* sizes or a layout this kernel does not take */
    TM_E_GROUP = -2,      /* int4 / int8 scale group not a positive multiple of 32 */
    TM_E_FP8 = -3,        /* fp8 scale tile or sizes not multiples of 8 */
    TM_E_ARG = -5,        /* a negative or zero size, an unknown format / activation / router code */
    TM_E_NULL = -6,       /* a buffer or weight the call needs is NULL */
    TM_E_ROWS = -7,       /* an expert's rows (row0, rows) outside the row buffers */
    TM_E_TOK = -8,        /* tok: a gathered row's token outside xin */
    TM_E_BACK = -9,       /* back: a (token, slot)'s row outside the rows the call computes */
    TM_E_SCRATCH = -10,   /* a scratch buffer smaller than the call needs */
    TM_E_POS = -11,       /* pos: a sequence's position outside its row of read slots */
    TM_E_SLOT = -12,      /* write / read: a slot outside the KV cache */
    TM_E_NOMEM = -13,     /* malloc failed */
};

const char *tm_strerror(int code) {
    switch (code) {
        case 0: return "ok";
        case TM_E_LAYOUT: return "sizes or a layout the kernel does not take";
        case TM_E_GROUP: return "scale group not a positive multiple of 32";
        case TM_E_FP8: return "fp8 scale tile or sizes not multiples of 8";
        case TM_E_ARG: return "a negative or zero size, or an unknown format / activation / router";
        case TM_E_NULL: return "a buffer or weight the call needs is NULL";
        case TM_E_ROWS: return "an expert's rows (row0, rows) run outside the row buffers";
        case TM_E_TOK: return "a gathered row's token (tok) outside the input rows";
        case TM_E_BACK: return "a (token, slot)'s row (back) outside the rows computed";
        case TM_E_SCRATCH: return "a scratch buffer smaller than the call needs";
        case TM_E_POS: return "a position (pos) outside the sequence's read slots";
        case TM_E_SLOT: return "a write / read slot outside the KV cache, or a state slot outside its arena or shared";
        case TM_E_NOMEM: return "out of memory";
        default: return "unknown code";
    }
}

/* 0 <= lo, 0 <= n and lo + n <= cap, without overflow */
static inline int in_range(int64_t lo, int64_t n, int64_t cap) { return lo >= 0 && n >= 0 && lo <= cap - n; }

/* ---- the thread pool ----------------------------------------------------------------------------------
 * Decode runs ~20 parallel kernels per layer-step of a few to a hundred microseconds each, with Python
 * between them. OpenMP's default (passive) waiting put its workers to sleep between them, so 2 threads
 * decoded 3.5x slower than one (measured: 230 vs 790 tok/s on the mid-size model). Here, as in
 * llama.cpp's ggml thread pool, workers spin on a generation counter for ``spin_us`` after each job
 * (the gaps between kernels are shorter), then sleep on a condition variable; the caller is thread 0.
 * One job at a time: a second caller (another Python thread) runs its job alone rather than wait. */
typedef struct { _Atomic int count, sense; int nth; } tm_bar;
typedef void (*tm_fn)(void *arg, int ith, int nth, tm_bar *bar);

#define TM_MAX_THREADS 256
static struct {
    pthread_mutex_t run_mu, mu;
    pthread_cond_t cv;
    int started;
    _Atomic int ready, done;
    _Atomic unsigned gen;
    tm_fn fn;
    void *arg;
    int nth;
    tm_bar *bar;
    long spin_ns;
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, 2000000};

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Each thread's sense flips at every barrier of a job (sense-reversing barrier). */
static void bar_wait(tm_bar *b, int *ls) {
    if (b->nth <= 1) return;
    *ls = !*ls;
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == b->nth - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store_explicit(&b->sense, *ls, memory_order_release);
    } else
        while (atomic_load_explicit(&b->sense, memory_order_acquire) != *ls) _mm_pause();
}

static void *pool_worker(void *p) {
    const int id = (int)(intptr_t)p;
    unsigned seen = atomic_load(&P.gen);
    atomic_fetch_add(&P.ready, 1);
    for (;;) {
        long t0 = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&P.gen, memory_order_acquire) == seen) {
            _mm_pause();
            if (++spins < 256) continue;
            spins = 0;
            if (now_ns() - t0 > P.spin_ns) {
                pthread_mutex_lock(&P.mu);
                while (atomic_load(&P.gen) == seen) pthread_cond_wait(&P.cv, &P.mu);
                pthread_mutex_unlock(&P.mu);
            }
        }
        seen = atomic_load(&P.gen);
        if (id < P.nth) P.fn(P.arg, id, P.nth, P.bar);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
    return NULL;
}

static void pool_after_fork(void) {      /* a forked child has no workers: start afresh */
    pthread_mutex_init(&P.run_mu, NULL);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv, NULL);
    P.started = 0;
    atomic_store(&P.ready, 0);
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void pool_at_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

static void pool_run(tm_fn fn, void *arg, int nth) {
    tm_bar bar = {0, 0, 1};
    if (nth > TM_MAX_THREADS) nth = TM_MAX_THREADS;
    if (nth <= 1 || pthread_mutex_trylock(&P.run_mu) != 0) { fn(arg, 0, 1, &bar); return; }
    pthread_once(&fork_once, pool_at_fork);
    while (P.started < nth - 1) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, pool_worker, (void *)(intptr_t)(P.started + 1))) { pthread_attr_destroy(&at); break; }
        pthread_attr_destroy(&at);
        P.started++;
    }
    while (atomic_load(&P.ready) < P.started) _mm_pause();      /* each new worker has read gen */
    if (nth > P.started + 1) nth = P.started + 1;
    bar.nth = nth;
    P.fn = fn; P.arg = arg; P.nth = nth; P.bar = &bar;
    atomic_store(&P.done, 0);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    pthread_mutex_lock(&P.mu);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    fn(arg, 0, nth, &bar);
    while (atomic_load_explicit(&P.done, memory_order_acquire) < P.started) _mm_pause();
    pthread_mutex_unlock(&P.run_mu);
}

void tm_set_spin_us(int64_t us) { P.spin_ns = us < 0 ? 0 : us * 1000; }

/* [ith, nth)'s share of n items, as OpenMP's static schedule splits them */
#define SPLIT(n, lo, hi) const long lo = (long)(n) * ith / nth, hi = (long)(n) * (ith + 1) / nth


/* The instruction set this build was compiled for (runtime/kernels/__init__.py picks the flags from the
 * CPU's): AVX2 + FMA + F16C always; AVX-512 (F, BW, VL, DQ) widens every loop to 16 floats / 64 bytes;
 * with AVX512-VNNI the q8 path multiplies 64 nibble codes by 64 activation bytes in one vpdpbusd. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TM_AVX512 1
#else
#define TM_AVX512 0
#endif
#if TM_AVX512 && defined(__AVX512VNNI__)
#define TM_VNNI 1
#else
#define TM_VNNI 0
#endif
#if defined(__aarch64__)
int tm_isa(void) { return 4; }                         /* 4 aarch64 NEON (the AVX2 path on neon_x86.h) */
#else
int tm_isa(void) { return 1 + TM_AVX512 + TM_VNNI; }   /* 1 avx2, 2 avx512, 3 avx512 + vnni */
#endif

/* 1 in the AddressSanitizer build (TIERED_MOE_KERNEL_SANITIZE=1): tests/kernels_sanitize.sh asserts its
 * tests ran on it, not on a normal library. */
int tm_sanitized(void) {
#ifdef __SANITIZE_ADDRESS__
    return 1;
#else
    return 0;
#endif
}

/* q8 scratch per activation row of K values: K code bytes (ldq), and ``tm_q8_ldd(K)`` 32-bit words of
 * scales. AVX2: one float per 32, then per 32 an 8-int32 offset correction for int4 codes (lane 0: 8 x the
 * block's code sum, the rest 0: see nib_4rows_q8). VNNI: per quad of 32-chunks a 16-float scale vector and a
 * 16-int32 offset correction laid out as the vpdpbusd lanes use them, plus 16 words for each of up to three
 * chunks left over (see q8_quantize); int8 weights (natural order) use pairs: the larger of the two. */
int64_t tm_q8_ldd(int64_t K) { return TM_VNNI ? (K / 64) * 32 + 48 : K / 32 + K / 4; }

/* ---- element decoding ------------------------------------------------------------------------ */
static inline float bf16_to_f32(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 load8(const int fmt, const void *W, long i) {
    if (fmt == F_F32) return _mm256_loadu_ps((const float *)W + i);
    if (fmt == F_BF16) return bf16x8((const uint16_t *)W + i);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)W + i)));
}
static inline float load1(const int fmt, const void *W, long i) {
    if (fmt == F_F32) return ((const float *)W)[i];
    if (fmt == F_BF16) return bf16_to_f32(((const uint16_t *)W)[i]);
    return _cvtsh_ss(((const uint16_t *)W)[i]);
}
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float E8M0[256];           /* E8M0 byte -> 2^(s - 127) / 2 (the code table is doubled) */
static void build_tables(void) {
    for (int s = 0; s < 255; s++) E8M0[s] = ldexpf(1.0f, s - 128);
    E8M0[255] = NAN;
}
/* Once per process, whichever thread calls first: two Python threads entering tm_moe together must not
 * see a half-built table (pthread_once also orders the writes before every reader). */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;
static void init_tables(void) { pthread_once(&tables_once, build_tables); }

/* 32 nibble codes (16 bytes, element 2j in the low nibble of byte j) -> 4 x 8 floats, by the int8
 * table ``lut`` (int4: q - 8; mxfp4: twice the E2M1 value, so every entry is an integer). */
static inline void nib32(const uint8_t *p, __m128i lut, __m256 w[4]) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, m4));
    __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m4));
    __m128i v0 = _mm_unpacklo_epi8(lo, hi), v1 = _mm_unpackhi_epi8(lo, hi);   /* elements 0..15, 16..31 */
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v0, v0)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v1, v1)));
}

/* 8 E4M3 bytes -> floats: exponent and mantissa moved to float32's position, times 2^120 (the bias
 * difference; exact for normals and subnormals), sign copied. (0x7F / 0xFF, E4M3's NaN, read 480.) */
static inline __m256 fp8x8(const uint8_t *p) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i mag = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20);
    __m256i sgn = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(mag, sgn)), _mm256_set1_ps(0x1p120f));
}

static inline float scale_at(const void *S, int sfmt, long i) {
    if (sfmt == S_F32) return ((const float *)S)[i];
    if (sfmt == S_BF16) return bf16_to_f32(((const uint16_t *)S)[i]);
    return _cvtsh_ss(((const uint16_t *)S)[i]);
}

/* ---- dense input-major W [K, N] (ld ldw): y[r, n0:n1] = x[r] @ W[:, n0:n1] ------------------------
 * axpy form, one row of W at a time read front to back, the outputs accumulated in y (L1): one
 * sequential stream, which this class of machine reads at ~1.8x the bandwidth of four interleaved
 * ones (bench/host_kernels.py). Tokens in pairs, so one weight vector read serves two. */
static inline __attribute__((always_inline)) void axpy1(const int fmt, const int R, const void *W, long ldw, long k,
        long n0, long n1, const float *x, long ldx, float *y, long ldy) {
    __m256 xb[2];
    for (int r = 0; r < R; r++) xb[r] = _mm256_set1_ps(x[r * ldx + k]);
    long c = n0;
    for (; c + 16 <= n1; c += 16) {
        PF((const char *)W + (k * ldw + c) * (fmt == F_F32 ? 4 : 2));
        __m256 w0 = load8(fmt, W, k * ldw + c), w1 = load8(fmt, W, k * ldw + c + 8);
        for (int r = 0; r < R; r++) {
            float *yr = y + r * ldy + c;
            _mm256_storeu_ps(yr, _mm256_fmadd_ps(xb[r], w0, _mm256_loadu_ps(yr)));
            _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(xb[r], w1, _mm256_loadu_ps(yr + 8)));
        }
    }
    for (; c < n1; c++)
        for (int r = 0; r < R; r++) y[r * ldy + c] += x[r * ldx + k] * load1(fmt, W, k * ldw + c);
}

#if TM_AVX512
static inline __m512 load16(const int fmt, const void *W, long i) {
    if (fmt == F_F32) return _mm512_loadu_ps((const float *)W + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)W + i));
    if (fmt == F_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#endif
/* The axpy form at 8 floats a vector in every build. Its stores bound it, and a Zen 4 core (AVX-512 in two
 * 256-bit halves) retires a 512-bit store every other cycle: there a 16-float form took 108 us per mid-size bf16
 * expert against this one's 85 (bench/host_kernels.py, 1 token; the same sums, so the same outputs). A core with
 * full-width stores might prefer the wide form - not measured. */
#define AXPY axpy1

static void dense_proj(int fmt, const void *W, long ldw, int K, long n0, long n1, const float *x, long ldx,
                       long nrows, float *y, long ldy) {
    for (long r = 0; r < nrows; r++) memset(y + r * ldy + n0, 0, (n1 - n0) * sizeof(float));
    for (long r = 0; r < nrows; r += 2) {
        const int R = nrows - r >= 2 ? 2 : 1;
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        for (long k = 0; k < K; k++) {
            if (fmt == F_BF16) { if (R == 2) AXPY(F_BF16, 2, W, ldw, k, n0, n1, xr, ldx, yr, ldy); else AXPY(F_BF16, 1, W, ldw, k, n0, n1, xr, ldx, yr, ldy); }
            else if (fmt == F_F32) { if (R == 2) AXPY(F_F32, 2, W, ldw, k, n0, n1, xr, ldx, yr, ldy); else AXPY(F_F32, 1, W, ldw, k, n0, n1, xr, ldx, yr, ldy); }
            else { if (R == 2) AXPY(F_F16, 2, W, ldw, k, n0, n1, xr, ldx, yr, ldy); else AXPY(F_F16, 1, W, ldw, k, n0, n1, xr, ldx, yr, ldy); }
        }
    }
}

/* ---- quantized output-major W [N, K]: y[r, o] = x[r] . w_o for o in [o0, o1) ------------------ */
#if TM_AVX512
static inline __attribute__((always_inline)) void nib_row(const int R, const uint8_t *wrow, const void *srow,
        int sfmt, int group, int mx, int K, __m128i lut, const float *x, long ldx, float *out, long ldo) {
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const int per = group / 32, nc = K / 32;
    for (int c = 0; c < nc; c++) {
        __m512 sv = _mm512_set1_ps(mx ? E8M0[((const uint8_t *)srow)[c]] : scale_at(srow, sfmt, per == 1 ? c : c / per));
        if (!(c & 3)) PF(wrow + 16 * c);
        __m128i b = _mm_loadu_si128((const __m128i *)(wrow + 16 * c));
        __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, m4));
        __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m4));
        /* elements 0..15 and 16..31 in order; times the scale: each element's exact value */
        __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(lo, hi))), sv);
        __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(lo, hi))), sv);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + 32 * c;
            acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

static inline __m512 fp8x16(const uint8_t *p) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7F)), 20);
    __m512i sgn = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(mag, sgn)), _mm512_set1_ps(0x1p120f));
}
static inline __attribute__((always_inline)) void fp8_row(const int R, const uint8_t *wrow, const float *srow,
        int bi, int K, const float *x, long ldx, float *out, long ldo) {
    __m512 acc[4];
    __m256 acc8[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); acc8[r] = _mm256_setzero_ps(); }
    for (int k0 = 0, t = 0; k0 < K; k0 += bi, t++) {
        int k1 = k0 + bi < K ? k0 + bi : K, k = k0;
        __m512 sv = _mm512_set1_ps(srow[t]);
        for (; k + 16 <= k1; k += 16) {
            if (!(k & 63)) PF(wrow + k);
            __m512 w = _mm512_mul_ps(fp8x16(wrow + k), sv);
            for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * ldx + k), acc[r]);
        }
        if (k < k1) {     /* tiles are multiples of 8 */
            __m256 w = _mm256_mul_ps(fp8x8(wrow + k), _mm512_castps512_ps256(sv));
            for (int r = 0; r < R; r++) acc8[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * ldx + k), acc8[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = _mm512_reduce_add_ps(acc[r]) + hsum(acc8[r]);
}
#else

static inline __attribute__((always_inline)) void nib_row(const int R, const uint8_t *wrow, const void *srow,
        int sfmt, int group, int mx, int K, __m128i lut, const float *x, long ldx, float *out, long ldo) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int per = group / 32, nc = K / 32;
    for (int c = 0; c < nc; c++) {
        float s = mx ? E8M0[((const uint8_t *)srow)[c]] : scale_at(srow, sfmt, per == 1 ? c : c / per);
        __m256 sv = _mm256_set1_ps(s), w[4];
        if (!(c & 3)) PF(wrow + 16 * c);
        nib32(wrow + 16 * c, lut, w);
        for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(w[j], sv);        /* the exact dequantized value */
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + 32 * c;
            acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
            acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

static inline __attribute__((always_inline)) void fp8_row(const int R, const uint8_t *wrow, const float *srow,
        int bi, int K, const float *x, long ldx, float *out, long ldo) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int k0 = 0, t = 0; k0 < K; k0 += bi, t++) {
        __m256 sv = _mm256_set1_ps(srow[t]);
        int k1 = k0 + bi < K ? k0 + bi : K;
        for (int k = k0; k < k1; k += 8) {
            if (!(k & 63)) PF(wrow + k);
            __m256 w = _mm256_mul_ps(fp8x8(wrow + k), sv);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * ldx + k), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(acc[r]);
}
#endif

/* ---- 8-bit activations (q8) for the nibble formats ------------------------------------------------
 * x [K] -> per 32 values one scale d = amax / 127 and q = round(x / d), stored with the even elements
 * first and the odd ones after (the order a byte's low and high nibbles give), so a 32-code chunk
 * multiplies without shuffles: maddubs on |w| and sign(q, w), as llama.cpp's Q4_0 x Q8_0 dot. */
#if TM_VNNI
/* VNNI layout: chunks in quads. A quad's 128 code bytes are [c0..c3 evens (64) | c0..c3 odds (64)]: 64
 * nibble bytes of four chunks give the evens as their low nibbles and the odds as their high ones, each
 * in one vector whose int32 lane i sums bytes 4i..4i+3, so lanes 0-3 hold c0, 4-7 c1, 8-11 c2, 12-15 c3
 * in both products. The quad's scale vector (16 floats) repeats d0..d3 four times each in that pattern.
 * The weights enter vpdpbusd unsigned (int4: the stored q, value q - 8; mxfp4: twice E2M1 + 12), so a
 * chunk's dot is off by bias x sum(its q8 codes): the correction vector (16 int32) holds -bias x sum
 * in lanes 0, 4, 8 and 12 and seeds the accumulator. Chunks after the last whole quad (up to three):
 * [evens | odds] each, with an 8-lane correction and the scale at word 8 of a 16-word block. */
static void q8_quantize(const float *x, int K, int8_t *q, float *d, int bias, int nat) {
    int32_t *e = (int32_t *)d;
    const int nc = K / 32, nquad = nc / 4, npair = nc / 2;
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int c = 0; c < nc; c++) {
        __m512 a0 = _mm512_loadu_ps(x + 32 * c), a1 = _mm512_loadu_ps(x + 32 * c + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
        /* round to nearest even, as lrintf in the AVX2 build */
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(id)));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(id)));
        __m128i be = _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, ev, q1));
        __m128i bo = _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, od, q1));
        const int32_t corr = -bias * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        if (nat) {        /* int8 weights: chunks in natural order, in pairs (lanes 0-7 c0, 8-15 c1) */
            _mm_storeu_si128((__m128i *)(q + 32 * c), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + 32 * c + 16), _mm512_cvtepi32_epi8(q1));
            int32_t *t = e + 32 * (c / 2);
            if (c < 2 * npair) {
                const int h = c % 2;
                if (h == 0) memset(t + 16, 0, 16 * sizeof(int32_t));
                for (int j = 0; j < 8; j++) ((float *)t)[8 * h + j] = dd;
                t[16 + 8 * h] = corr;
            } else {
                memset(t, 0, 16 * sizeof(int32_t));
                t[0] = corr;
                ((float *)t)[8] = dd;
            }
            continue;
        }
        if (c < 4 * nquad) {
            const int g = c / 4, h = c % 4;
            _mm_storeu_si128((__m128i *)(q + 128 * g + 16 * h), be);
            _mm_storeu_si128((__m128i *)(q + 128 * g + 64 + 16 * h), bo);
            float *dxv = (float *)(e + 32 * g);
            int32_t *cv = e + 32 * g + 16;
            if (h == 0) memset(cv, 0, 16 * sizeof(int32_t));
            for (int j = 0; j < 4; j++) dxv[4 * h + j] = dd;
            cv[4 * h] = corr;
        } else {
            const int j = c - 4 * nquad;
            _mm_storeu_si128((__m128i *)(q + 128 * nquad + 32 * j), be);
            _mm_storeu_si128((__m128i *)(q + 128 * nquad + 32 * j + 16), bo);
            int32_t *t = e + 32 * nquad + 16 * j;
            memset(t, 0, 16 * sizeof(int32_t));
            t[0] = corr;
            ((float *)t)[8] = dd;
        }
    }
}

static void row_scales(const void *srow, int sfmt, int group, int mx, int nc, float *sw) {
    int c = 0;
    if (mx) {
        /* E8M0[s] = 2^(s - 128) built from bits (a gather costs more): exponent s - 1 for s >= 2, the
         * subnormals 2^-127 / 2^-128 for s = 1 / 0, NaN for 255 */
        const __m512i one = _mm512_set1_epi32(1);
        for (; c + 16 <= nc; c += 16) {
            __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)srow + c)));
            __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23);
            bits = _mm512_mask_srlv_epi32(bits, _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)),
                                          _mm512_set1_epi32(0x00400000), _mm512_sub_epi32(one, e));
            bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                                         _mm512_set1_epi32(0x7FC00000));
            _mm512_storeu_ps(sw + c, _mm512_castsi512_ps(bits));
        }
        for (; c < nc; c++) sw[c] = E8M0[((const uint8_t *)srow)[c]];
        return;
    }
    const int per = group / 32;
    if (per == 1 && sfmt == S_BF16)
        for (; c + 16 <= nc; c += 16)
            _mm512_storeu_ps(sw + c, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)srow + c))), 16)));
    if (per == 1 && sfmt == S_F16)
        for (; c + 16 <= nc; c += 16)
            _mm512_storeu_ps(sw + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)srow + c))));
    for (; c < nc; c++) sw[c] = scale_at(srow, sfmt, per == 1 ? c : c / per);
}

/* RW weight rows (1 or 2: two independent chains, the activation loads shared) of K codes, scales
 * sw[RW][lds], against R q8 rows: four chunks per pair of vpdpbusd. MX: mxfp4 codes through the table. */
static inline __attribute__((always_inline)) void nib_rows_q8v(const int RW, const int R, const int MX,
        const uint8_t *wrow, long ldw, const float *sw, long lds, int K, __m512i lut, const int8_t *xq, const float *xd,
        long ldq, long ldd, float *out, long ldo) {
    const int nc = K / 32, nquad = nc / 4;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i sidx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc[2][4];
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int g = 0; g < nquad; g++) {
        __m512i lo[2], hi[2];
        __m512 swv[2];
        for (int i = 0; i < RW; i++) {
            PF(wrow + i * ldw + 64 * g);
            __m512i b = _mm512_loadu_si512((const void *)(wrow + i * ldw + 64 * g));
            lo[i] = _mm512_and_si512(b, m4);
            hi[i] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
            if (MX) { lo[i] = _mm512_shuffle_epi8(lut, lo[i]); hi[i] = _mm512_shuffle_epi8(lut, hi[i]); }
            swv[i] = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_loadu_ps(sw + i * lds + 4 * g)));
        }
        for (int r = 0; r < R; r++) {
            const float *e = xd + r * ldd + 32 * g;
            const int8_t *xr = xq + r * ldq + 128 * g;
            const __m512i cv = _mm512_loadu_si512((const void *)(e + 16));
            const __m512i xe = _mm512_loadu_si512((const void *)xr), xo = _mm512_loadu_si512((const void *)(xr + 64));
            const __m512 dxv = _mm512_loadu_ps(e);
            for (int i = 0; i < RW; i++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(cv, lo[i], xe), hi[i], xo);
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(swv[i], dxv), acc[i][r]);
            }
        }
    }
    float tail[2][4] = {{0.0f}};
    const __m128i m4s = _mm_set1_epi8(0x0F);
    for (int c = 4 * nquad, j = 0; c < nc; c++, j++) {     /* up to three chunks after the last quad */
        for (int i = 0; i < RW; i++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(wrow + i * ldw + 16 * c));
            __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4s), _mm_and_si128(b, m4s));
            if (MX) w = _mm256_shuffle_epi8(_mm512_castsi512_si256(lut), w);
            for (int r = 0; r < R; r++) {
                const float *t = xd + r * ldd + 32 * nquad + 16 * j;
                __m256i dot = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)t), w,
                                                  _mm256_loadu_si256((const __m256i *)(xq + r * ldq + 128 * nquad + 32 * j)));
                tail[i][r] += hsum(_mm256_cvtepi32_ps(dot)) * (sw[i * lds + c] * t[8]);
            }
        }
    }
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < R; r++) out[r * ldo + i] = _mm512_reduce_add_ps(acc[i][r]) + tail[i][r];
}

/* int8 weight rows (natural order) against q8 rows: two chunks per vpdpbusd, the codes made unsigned
 * by flipping their sign bit (q + 128; the correction's bias is 128). */
static inline AI void i8_rows_q8v(const int RW, const int R, const int8_t *wrow, long ldw, const float *sw, long lds, int K,
        const int8_t *xq, const float *xd, long ldq, long ldd, float *out, long ldo) {
    const int nc = K / 32, npair = nc / 2;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i sidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[2][4];
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int p = 0; p < npair; p++) {
        __m512i w[2];
        __m512 swv[2];
        for (int i = 0; i < RW; i++) {
            PF(wrow + i * ldw + 64 * p);
            w[i] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(wrow + i * ldw + 64 * p)), flip);
            /* the pair's two scales as one 64-bit lane (movq: no alignment asked of sw) */
            swv[i] = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_castsi128_ps(
                _mm_loadl_epi64((const __m128i *)(sw + i * lds + 2 * p)))));
        }
        for (int r = 0; r < R; r++) {
            const float *e = xd + r * ldd + 32 * p;
            const __m512i cv = _mm512_loadu_si512((const void *)(e + 16));
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + r * ldq + 64 * p));
            const __m512 dxv = _mm512_loadu_ps(e);
            for (int i = 0; i < RW; i++)
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv, w[i], xv)),
                                            _mm512_mul_ps(swv[i], dxv), acc[i][r]);
        }
    }
    float tail[2][4] = {{0.0f}};
    if (nc & 1)
        for (int i = 0; i < RW; i++) {
            __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wrow + i * ldw + 64 * npair)),
                                         _mm256_set1_epi8((char)0x80));
            for (int r = 0; r < R; r++) {
                const float *t = xd + r * ldd + 32 * npair;
                __m256i dot = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)t), w,
                                                  _mm256_loadu_si256((const __m256i *)(xq + r * ldq + 64 * npair)));
                tail[i][r] = hsum(_mm256_cvtepi32_ps(dot)) * (sw[i * lds + nc - 1] * t[8]);
            }
        }
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < R; r++) out[r * ldo + i] = _mm512_reduce_add_ps(acc[i][r]) + tail[i][r];
}

/* quant_proj's q8 path on VNNI: output rows in pairs, token rows in groups of up to 4. sw: this thread's
 * scratch for two weight rows' scales, [2, lds] (lds >= K / 32), from the caller's heap (a stack array
 * sized for the largest K was 32 KB in every worker). */
static void quant_proj_q8v(const tm_moe_t *a, const void *W, const void *S, int K, long o0, long o1,
                           const int8_t *xq, const float *xd, long nrows, float *y, long ldy, float *sw, long lds) {
    const int i8 = a->fmt == F_INT8;
    const long ldq = a->H_in > a->I ? a->H_in : a->I, ldd = tm_q8_ldd(ldq), ldw = i8 ? K : K / 2;
    const int mx = a->fmt == F_MXFP4, group = mx ? 32 : a->group;
    const long ng = K / group, ssz = mx ? 1 : (a->sfmt == S_F32 ? 4 : 2);
    /* unsigned codes for vpdpbusd: mxfp4 twice E2M1 + 12 (int4's stored q needs no table) */
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    for (long o = o0; o < o1; o += 2) {
        const int RW = o + 1 < o1 ? 2 : 1;
        for (int i = 0; i < RW; i++)
            row_scales((const char *)S + (o + i) * ng * ssz, a->sfmt, group, mx, K / 32, sw + i * lds);
        const uint8_t *wrow = (const uint8_t *)W + o * ldw;
        for (long r = 0; r < nrows;) {
            const long R = nrows - r >= 4 ? 4 : nrows - r;
            const int8_t *qr = xq + r * ldq;
            const float *dr = xd + r * ldd;
            float *yr = y + r * ldy + o;
#define Q8V_CALL(rw, rr) do { if (i8) i8_rows_q8v(rw, rr, (const int8_t *)wrow, ldw, sw, lds, K, qr, dr, ldq, ldd, yr, ldy); \
                              else if (mx) nib_rows_q8v(rw, rr, 1, wrow, ldw, sw, lds, K, lut, qr, dr, ldq, ldd, yr, ldy); \
                              else nib_rows_q8v(rw, rr, 0, wrow, ldw, sw, lds, K, lut, qr, dr, ldq, ldd, yr, ldy); } while (0)
            if (RW == 2) {
                switch (R) { case 4: Q8V_CALL(2, 4); break; case 3: Q8V_CALL(2, 3); break;
                             case 2: Q8V_CALL(2, 2); break; default: Q8V_CALL(2, 1); }
            } else {
                switch (R) { case 4: Q8V_CALL(1, 4); break; case 3: Q8V_CALL(1, 3); break;
                             case 2: Q8V_CALL(1, 2); break; default: Q8V_CALL(1, 1); }
            }
#undef Q8V_CALL
            r += R;
        }
    }
}
#else
/* bias 8 (int4 codes): after the K / 32 scales, per block 8 int32 - lane 0 the block's code sum times 8,
 * lanes 1-7 zero - which the int4 dot subtracts: sum (q - 8) x = sum q x - 8 sum x, so the codes go into
 * maddubs unsigned as they lie (no table, no sign moves) and one subtraction per block corrects them. */
static void q8_quantize(const float *x, int K, int8_t *q, float *d, int bias, int nat) {
    int32_t *corr = (int32_t *)(d + K / 32);
    for (int c = 0; c < K / 32; c++) {
        const float *v = x + 32 * c;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
        d[c] = dd;
        if (nat) {        /* int8 weights: natural order */
            for (int j = 0; j < 32; j++) q[32 * c + j] = (int8_t)lrintf(v[j] * id);
            continue;
        }
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            q[32 * c + j] = (int8_t)lrintf(v[2 * j] * id);
            q[32 * c + 16 + j] = (int8_t)lrintf(v[2 * j + 1] * id);
            sum += q[32 * c + j] + q[32 * c + 16 + j];
        }
        if (bias == 8) {
            memset(corr + 8 * c, 0, 8 * sizeof(int32_t));
            corr[8 * c] = 8 * sum;
        }
    }
}

/* sc[i] = the weight scale of block c0 + i, i < n (int4: one per ``per`` blocks; mxfp4: E8M0 bytes) */
static inline AI void nib_scales(const void *srow, int sfmt, int per, int mx, int c0, int n, float *sc) {
    if (mx)
        for (int i = 0; i < n; i++) sc[i] = E8M0[((const uint8_t *)srow)[c0 + i]];
    else if (per == 1 && sfmt == S_BF16)
        for (int i = 0; i < n; i++) sc[i] = bf16_to_f32(((const uint16_t *)srow)[c0 + i]);
    else
        for (int i = 0; i < n; i++) sc[i] = scale_at(srow, sfmt, (c0 + i) / per);
}

/* sc[i] = the int4 weight scale of block c0 + i times the activation scale xd[c0 + i], i < n: eight at a time
 * for one scale per block (group 32) in any scale dtype, else one by one */
static inline AI void nib_scales_x(const void *srow, int sfmt, int per, int c0, int n, const float *xd, float *sc) {
    int i = 0;
    if (per == 1) {
        if (sfmt == S_BF16)
            for (; i + 8 <= n; i += 8) {
                const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)srow + c0 + i)));
                _mm256_storeu_ps(sc + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
                                                       _mm256_loadu_ps(xd + c0 + i)));
            }
        else if (sfmt == S_F16)
            for (; i + 8 <= n; i += 8)
                _mm256_storeu_ps(sc + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)srow + c0 + i))),
                                                       _mm256_loadu_ps(xd + c0 + i)));
        else
            for (; i + 8 <= n; i += 8)
                _mm256_storeu_ps(sc + i, _mm256_mul_ps(_mm256_loadu_ps((const float *)srow + c0 + i), _mm256_loadu_ps(xd + c0 + i)));
    }
    for (; i < n; i++) sc[i] = scale_at(srow, sfmt, (c0 + i) / per) * xd[c0 + i];
}

/* One 32-weight block c of a 4-bit row against R activation rows, into acc[0..R) (nib_row_q8). */
static inline AI void nib_blk_q8(const int R, const int mx, const uint8_t *wrow, int c, int nc, float sw,
                                 __m256i lut2, const int8_t *xq, const float *xd, long ldq, long ldd, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
    if (!(c & 3)) PF(wrow + 16 * c);
    const __m128i b = _mm_loadu_si128((const __m128i *)(wrow + 16 * c));
    /* low nibbles in the low lane, high in the high lane: evens | odds, as x is stored */
    const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), m4);
    if (!mx) {      /* int4: the codes unsigned, less 8 x the activations' code sum (q8_quantize) */
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * ldq + 32 * c));
            const __m256i cv = _mm256_loadu_si256((const __m256i *)((const int32_t *)(xd + r * ldd + nc) + 8 * c));
            const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), ones), cv);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sw * xd[r * ldd + c]), acc[r]);
        }
        return;
    }
    const __m256i w = _mm256_shuffle_epi8(lut2, u);
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; r++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * ldq + 32 * c));
        const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sw * xd[r * ldd + c]), acc[r]);
    }
}

/* The AVX2 build's 4-bit x q8 row (int4 / mxfp4 weights against 8-bit activations, llama.cpp's Q4_0 x Q8_0
 * dot), for R activation rows: per 32 weights one 16-byte load; int4 codes go into maddubs unsigned and the
 * block's int32 sums are corrected by 8 x the activation codes' sum (q8_quantize wrote it), mxfp4 codes are
 * decoded by one 256-bit shuffle and multiplied as |w| x sign(x, w); the sums are scaled by weight scale x
 * activation scale. The weight scales of up to 64 blocks are decoded into sc first (no format test per block);
 * with one or two rows, blocks alternate between two accumulators per row (kept in registers: their indices are
 * constants). */
static inline __attribute__((always_inline)) void nib_row_q8(const int R, const uint8_t *wrow, const void *srow,
        int sfmt, int group, int mx, int K, __m128i lut, const int8_t *xq, const float *xd, long ldq, long ldd,
        float *out, long ldo) {
    const __m256i lut2 = _mm256_broadcastsi128_si256(lut);
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    const int per = group / 32, nc = K / 32;
    float sc[64];
    for (int c0 = 0; c0 < nc; c0 += 64) {
        const int n = nc - c0 < 64 ? nc - c0 : 64;
        nib_scales(srow, sfmt, per, mx, c0, n, sc);
        int i = 0;
        for (; i + 2 <= n; i += 2) {    /* three or four rows are chains enough: one accumulator each (registers) */
            nib_blk_q8(R, mx, wrow, c0 + i, nc, sc[i], lut2, xq, xd, ldq, ldd, acc0);
            nib_blk_q8(R, mx, wrow, c0 + i + 1, nc, sc[i + 1], lut2, xq, xd, ldq, ldd, R >= 3 ? acc0 : acc1);
        }
        if (i < n) nib_blk_q8(R, mx, wrow, c0 + i, nc, sc[i], lut2, xq, xd, ldq, ldd, acc0);
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

/* Four output rows against one activation row (a decode token), the same dot as nib_row_q8: the activation
 * block and its scale are loaded once for the four, and four accumulators run independent fmadd chains.
 * wrow / srow: the first row's codes and scales, ldw / lds: bytes from one row to the next; out: [4]. */
static inline AI void nib_4rows_q8(const uint8_t *wrow, long ldw, const uint8_t *srow, long lds, int sfmt, int group,
                                   int mx, int K, __m128i lut, const int8_t *xq, const float *xd, float *out) {
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F), lut2 = _mm256_broadcastsi128_si256(lut);
    __m256 acc[4];
    for (int o = 0; o < 4; o++) acc[o] = _mm256_setzero_ps();
    const int per = group / 32, nc = K / 32;
    float sc[4][64];
    const int32_t *corr = (const int32_t *)(xd + nc);
    for (int c0 = 0; c0 < nc; c0 += 64) {
        const int n = nc - c0 < 64 ? nc - c0 : 64;
        if (!mx) {
            /* int4, two rows to a register: row 2p's 16 code bytes in the low lane, row 2p + 1's in the high, so
             * one and / shift splits both rows' nibbles; the block's activation evens and odds each broadcast to
             * both lanes (loaded once for the four rows); the codes go into maddubs unsigned as they lie and the
             * two products are summed in 16 bits (|.| <= 4 x 15 x 128 < 2^15), less 8 x the activation block's
             * code sum (q8_quantize) in each lane's first int; weight scale x activation scale taken once per
             * block and row before the dots. acc[p]: rows 2p (low lane) and 2p + 1 (high). */
            for (int o = 0; o < 4; o++) nib_scales_x(srow + o * lds, sfmt, per, c0, n, xd, sc[o]);
            for (int i = 0; i < n; i++) {
                const int c = c0 + i;
                const __m256i xe = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq + 32 * c)));
                const __m256i xo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq + 32 * c + 16)));
                const __m256i cv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(corr + 8 * c)));
                if (!(c & 3))           /* one test for the four rows' prefetches */
                    for (int o = 0; o < 4; o++) PF(wrow + o * ldw + 16 * c);
                for (int q = 0; q < 2; q++) {
                    const uint8_t *p = wrow + 2 * q * ldw + 16 * c;
                    const __m256i b = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + ldw)),
                                                       _mm_loadu_si128((const __m128i *)p));
                    const __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
                    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
                    const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), cv);
                    const __m256 sw = _mm256_set_m128(_mm_set1_ps(sc[2 * q + 1][i]), _mm_set1_ps(sc[2 * q][i]));
                    acc[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sw, acc[q]);
                }
            }
            continue;
        }
        for (int o = 0; o < 4; o++) nib_scales(srow + o * lds, sfmt, per, mx, c0, n, sc[o]);
        for (int i = 0; i < n; i++) {
            const int c = c0 + i;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * c));
            const float xs = xd[c];
            for (int o = 0; o < 4; o++) {
                const uint8_t *p = wrow + o * ldw + 16 * c;
                if (!(c & 3)) PF(p);
                const __m128i b = _mm_loadu_si128((const __m128i *)p);
                const __m256i w = _mm256_shuffle_epi8(lut2, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), m4));
                const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)),
                                                    ones);
                acc[o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sc[o][i] * xs), acc[o]);
            }
        }
    }
    if (!mx)
        for (int q = 0; q < 2; q++) {       /* each lane's four sums: rows 2q (low) and 2q + 1 (high) */
            __m128 a = _mm256_castps256_ps128(acc[q]), b = _mm256_extractf128_ps(acc[q], 1);
            a = _mm_add_ps(a, _mm_movehl_ps(a, a));
            b = _mm_add_ps(b, _mm_movehl_ps(b, b));
            out[2 * q] = _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
            out[2 * q + 1] = _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
        }
    else
        for (int o = 0; o < 4; o++) out[o] = hsum(acc[o]);
}
#endif

/* ---- int8 output-major rows (format int8): exact, and (AVX2) against q8 activations ------------- */
#if TM_AVX512
static inline AI void i8_row(const int R, const int8_t *wrow, const void *srow, int sfmt, int per, int K,
                             const float *x, long ldx, float *out, long ldo) {
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int c = 0; c < K / 32; c++) {
        __m512 sv = _mm512_set1_ps(scale_at(srow, sfmt, per == 1 ? c : c / per));
        if (!(c & 1)) PF(wrow + 32 * c);
        __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wrow + 32 * c)))), sv);
        __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wrow + 32 * c + 16)))), sv);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + 32 * c), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * ldx + 32 * c + 16), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#else
static inline AI void i8_row(const int R, const int8_t *wrow, const void *srow, int sfmt, int per, int K,
                             const float *x, long ldx, float *out, long ldo) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int c = 0; c < K / 32; c++) {
        __m256 sv = _mm256_set1_ps(scale_at(srow, sfmt, per == 1 ? c : c / per));
        if (!(c & 1)) PF(wrow + 32 * c);
        for (int j = 0; j < 32; j += 16) {
            __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wrow + 32 * c + j)))), sv);
            __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wrow + 32 * c + j + 8)))), sv);
            for (int r = 0; r < R; r++) {
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + 32 * c + j), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + 32 * c + j + 8), acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#endif

#if !TM_VNNI
/* int8 x q8 (natural order), maddubs on |w| and sign(q, w) as nib_row_q8 */
static inline AI void i8_row_q8(const int R, const int8_t *wrow, const void *srow, int sfmt, int per, int K,
        const int8_t *xq, const float *xd, long ldq, long ldd, float *out, long ldo) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int c = 0; c < K / 32; c++) {
        const float sw = scale_at(srow, sfmt, per == 1 ? c : c / per);
        if (!(c & 1)) PF(wrow + 32 * c);
        __m256i w = _mm256_loadu_si256((const __m256i *)(wrow + 32 * c));
        __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * ldq + 32 * c));
            __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sw * xd[r * ldd + c]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(acc[r]);
}
#endif

/* y[r, o] = x[r] . w_o for o in [o0, o1) of one quantized matrix W (codes) / S (scales) [N, K]; with xq
 * the q8 rows of x instead (mxfp4 / int4 / int8). sw / lds: the VNNI q8 path's scale scratch (see
 * quant_proj_q8v; unused elsewhere). */
static void quant_proj(const tm_moe_t *a, const void *W, const void *S, int N, int K, long o0, long o1,
                       const float *x, long ldx, const int8_t *xq, const float *xd, long nrows, float *y, long ldy,
                       float *sw, long lds) {
    const long ldq = a->H_in > a->I ? a->H_in : a->I, ldd = tm_q8_ldd(ldq);
    const int mx = a->fmt == F_MXFP4;
    const __m128i lut = mx ? _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
                           : _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const int group = mx ? 32 : a->group, per = group / 32;
    const long nbi = (K + a->bi - 1) / (a->bi > 0 ? a->bi : 1);
    const long ng = K / group, ssz = mx ? 1 : (a->sfmt == S_F32 ? 4 : 2);
#if TM_VNNI
    if (xq && a->fmt != F_FP8) {
        quant_proj_q8v(a, W, S, K, o0, o1, xq, xd, nrows, y, ldy, sw, lds);
        return;
    }
#endif
    (void)sw; (void)lds;
#if !TM_VNNI
    if (xq && nrows == 1 && (a->fmt == F_INT4 || a->fmt == F_MXFP4))   /* a decode token: four output rows a pass */
        for (; o0 + 4 <= o1; o0 += 4)
            nib_4rows_q8((const uint8_t *)W + o0 * (long)(K / 2), K / 2, (const uint8_t *)S + o0 * ng * ssz, ng * ssz,
                         a->sfmt, group, mx, K, lut, xq, xd, y + o0);
#endif
    for (long o = o0; o < o1; o++) {
        const void *srow = (const char *)S + o * ng * ssz;
        for (long r = 0; r < nrows;) {
            const long R = nrows - r >= 4 ? 4 : nrows - r;
            const float *xr = x + r * ldx;
            float *yr = y + r * ldy + o;
            const int8_t *qr = xq ? xq + r * ldq : 0;
            const float *dr = xq ? xd + r * ldd : 0;
            if (a->fmt == F_FP8) {
                const uint8_t *wrow = (const uint8_t *)W + o * (long)K;
                const float *frow = (const float *)S + (o / a->bo) * nbi;
#define CALL(n) fp8_row(n, wrow, frow, a->bi, K, xr, ldx, yr, ldy)
                BY_R(R, CALL)
#undef CALL
            } else if (a->fmt == F_INT8) {
                const int8_t *wrow = (const int8_t *)W + o * (long)K;
#if !TM_VNNI
                if (xq) {
#define CALL(n) i8_row_q8(n, wrow, srow, a->sfmt, per, K, qr, dr, ldq, ldd, yr, ldy)
                    BY_R(R, CALL)
#undef CALL
                } else
#endif
                {
#define CALL(n) i8_row(n, wrow, srow, a->sfmt, per, K, xr, ldx, yr, ldy)
                    BY_R(R, CALL)
#undef CALL
                }
            } else {
                const uint8_t *wrow = (const uint8_t *)W + o * (long)(K / 2);
#if !TM_VNNI
                if (xq) {
#define CALL(n) nib_row_q8(n, wrow, srow, a->sfmt, group, mx, K, lut, qr, dr, ldq, ldd, yr, ldy)
                    BY_R(R, CALL)
#undef CALL
                } else
#endif
                {
#define CALL(n) nib_row(n, wrow, srow, a->sfmt, group, mx, K, lut, xr, ldx, yr, ldy)
                    BY_R(R, CALL)
#undef CALL
                }
            }
            r += R;
        }
    }
    (void)N;
}

/* ---- SwiGLU ------------------------------------------------------------------------------------ */
/* exp by Cephes' expf: range reduction by ln 2 and a degree-5 polynomial (about 1 ulp). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
static inline float sigmoid1(float z) { return 1.0f / (1.0f + expf(-z)); }

/* h[r, 0:I] <- act(h[r, 0:I] + bg, h[r, I:2I] + bu) */
static void swiglu_row(const tm_moe_t *a, float *h, const void *bias) {
    const int I = a->I;
    float *g = h, *u = h + I;
    if (bias)
        for (int j = 0; j < I; j++) { g[j] += load1(a->bias_fmt, bias, j); u[j] += load1(a->bias_fmt, bias, I + j); }
    int j = 0;
    if (a->act == 0) {
        for (; j + 8 <= I; j += 8) {
            __m256 gv = _mm256_loadu_ps(g + j);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(g + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
        }
        for (; j < I; j++) g[j] = g[j] * sigmoid1(g[j]) * u[j];
    } else if (a->act == 2) {     /* DeepSeek-V4 */
        for (; j < I; j++) {
            float gv = g[j] < a->limit ? g[j] : a->limit;
            float uv = u[j] < -a->limit ? -a->limit : (u[j] > a->limit ? a->limit : u[j]);
            g[j] = gv * sigmoid1(gv) * uv;
        }
    } else {
        for (; j < I; j++) {
            float gv = g[j] < a->limit ? g[j] : a->limit;
            float uv = u[j] < -a->limit ? -a->limit : (u[j] > a->limit ? a->limit : u[j]);
            g[j] = (uv + 1.0f) * (gv * sigmoid1(gv * a->alpha));
        }
    }
}

/* ---- the grouped call ---------------------------------------------------------------------------- */
#define BLK_QUANT 16      /* output rows per task (quantized) */

typedef struct {
    const tm_moe_t *a;
    int dense, np1, q8, nat, bias;
    long w1, blk1, blk3, nb1, nb3, t1, t3, ldq, ldd;
    float *sw;            /* VNNI q8: per thread [2, lds] scale scratch (NULL otherwise) */
    long lds;
} moe_job_t;

static void moe_job(void *arg, int ith, int nth, tm_bar *bar) {
    const moe_job_t *J = (const moe_job_t *)arg;
    const tm_moe_t *a = J->a;
    const int dense = J->dense, I = a->I, Hin = a->H_in, Hout = a->H_out, np1 = J->np1, q8 = J->q8, nat = J->nat;
    const int bias = J->bias;
    const long w1 = J->w1, blk1 = J->blk1, blk3 = J->blk3, nb1 = J->nb1, nb3 = J->nb3, ldq = J->ldq, ldd = J->ldd;
    float *sw = J->sw ? J->sw + ith * 2 * J->lds : 0;
    float *xrows = (float *)a->x;      /* the sorted rows: gathered into x first when tok is given */
    int ls = 0;
    if (a->tok) {
        SPLIT(a->n_exp, e0, e1);
        for (long e = e0; e < e1; e++)
            for (long r = a->row0[e]; r < a->row0[e] + a->rows[e]; r++)
                memcpy(xrows + r * Hin, a->xin + a->tok[r] * Hin, Hin * sizeof(float));
        bar_wait(bar, &ls);
    }
    if (q8) {
        SPLIT(a->n_exp, e0, e1);
        for (long e = e0; e < e1; e++)
            for (long r = a->row0[e]; r < a->row0[e] + a->rows[e]; r++)
                q8_quantize(a->x + r * Hin, Hin, a->xq + r * ldq, a->xd + r * ldd, bias, nat);
        bar_wait(bar, &ls);
    }
    {
        SPLIT(J->t1, t0_, t1_);
        for (long t = t0_; t < t1_; t++) {          /* gate and up of every expert */
            long e = t / (np1 * nb1), rem = t % (np1 * nb1), which = rem / nb1, b = rem % nb1;
            long n0 = b * blk1, n1 = n0 + blk1 < w1 ? n0 + blk1 : w1, r0 = a->row0[e], nr = a->rows[e];
            const int64_t *p = a->ptrs + e * P_N;
            const float *x = a->x + r0 * Hin;
            float *h = a->h + r0 * 2 * (long)I;
            if (!nr) continue;
            if (dense)   /* fused [in, 2I]: h gets gate | up as they lie */
                dense_proj(a->fmt, (const void *)(intptr_t)p[P_GATE_W], 2 * (long)I, Hin, n0, n1, x, Hin, nr, h, 2 * (long)I);
            else
                quant_proj(a, (const void *)(intptr_t)p[which ? P_UP_W : P_GATE_W],
                           (const void *)(intptr_t)p[which ? P_UP_S : P_GATE_S], I, Hin, n0, n1, x, Hin,
                           q8 ? a->xq + r0 * ldq : 0, q8 ? a->xd + r0 * ldd : 0, nr, h + which * I, 2 * (long)I,
                           sw, J->lds);
        }
        bar_wait(bar, &ls);
    }
    {
        SPLIT(a->n_exp, e0, e1);
        for (long e = e0; e < e1; e++)               /* the activation, in place over the gate half */
            for (long r = 0; r < a->rows[e]; r++) {
                long row = a->row0[e] + r;
                swiglu_row(a, a->h + row * 2 * (long)I,
                           a->bias_fmt >= 0 ? (const void *)(intptr_t)a->ptrs[e * P_N + P_GU_BIAS] : 0);
                if (q8) q8_quantize(a->h + row * 2 * (long)I, I, a->xq + row * ldq, a->xd + row * ldd, bias, nat);
            }
        bar_wait(bar, &ls);
    }
    {
        SPLIT(J->t3, t0_, t1_);
        for (long t = t0_; t < t1_; t++) {          /* down */
            long e = t / nb3, b = t % nb3;
            long n0 = b * blk3, n1 = n0 + blk3 < Hout ? n0 + blk3 : Hout, r0 = a->row0[e], nr = a->rows[e];
            const int64_t *p = a->ptrs + e * P_N;
            const float *h = a->h + r0 * 2 * (long)I;
            float *y = a->y + r0 * Hout;
            if (!nr) continue;
            if (dense)
                dense_proj(a->fmt, (const void *)(intptr_t)p[P_DOWN_W], Hout, I, n0, n1, h, 2 * (long)I, nr, y, Hout);
            else
                quant_proj(a, (const void *)(intptr_t)p[P_DOWN_W], (const void *)(intptr_t)p[P_DOWN_S], Hout, I, n0, n1,
                           h, 2 * (long)I, q8 ? a->xq + r0 * ldq : 0, q8 ? a->xd + r0 * ldd : 0, nr, y, Hout, sw, J->lds);
            if (a->bias_fmt >= 0) {
                const void *bd = (const void *)(intptr_t)p[P_DOWN_BIAS];
                for (long r = 0; r < nr; r++)
                    for (long c = n0; c < n1; c++) y[r * Hout + c] += load1(a->bias_fmt, bd, c);
            }
        }
        bar_wait(bar, &ls);
    }
    if (a->out) {
        SPLIT(a->T, t0_, t1_);
        for (long t = t0_; t < t1_; t++) {
            float *o = a->out + t * Hout;
            for (long j = 0; j < a->k; j++) {
                const float *yr = a->y + a->back[t * a->k + j] * Hout;
                const float wt = a->wts[t * a->k + j];
                if (j == 0 && !a->out_add) for (long c = 0; c < Hout; c++) o[c] = wt * yr[c];
                else for (long c = 0; c < Hout; c++) o[c] += wt * yr[c];
            }
        }
    }
}

/* Every index the call follows, against the buffers the caller says it has (tm_moe_t's capacities): the
 * experts' rows, their weights, the gathered tokens and the combine's rows. O(experts + rows + T k). */
static int moe_check(const tm_moe_t *a, int dense) {
    if (a->fmt < F_F32 || a->fmt > F_INT8 || a->sfmt < S_F32 || a->sfmt > S_F16 || a->bias_fmt < -1
        || a->bias_fmt > F_F16 || a->act < 0 || a->act > 2 || a->H_in <= 0 || a->I <= 0 || a->H_out <= 0
        || a->n_exp < 0 || a->n_rows < 0 || a->scratch_rows < 0)
        return TM_E_ARG;
    if (!dense && (a->H_in % 32 || a->I % 32)) return TM_E_LAYOUT;
    if ((a->fmt == F_INT4 || a->fmt == F_INT8) && (a->group <= 0 || a->group % 32)) return TM_E_GROUP;
    if (a->fmt == F_FP8 && (a->bo <= 0 || a->bi <= 0 || a->bi % 8 || a->H_in % 8 || a->I % 8)) return TM_E_FP8;
    if (!a->n_exp) return 0;
    const int q8 = a->q8 && (a->fmt == F_MXFP4 || a->fmt == F_INT4 || a->fmt == F_INT8);
    if (!a->row0 || !a->rows || !a->ptrs || !a->x || !a->y || !a->h || (q8 && (!a->xq || !a->xd))) return TM_E_NULL;
    int64_t extent = 0;   /* rows the call computes: [0, extent) covers every expert's */
    for (long e = 0; e < a->n_exp; e++) {
        const int64_t r0 = a->row0[e], nr = a->rows[e];
        if (!in_range(r0, nr, a->n_rows) || !in_range(r0, nr, a->scratch_rows)) return TM_E_ROWS;
        if (!nr) continue;
        extent = r0 + nr > extent ? r0 + nr : extent;
        const int64_t *p = a->ptrs + e * P_N;
        if (!p[P_GATE_W] || !p[P_DOWN_W] || (!dense && (!p[P_GATE_S] || !p[P_UP_W] || !p[P_UP_S] || !p[P_DOWN_S]))
            || (a->bias_fmt >= 0 && (!p[P_GU_BIAS] || !p[P_DOWN_BIAS])))
            return TM_E_NULL;
        if (a->tok) {
            if (!a->xin) return TM_E_NULL;
            for (int64_t r = r0; r < r0 + nr; r++)
                if (a->tok[r] < 0 || a->tok[r] >= a->n_in) return TM_E_TOK;
        }
    }
    if (a->out) {
        if (!a->back || !a->wts) return TM_E_NULL;
        if (a->T < 0 || a->k <= 0 || a->T > INT64_MAX / a->k) return TM_E_ARG;
        for (int64_t i = 0; i < a->T * a->k; i++)
            if (a->back[i] < 0 || a->back[i] >= extent) return TM_E_BACK;
    }
    return 0;
}

int tm_moe(const tm_moe_t *a) {
    init_tables();
    if (!a) return TM_E_NULL;
    const int dense = a->fmt <= F_F16, I = a->I, Hin = a->H_in, Hout = a->H_out;
    const int rc = moe_check(a, dense);
    if (rc) return rc;
    if (!a->n_exp) return 0;
    const int nt = a->nthreads > 0 ? (a->nthreads < TM_MAX_THREADS ? a->nthreads : TM_MAX_THREADS) : 1;
    /* Tasks. Dense: the fused gate|up [in, 2I] as one projection of width 2I, whole rows of W per task
     * (one sequential stream) unless the experts are too few to keep every thread busy, then column
     * blocks (multiples of 64). Quantized: gate and up apart, BLK_QUANT output rows per task. */
    moe_job_t J;
    J.a = a;
    J.dense = dense;
    J.w1 = dense ? 2L * I : I;
    J.blk1 = J.blk3 = BLK_QUANT;
    J.np1 = dense ? 1 : 2;     /* projections in phase 1: fused, or gate and up */
    if (dense) {
        long split = a->n_exp >= nt ? 1 : (nt + a->n_exp - 1) / a->n_exp;
        J.blk1 = ((J.w1 + split - 1) / split + 63) / 64 * 64;
        J.blk3 = ((Hout + split - 1) / split + 63) / 64 * 64;
    }
    J.nb1 = (J.w1 + J.blk1 - 1) / J.blk1;
    J.nb3 = (Hout + J.blk3 - 1) / J.blk3;
    J.t1 = (long)a->n_exp * J.np1 * J.nb1;
    J.t3 = (long)a->n_exp * J.nb3;
    J.q8 = a->q8 && (a->fmt == F_MXFP4 || a->fmt == F_INT4 || a->fmt == F_INT8);
    J.nat = a->fmt == F_INT8;          /* q8 rows in natural order for int8 weights */
    J.ldq = Hin > I ? Hin : I;
    J.ldd = tm_q8_ldd(J.ldq);
    J.bias = a->fmt == F_MXFP4 ? 12 : (a->fmt == F_INT8 ? 128 : 8);   /* VNNI: the codes' offset (q8_quantize) */
    J.sw = 0;
    J.lds = J.ldq / 32;
#if TM_VNNI
    if (J.q8 && !(J.sw = malloc((size_t)nt * 2 * J.lds * sizeof(float)))) return TM_E_NOMEM;
#endif
    pool_run(moe_job, &J, nt);
    free(J.sw);
    return 0;
}

/* ---- RMSNorm: out[r] = w[r % G] * (x[r] / sqrt(mean(x[r]^2) + eps)), rows of D --------------------- */
int tm_rms_norm(const float *x, int64_t rows, int64_t D, const float *w, int64_t G, float eps, float *out) {
    if (rows < 0 || G <= 0 || (rows && D <= 0)) return TM_E_ARG;       /* G = 0 was r % 0 */
    if (rows && (!x || !w || !out)) return TM_E_NULL;
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        const float *wr = w + (r % G) * D;
        float *o = out + r * D;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        long c = 0;
        for (; c + 16 <= D; c += 16) {
            __m256 a0 = _mm256_loadu_ps(xr + c), a1 = _mm256_loadu_ps(xr + c + 8);
            s0 = _mm256_fmadd_ps(a0, a0, s0);
            s1 = _mm256_fmadd_ps(a1, a1, s1);
        }
        float ss = hsum(_mm256_add_ps(s0, s1));
        for (; c < D; c++) ss += xr[c] * xr[c];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (c = 0; c < D; c++) o[c] = wr[c] * (xr[c] * inv);
    }
    return 0;
}

/* ---- dense bf16 weights [N, K] (as checkpoints ship them): y[n, N] = x[n, K] @ W^T ----------------
 * One weight row at a time (one sequential stream, as dense_proj), dotted with up to four tokens. */
#if TM_AVX512
static inline __attribute__((always_inline)) void bf16_row(const int R, const uint16_t *w, long K,
        const float *x, float *y, long N) {
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        PF(w + k);
        __m512 w0 = load16(F_BF16, w, k), w1 = load16(F_BF16, w, k + 16);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * K + k), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * K + k + 16), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        for (long kk = k; kk < K; kk++) s += x[r * K + kk] * bf16_to_f32(w[kk]);
        y[r * N] = s;
    }
}
#else
static inline __attribute__((always_inline)) void bf16_row(const int R, const uint16_t *w, long K,
        const float *x, float *y, long N) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        if (!(k & 31)) PF(w + k);
        __m256 w0 = bf16x8(w + k), w1 = bf16x8(w + k + 8);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        for (long kk = k; kk < K; kk++) s += x[r * K + kk] * bf16_to_f32(w[kk]);
        y[r * N] = s;
    }
}
#endif

#if !TM_AVX512
/* Four weight rows against one activation row (a decode token): the activation's 16 floats are loaded once for
 * the four rows, each row keeps bf16_row's two accumulators (the same sums in the same order: equal results). */
static inline AI void bf16_4rows(const uint16_t *w, long K, const float *x, float *y) {
    __m256 a0[4], a1[4];
    for (int o = 0; o < 4; o++) a0[o] = a1[o] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        if (!(k & 31))
            for (int o = 0; o < 4; o++) PF(w + o * K + k);
        for (int o = 0; o < 4; o++) {
            a0[o] = _mm256_fmadd_ps(bf16x8(w + o * K + k), x0, a0[o]);
            a1[o] = _mm256_fmadd_ps(bf16x8(w + o * K + k + 8), x1, a1[o]);
        }
    }
    for (int o = 0; o < 4; o++) {
        float s = hsum(_mm256_add_ps(a0[o], a1[o]));
        for (long kk = k; kk < K; kk++) s += x[kk] * bf16_to_f32(w[o * K + kk]);
        y[o] = s;
    }
}
#endif

typedef struct { const float *x; long n, K; const uint16_t *W; long N; float *y; } bf16_job_t;

static void bf16_job(void *arg, int ith, int nth, tm_bar *bar) {
    const bf16_job_t *j = (const bf16_job_t *)arg;
    const float *x = j->x;
    const long n = j->n, K = j->K, N = j->N;
    const uint16_t *W = j->W;
    float *y = j->y;
    (void)bar;
    SPLIT((N + 31) / 32, b0, b1);
    for (long b = b0; b < b1; b++) {
        long o1 = (b + 1) * 32 < N ? (b + 1) * 32 : N, o = b * 32;
#if !TM_AVX512
        if (n == 1)                  /* a decode token: four weight rows a pass */
            for (; o + 4 <= o1; o += 4) bf16_4rows(W + o * K, K, x, y + o);
#endif
        for (; o < o1; o++)
            for (long r = 0; r < n; r += 4) {
                long R = n - r >= 4 ? 4 : n - r;
                const uint16_t *w = W + o * K;
                switch (R) {
                    case 4: bf16_row(4, w, K, x + r * K, y + r * N + o, N); break;
                    case 3: bf16_row(3, w, K, x + r * K, y + r * N + o, N); break;
                    case 2: bf16_row(2, w, K, x + r * K, y + r * N + o, N); break;
                    default: bf16_row(1, w, K, x + r * K, y + r * N + o, N);
                }
            }
    }
}

int tm_linear_bf16(const float *x, int64_t n, int64_t K, const uint16_t *W, int64_t N, float *y, int32_t nthreads) {
    if (n < 0 || K <= 0 || N <= 0) return TM_E_ARG;
    if (!n) return 0;
    if (!x || !W || !y) return TM_E_NULL;
    bf16_job_t j = {x, n, K, W, N, y};
    pool_run(bf16_job, &j, nthreads > 0 ? nthreads : 1);
    return 0;
}

/* ---- quantized dense weights (tm_lin_t in moe_cpu.h) ------------------------------------------------ */
typedef struct { const tm_lin_t *l; tm_moe_t a; float *sw; long lds; } linq_job_t;

static void linq_job(void *arg, int ith, int nth, tm_bar *bar) {
    const linq_job_t *j = (const linq_job_t *)arg;
    const tm_lin_t *l = j->l;
    const long K = l->K, N = l->N, ldd = tm_q8_ldd(K);
    const int bias = l->fmt == F_MXFP4 ? 12 : (l->fmt == F_INT8 ? 128 : 8), nat = l->fmt == F_INT8;
    int ls = 0;
    if (l->q8) {
        SPLIT(l->n, r0, r1);
        for (long r = r0; r < r1; r++) q8_quantize(l->x + r * K, (int)K, l->xq + r * K, l->xd + r * ldd, bias, nat);
        bar_wait(bar, &ls);
    }
    SPLIT((N + 15) / 16, b0, b1);
    for (long b = b0; b < b1; b++) {
        const long o0 = 16 * b, o1 = o0 + 16 < N ? o0 + 16 : N;
        quant_proj(&j->a, l->W, l->S, (int)N, (int)K, o0, o1, l->x, K, l->q8 ? l->xq : 0, l->q8 ? l->xd : 0, l->n, l->y, N,
                   j->sw ? j->sw + ith * 2 * j->lds : 0, j->lds);
        if (l->bias)
            for (long r = 0; r < l->n; r++)
                for (long o = o0; o < o1; o++) l->y[r * N + o] += l->bias[o];
    }
}

int tm_linear_q(const tm_lin_t *l) {
    init_tables();
    if (!l) return TM_E_NULL;
    if (l->K <= 0 || l->K % 32 || l->K > INT32_MAX || (l->fmt != F_INT8 && l->fmt != F_INT4 && l->fmt != F_MXFP4))
        return TM_E_LAYOUT;
    if (l->fmt != F_MXFP4 && (l->group <= 0 || l->group % 32)) return TM_E_GROUP;
    if (l->n < 0 || l->N <= 0 || l->N > INT32_MAX || l->sfmt < S_F32 || l->sfmt > S_F16) return TM_E_ARG;
    if (!l->n) return 0;
    if (!l->x || !l->y || !l->W || !l->S || (l->q8 && (!l->xq || !l->xd))) return TM_E_NULL;
    if (l->q8 && l->n > l->xq_rows) return TM_E_SCRATCH;
    const int nt = l->nthreads > 0 ? (l->nthreads < TM_MAX_THREADS ? l->nthreads : TM_MAX_THREADS) : 1;
    linq_job_t j;
    memset(&j, 0, sizeof j);
    j.l = l;
    j.a.fmt = l->fmt; j.a.sfmt = l->sfmt; j.a.group = l->group; j.a.q8 = l->q8;
    j.a.H_in = j.a.I = j.a.H_out = (int32_t)l->K;
    j.lds = l->K / 32;
#if TM_VNNI
    if (l->q8 && !(j.sw = malloc((size_t)nt * 2 * j.lds * sizeof(float)))) return TM_E_NOMEM;
#endif
    pool_run(linq_job, &j, nt);
    free(j.sw);
    return 0;
}


/* ---- GQA decode over the paged KV cache ------------------------------------------------------------
 * One call per attention layer and step: RoPE on q and k (x cos + roll(x, rd/2) x signed sin on the
 * first rd channels of each head), k and v written to their token slots, then for each sequence and
 * head softmax(q K^T * scale) V over the keys at read[b, 0..pos[b]]; with sinks (gpt-oss: one learned logit
 * per head), each head's softmax also takes its sink, which carries no value (transformers' eager attention).
 * qk: [B, nh + nkv, hd] (row stride qk_ld floats, rotated in place); v: [B, nkv, hd] (row stride v_ld);
 * cos, ssin: [B, rd] or NULL; K, V: [slots, nkv, hd]; write: [B]; read: [B, n]; sinks: [nh] or NULL;
 * out: [B, nh * hd]. */
static inline float dot_f32(const float *a, const float *b, long n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef struct {
    const float *qk; long qk_ld; const float *K, *V; const int64_t *read; long n; const int64_t *pos;
    long nh, nkv, hd; float scale; const float *sinks; float *out, *scratch; long B_nh;
} gqa_job_t;

static void gqa_job(void *arg, int ith, int nth, tm_bar *bar) {
    const gqa_job_t *J = (const gqa_job_t *)arg;
    const float *qk = J->qk, *K = J->K, *V = J->V;
    const int64_t *read = J->read, *pos = J->pos;
    const long qk_ld = J->qk_ld, n = J->n, nh = J->nh, nkv = J->nkv, hd = J->hd, g = nh / nkv;
    const float scale = J->scale;
    float *out = J->out, *scratch = J->scratch;
    (void)bar;
    SPLIT(J->B_nh, t0_, t1_);
    for (long t = t0_; t < t1_; t++) {
        long b = t / nh, h = t % nh, kv = h / g, m = pos[b] + 1;
        const float *q = qk + b * qk_ld + h * hd;
        float *p = scratch + t * n;
        float mx = -INFINITY;
        for (long j = 0; j < m; j++) {
            p[j] = dot_f32(q, K + (read[b * n + j] * nkv + kv) * hd, hd) * scale;
            mx = p[j] > mx ? p[j] : mx;
        }
        const float sink = J->sinks ? J->sinks[h] : -INFINITY;     /* a logit with no value behind it */
        mx = sink > mx ? sink : mx;
        float sum = J->sinks ? expf(sink - mx) : 0.0f;
        for (long j = 0; j < m; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
        float *o = out + b * nh * hd + h * hd;
        memset(o, 0, hd * sizeof(float));
        const float inv = 1.0f / sum;
        for (long j = 0; j < m; j++) {
            const float *vr = V + (read[b * n + j] * nkv + kv) * hd;
            const float pj = p[j] * inv;
            for (long i = 0; i < hd; i++) o[i] += pj * vr[i];
        }
    }
}

/* The indices attention follows, before any write: each sequence's position inside its row of read
 * slots, and (where the cache's size is known: slots >= 0) every slot written or read inside the cache.
 * O(B n) against the O(B n nh hd) of the attention itself. */
static int gqa_check(const int64_t *write, const int64_t *read, int64_t n, const int64_t *pos, int64_t B,
                     int64_t slots) {
    const int64_t lim = slots;
    for (int64_t b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= n) return TM_E_POS;
        if (write[b] < 0 || write[b] >= lim) return TM_E_SLOT;
        for (int64_t j = 0; j <= pos[b]; j++)
            if (read[b * n + j] < 0 || read[b * n + j] >= lim) return TM_E_SLOT;
    }
    return 0;
}

/* tm_gqa_decode; slots: the cache's slot count, or -2: the caller (tm_attn_block) checked the positions
 * and slots already */
static int gqa_decode(float *qk, int64_t qk_ld, const float *v, int64_t v_ld, const float *cos, const float *ssin,
                      int64_t rd, float *K, float *V, const int64_t *write, const int64_t *read, int64_t n,
                      const int64_t *pos, int64_t B, int64_t nh, int64_t nkv, int64_t hd, float scale,
                      const float *sinks, float *out, float *scratch, int32_t nthreads, int64_t slots) {
    if (B < 0 || nh <= 0 || nkv <= 0 || hd <= 0 || nh % nkv || (B && n <= 0) || qk_ld < (nh + nkv) * hd
        || v_ld < nkv * hd || (cos && (rd < 0 || rd > hd || rd % 2)))
        return TM_E_ARG;
    if (!B) return 0;
    if (!qk || !v || !K || !V || !write || !read || !pos || !out || !scratch || (cos && !ssin)) return TM_E_NULL;
    const int rc = slots == -2 ? 0 : gqa_check(write, read, n, pos, B, slots);
    if (rc) return rc;
    const long half = rd / 2;
    for (long b = 0; b < B; b++) {
        float *row = qk + b * qk_ld;
        if (cos) {
            /* RoPE pairs channel i with i + half, both from their old values: in place, no copy */
            const float *c = cos + b * rd, *sn = ssin + b * rd;
            for (long h = 0; h < nh + nkv; h++) {
                float *x = row + h * hd;
                for (long i = 0; i < half; i++) {
                    const float lo = x[i], hi = x[i + half];
                    x[i] = lo * c[i] + hi * sn[i];
                    x[i + half] = hi * c[i + half] + lo * sn[i + half];
                }
            }
        }
        memcpy(K + write[b] * nkv * hd, row + nh * hd, nkv * hd * sizeof(float));
        memcpy(V + write[b] * nkv * hd, v + b * v_ld, nkv * hd * sizeof(float));
    }
    gqa_job_t j = {qk, qk_ld, K, V, read, n, pos, nh, nkv, hd, scale, sinks, out, scratch, B * nh};
    pool_run(gqa_job, &j, (int)(nthreads > 0 ? (nthreads < B * nh ? nthreads : B * nh) : 1));
    return 0;
}

/* The exported call (runtime/model/layers/attention.py): K and V hold ``slots`` rows of [nkv, hd]; every
 * write and read slot is checked against it before anything is written. */
int tm_gqa_decode(float *qk, int64_t qk_ld, const float *v, int64_t v_ld, const float *cos, const float *ssin,
                  int64_t rd, float *K, float *V, int64_t slots, const int64_t *write, const int64_t *read, int64_t n,
                  const int64_t *pos, int64_t B, int64_t nh, int64_t nkv, int64_t hd, float scale,
                  const float *sinks, float *out, float *scratch, int32_t nthreads) {
    if (slots < 0) return TM_E_ARG;
    return gqa_decode(qk, qk_ld, v, v_ld, cos, ssin, rd, K, V, write, read, n, pos, B, nh, nkv, hd, scale, sinks, out,
                      scratch, nthreads, slots);
}


/* ---- one decoder layer's attention sublayer at decode, router and dispatch included ------------------
 * The CPU decode step of a GQA + MoE layer in two calls instead of ~25 small ops: tm_attn_block does
 * x += o(attention(rmsnorm(x))) over the paged cache, h = rmsnorm(x), the router's logits, top-k and
 * the dispatch (the rows of each expert); tm_moe then adds the experts' weighted sum into x. Between
 * them Python asks the expert store for the routed experts (placement stays there). */

/* A dense projection as runtime/model/layers/dense.py holds it. */

typedef struct { const tm_lin_desc *d; const float *x; long n; float *y; } f32_job_t;

static void f32_job(void *arg, int ith, int nth, tm_bar *bar) {
    const f32_job_t *j = (const f32_job_t *)arg;
    const long N = j->d->N, blk = 64;
    (void)bar;
    SPLIT((N + blk - 1) / blk, b0, b1);
    for (long b = b0; b < b1; b++)
        dense_proj(F_F32, j->d->W, N, (int)j->d->K, b * blk, (b + 1) * blk < N ? (b + 1) * blk : N, j->x, j->d->K, j->n,
                   j->y, N);
}

/* xq_rows: rows the q8 scratch holds (tm_attn_block checked K against its width) */
static int lin_apply(const tm_lin_desc *d, const float *x, long n, float *y, int nt, int8_t *xq, float *xd,
                     int64_t xq_rows) {
    if (d->kind == 2) {
        tm_lin_t l = {d->fmt, d->sfmt, d->group, d->q8, nt, n, d->K, d->N, x, y, d->W, d->S, d->bias, xq, xd, xq_rows};
        return tm_linear_q(&l);
    }
    if (d->kind == 1) {
        const int rc = tm_linear_bf16(x, n, d->K, (const uint16_t *)d->W, d->N, y, nt);
        if (rc) return rc;
    } else {
        f32_job_t j = {d, x, n, y};
        pool_run(f32_job, &j, nt);
    }
    if (d->bias)
        for (long r = 0; r < n; r++)
            for (long c = 0; c < d->N; c++) y[r * d->N + c] += d->bias[c];
    return 0;
}

enum { R_SOFTMAX_TOPK = 0, R_TOPK_SOFTMAX = 1, R_SIGMOID_GROUP = 2, R_SOFTMAX_GROUP = 3, R_NONE = -1 };



static void topk_desc(const float *v, int E, int k, int64_t *ids) {
    /* the k largest of v, largest first; ties to the lower index (small k: selection) */
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        ids[j] = best;
    }
}

/* sel [E] outside the best topk_group of n_group groups set to -inf; a group's score: the sum of its best two
 * (two = 1: its best). gs: [G] scratch, keep: [G] */
static void group_mask(const tm_layer_t *L, float *sel, int two, float *gs, int64_t *keep) {
    const int E = L->E, G = L->n_group, per = E / G;
    two = per < two ? per : two;
    for (int g = 0; g < G; g++) {
        int64_t t2[2];
        topk_desc(sel + g * per, per, two, t2);
        gs[g] = 0.0f;
        for (int i = 0; i < two; i++) gs[g] += sel[g * per + t2[i]];
    }
    topk_desc(gs, G, L->topk_group, keep);
    for (int g = 0; g < G; g++) {
        int kept = 0;
        for (int i = 0; i < L->topk_group; i++) kept |= keep[i] == g;
        if (!kept) for (int e = g * per; e < (g + 1) * per; e++) sel[e] = -INFINITY;
    }
}

/* tmp: [2E + G] floats, keep: [G] (G = n_group), from block_tail's heap block; runtime/model/layers/router.py's
 * functions of the same names */
static void route_row(const tm_layer_t *L, const float *lg, int64_t *ids, float *w, float *tmp, int64_t *keep) {
    const int E = L->E, k = L->k;
    if (L->router == R_SOFTMAX_TOPK || L->router == R_TOPK_SOFTMAX || L->router == R_SOFTMAX_GROUP) {
        float mx = -INFINITY;
        for (int e = 0; e < E; e++) mx = lg[e] > mx ? lg[e] : mx;
        if (L->router != R_TOPK_SOFTMAX) {
            float sum = 0.0f, *sel = tmp + E;
            for (int e = 0; e < E; e++) { tmp[e] = expf(lg[e] - mx); sum += tmp[e]; }
            for (int e = 0; e < E; e++) tmp[e] /= sum;
            if (L->router == R_SOFTMAX_GROUP && L->n_group > 1) {   /* DeepSeek-V2: groups by their best expert */
                memcpy(sel, tmp, E * sizeof(float));
                group_mask(L, sel, 1, tmp + 2 * E, keep);
                topk_desc(sel, E, k, ids);
            } else
                topk_desc(tmp, E, k, ids);
            float ws = 0.0f;
            for (int j = 0; j < k; j++) { w[j] = tmp[ids[j]]; ws += w[j]; }
            if (L->renorm) for (int j = 0; j < k; j++) w[j] /= ws;
        } else {          /* top-k of the logits, softmax over the chosen */
            topk_desc(lg, E, k, ids);
            float m2 = lg[ids[0]], sum = 0.0f;
            for (int j = 0; j < k; j++) { w[j] = expf(lg[ids[j]] - m2); sum += w[j]; }
            for (int j = 0; j < k; j++) w[j] /= sum;
        }
    } else {              /* sigmoid, selection on score + correction within the best groups (by their best two) */
        float *sc = tmp, *sel = tmp + E;
        for (int e = 0; e < E; e++) { sc[e] = 1.0f / (1.0f + expf(-lg[e])); sel[e] = sc[e] + (L->correction ? L->correction[e] : 0.0f); }
        if (L->n_group > 1) group_mask(L, sel, 2, tmp + 2 * E, keep);
        topk_desc(sel, E, k, ids);
        float ws = 0.0f;
        for (int j = 0; j < k; j++) { w[j] = sc[ids[j]]; ws += w[j]; }
        if (L->renorm) for (int j = 0; j < k; j++) w[j] /= ws + 1e-20f;
    }
    if (L->route_scale != 1.0f) for (int j = 0; j < k; j++) w[j] *= L->route_scale;
}

static int desc_check(const tm_lin_desc *d, int64_t K, int64_t N) {
    if (d->K != K || d->N != N || d->kind < 0 || d->kind > 2 || !d->W || (d->kind == 2 && !d->S)) return TM_E_LAYOUT;
    return 0;
}

/* The layer's sizes against each other and against the step's scratch, then the positions and slots:
 * everything tm_attn_block indexes, before it writes anything. */
/* What every attention kind's block shares: the router's codes, the o projection (att_w -> H) and the gate
 * against the layer, the step's common scratch, the buffers the residual, the norms and the dispatch use. */
static int block_check(const tm_layer_t *L, const tm_step_t *S, int64_t att_w) {
    const int64_t B = S->B, H = L->H;
    if (B < 0 || H <= 0 || L->nh <= 0 || L->router < R_NONE || L->router > R_SOFTMAX_GROUP) return TM_E_ARG;
    if (L->router >= 0 && (L->E <= 0 || L->k <= 0 || L->k > L->E)) return TM_E_ARG;
    if ((L->router == R_SIGMOID_GROUP || L->router == R_SOFTMAX_GROUP) && L->n_group > 1
        && (L->E % L->n_group || L->topk_group <= 0 || L->topk_group > L->n_group))
        return TM_E_ARG;
    /* no router and no gate (a dense MLP layer): the block stops at the post-attention norm */
    const int gated = L->router >= 0 || L->gate.W;
    const int64_t E = L->router >= 0 ? L->E : gated ? L->gate.N : 0;
    int rc;
    if ((rc = desc_check(&L->o, att_w, H)) || (gated && (rc = desc_check(&L->gate, H, E)))) return rc;
    if (B > S->cap_B || S->n > S->cap_n || H > S->cap_H || att_w > S->cap_att || L->nh > S->cap_heads || E > S->cap_E
        || (L->router >= 0 && L->k > S->cap_k) || H > S->cap_K || att_w > S->cap_K)
        return TM_E_SCRATCH;
    if (!B) return 0;
    if (!S->x || !S->h || !S->qkv || !S->att || !S->tmp || !S->scores || !S->logits || !S->xq || !S->xd || !L->in_norm
        || !L->post_norm)
        return TM_E_NULL;
    if (L->router >= 0 && (!S->ids || !S->wts || !S->n_used || !S->used || !S->counts || !S->row0 || !S->rows
                           || !S->tok || !S->back))
        return TM_E_NULL;
    if (S->n <= 0 || !S->write || !S->read || !S->pos) return S->n <= 0 ? TM_E_ARG : TM_E_NULL;
    return 0;
}

static int attn_check(const tm_layer_t *L, const tm_step_t *S) {
    const int64_t B = S->B, H = L->H, nh = L->nh, nkv = L->nkv, hd = L->hd;
    if (nh <= 0 || nkv <= 0 || hd <= 0 || nh % nkv || L->rd < 0 || L->rd > hd || L->rd % 2 || L->qk_norm < 0
        || L->qk_norm > 2)
        return TM_E_ARG;
    if (L->gated < 0 || L->gated > 1) return TM_E_ARG;
    int rc = block_check(L, S, nh * hd);
    if (rc || !B) return rc;
    const int64_t ld = (nh + 2 * nkv) * hd + (L->gated ? nh * hd : 0);
    if ((rc = desc_check(&L->qkv, H, ld))) return rc;
    if (ld > S->cap_qkv) return TM_E_SCRATCH;
    if (!L->K || !L->V || (L->qk_norm && !L->q_norm) || (L->qk_norm == 2 && !L->k_norm) || (L->rd && (!S->cos || !S->ssin)))
        return TM_E_NULL;
    if (L->slots < 0) return TM_E_ARG;
    return gqa_check(S->write, S->read, S->n, S->pos, B, L->slots);
}

/* The block's tail, after its attention wrote att [B, att_w]: x += o(att), h = rmsnorm(x), the router's
 * logits, its top-k and the dispatch (a stable counting sort of the (token, slot) pairs by expert). */
static int block_tail(const tm_layer_t *L, const tm_step_t *S, const float *att, int nt) {
    const long B = S->B, H = L->H;
    /* The router's per-row scratch and the sort's cursors on the heap (they were ~100 KB of stack arrays
     * sized for 4096 experts, on whatever thread called): one block per call, before any work. */
    const long E = L->router >= 0 ? L->E : 0, k = L->k, G = L->n_group > 1 ? L->n_group : 1;
    void *blk = 0;
    if (L->router >= 0 && !(blk = malloc((2 * E + G) * sizeof(float) + (E + G) * sizeof(int64_t)))) return TM_E_NOMEM;
    int64_t *start = (int64_t *)blk, *keep = start + E;
    float *rtmp = (float *)(keep + G);
    int rc;
    if ((rc = lin_apply(&L->o, att, B, S->tmp, nt, S->xq, S->xd, S->cap_B))) goto done;
    for (long i = 0; i < B * H; i++) S->x[i] += S->tmp[i];                          /* the residual */
    tm_rms_norm(S->x, B, H, L->post_norm, 1, L->eps, S->h);
    if ((L->router >= 0 || L->gate.W)
        && (rc = lin_apply(&L->gate, S->h, B, S->logits, nt, S->xq, S->xd, S->cap_B))) goto done;   /* logits: [B, E] */
    if (L->router < 0) goto done;
    for (long b = 0; b < B; b++) route_row(L, S->logits + b * E, S->ids + b * k, S->wts + b * k, rtmp, keep);
    for (long e = 0; e < E; e++) S->counts[e] = 0;
    for (long i = 0; i < B * k; i++) S->counts[S->ids[i]]++;
    long nu = 0, off = 0;
    for (long e = 0; e < E; e++) {
        start[e] = off;
        if (S->counts[e]) { S->used[nu] = e; S->row0[nu] = off; S->rows[nu] = S->counts[e]; nu++; }
        off += S->counts[e];
    }
    for (long i = 0; i < B * k; i++) {
        const long r = start[S->ids[i]]++;
        S->tok[r] = i / k;
        S->back[i] = r;
    }
    *S->n_used = nu;
done:
    free(blk);
    return rc;
}

int tm_attn_block(const tm_layer_t *L, const tm_step_t *S) {
    if (!L || !S) return TM_E_NULL;
    int rc = attn_check(L, S);
    if (rc || !S->B) return rc;
    const long B = S->B, H = L->H, nh = L->nh, nkv = L->nkv, hd = L->hd, nq = nh + nkv;
    const long ld = (nh + 2 * nkv) * hd + (L->gated ? nh * hd : 0);      /* q | k | v (| gate) per row */
    const int nt = S->nthreads > 0 ? S->nthreads : 1;
    tm_rms_norm(S->x, B, H, L->in_norm, 1, L->eps, S->h);                          /* h: [B, H] */
    if ((rc = lin_apply(&L->qkv, S->h, B, S->qkv, nt, S->xq, S->xd, S->cap_B))) return rc;   /* qkv: [B, ld] */
    if (L->qk_norm == 1)
        for (long b = 0; b < B; b++) tm_rms_norm(S->qkv + b * ld, nq, hd, L->q_norm, nq, L->eps, S->qkv + b * ld);
    else if (L->qk_norm == 2)
        for (long b = 0; b < B; b++) {
            tm_rms_norm(S->qkv + b * ld, 1, nh * hd, L->q_norm, 1, L->eps, S->qkv + b * ld);
            tm_rms_norm(S->qkv + b * ld + nh * hd, 1, nkv * hd, L->k_norm, 1, L->eps, S->qkv + b * ld + nh * hd);
        }
    if ((rc = gqa_decode(S->qkv, ld, S->qkv + nq * hd, ld, L->rd ? S->cos : 0, S->ssin, L->rd, L->K, L->V, S->write,
                         S->read, S->n, S->pos, B, nh, nkv, hd, L->scale, L->sinks, S->att, S->scores, nt, -2)))
        return rc;                                                                   /* att: [B, nh hd] */
    if (L->gated)                                      /* Qwen3-Next: each output channel through its sigmoid gate */
        for (long b = 0; b < B; b++) {
            const float *g = S->qkv + b * ld + (nh + 2 * nkv) * hd;
            float *o = S->att + b * nh * hd;
            for (long i = 0; i < nh * hd; i++) o[i] *= sigmoid1(g[i]);
        }
    return block_tail(L, S, S->att, nt);
}


/* ---- one MLA decoder layer's attention at decode (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, Kimi-Linear) ----
 * runtime/model/layers/mla.py's decode in one call: h = rmsnorm(x); q (through q_a, its norm and q_b, or one
 * q_proj); the latent and shared rotary key from kv_a (latent normed), both rotated; the cache row written;
 * attention in the latent space with kv_b absorbed (its key half into the query, its value half after the
 * weighted sum), so cached latents are never expanded per head; then block_tail (o, residual, router,
 * dispatch) as for GQA. */
typedef struct {
    int32_t nope, rope, vd, lat;      /* per head: q/k channels without and with rotation, v; the latent's width */
    int32_t q_lora;                   /* q's low-rank width (q_a -> norm -> q), or 0: q is one projection of h */
    int32_t rot;                      /* 0 none (Kimi-Linear), 1 rotate-half pairs (i, i + rope/2), 2 DeepSeek's (2i, 2i+1) */
    float lat_eps;                    /* the latent norms' eps */
    tm_lin_desc q_a, q, kv_a;
    const float *q_a_norm, *kv_a_norm;  /* [q_lora], [lat] */
    const float *kv_b;                /* [nh (nope + vd), lat] float32: each head's nope key rows, then its v rows */
    float *cache;                     /* [slots, lat + rope]: the normed latent, then the rotated shared key */
    int64_t slots;
} tm_mla_t;

/* y[i] += a x[i] */
static inline void axpy_f32(float *y, float a, const float *x, long n) {
    const __m256 va = _mm256_set1_ps(a);
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* x [rd] rotated in place by cos / signed sin [rd] (layers/rope.py: _rotate or rope_interleaved, the latter's
 * output in the concatenated layout the composed path caches); t: [rd] scratch */
static void rope_rows(float *x, long rd, const float *c, const float *sn, int mode, float *t) {
    const long half = rd / 2;
    if (mode == 1)
        for (long i = 0; i < half; i++) {
            const float lo = x[i], hi = x[i + half];
            x[i] = lo * c[i] + hi * sn[i];
            x[i + half] = hi * c[i + half] + lo * sn[i + half];
        }
    else if (mode == 2) {
        for (long i = 0; i < half; i++) {
            const float x1 = x[2 * i], x2 = x[2 * i + 1];
            t[i] = x1 * c[i] + x2 * sn[i];
            t[i + half] = x2 * c[i + half] + x1 * sn[i + half];
        }
        memcpy(x, t, rd * sizeof(float));
    }
}

typedef struct {
    const tm_layer_t *L; const tm_mla_t *M; const tm_step_t *S;
    const float *q; float *qlat, *lctx, *out;
} mla_job_t;

static void mla_job(void *arg, int ith, int nth, tm_bar *bar) {
    const mla_job_t *J = (const mla_job_t *)arg;
    const tm_mla_t *M = J->M;
    const tm_step_t *S = J->S;
    const long nh = J->L->nh, nope = M->nope, rope = M->rope, vd = M->vd, lat = M->lat, w = lat + rope, n = S->n;
    const long qk = nope + rope, kvw = nope + vd;
    const float scale = J->L->scale;
    (void)bar;
    SPLIT(S->B * nh, t0, t1);
    for (long t = t0; t < t1; t++) {
        const long b = t / nh, h = t % nh, m = S->pos[b] + 1;
        const float *q = J->q + t * qk, *wk = M->kv_b + h * kvw * lat;     /* wk: [nope + vd, lat] this head's */
        float *ql = J->qlat + t * lat, *lc = J->lctx + t * lat, *p = S->scores + t * n;
        memset(ql, 0, lat * sizeof(float));
        for (long d = 0; d < nope; d++) axpy_f32(ql, q[d], wk + d * lat, lat);    /* q_lat = q_nope wk[:nope] */
        float mx = -INFINITY;
        for (long j = 0; j < m; j++) {
            const float *c = M->cache + S->read[b * n + j] * w;
            p[j] = (dot_f32(ql, c, lat) + dot_f32(q + nope, c + lat, rope)) * scale;
            mx = p[j] > mx ? p[j] : mx;
        }
        float sum = 0.0f;
        for (long j = 0; j < m; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
        const float inv = 1.0f / sum;
        memset(lc, 0, lat * sizeof(float));
        for (long j = 0; j < m; j++) axpy_f32(lc, p[j] * inv, M->cache + S->read[b * n + j] * w, lat);
        float *o = J->out + t * vd;                                          /* out: [B, nh, vd] */
        for (long v = 0; v < vd; v++) o[v] = dot_f32(lc, wk + (nope + v) * lat, lat);
    }
}

/* Scratch: qkv holds q [B, nh (nope + rope)], then the latent rows [B, lat + rope], then q_a's [B, q_lora]
 * (the layer's qkv width is their sum per row); att holds out [B, nh vd], then the absorbed queries and the
 * latent contexts [B, nh, lat] each (width nh (vd + 2 lat)). */
static int mla_check(const tm_layer_t *L, const tm_mla_t *M, const tm_step_t *S) {
    const int64_t B = S->B, H = L->H, nh = L->nh;
    if (M->nope < 0 || M->rope < 0 || M->rope % 2 || M->rope > 1024 || M->nope + M->rope <= 0 || M->vd <= 0
        || M->lat <= 0 || M->q_lora < 0 || M->rot < 0 || M->rot > 2)
        return TM_E_ARG;
    int rc = block_check(L, S, nh * M->vd);
    if (rc || !B) return rc;
    const int64_t qk = M->nope + M->rope, w = M->lat + M->rope;
    if ((M->q_lora && (rc = desc_check(&M->q_a, H, M->q_lora))) || (rc = desc_check(&M->q, M->q_lora ? M->q_lora : H, nh * qk))
        || (rc = desc_check(&M->kv_a, H, w)))
        return rc;
    if (nh * qk + w + M->q_lora > S->cap_qkv || nh * (M->vd + 2 * M->lat) > S->cap_att || M->q_lora > S->cap_K)
        return TM_E_SCRATCH;
    if (!M->kv_a_norm || !M->kv_b || !M->cache || (M->q_lora && !M->q_a_norm) || (M->rot && (!S->cos || !S->ssin)))
        return TM_E_NULL;
    if (M->slots < 0) return TM_E_ARG;
    return gqa_check(S->write, S->read, S->n, S->pos, B, M->slots);
}

int tm_mla_block(const tm_layer_t *L, const tm_mla_t *M, const tm_step_t *S) {
    if (!L || !M || !S) return TM_E_NULL;
    int rc = mla_check(L, M, S);
    if (rc || !S->B) return rc;
    const long B = S->B, H = L->H, nh = L->nh, rope = M->rope, lat = M->lat, w = lat + rope, qk = M->nope + rope;
    const long ql = M->q_lora;
    const int nt = S->nthreads > 0 ? S->nthreads : 1;
    float *q = S->qkv, *ckv = q + B * nh * qk, *qa = ckv + B * w;       /* q: [B, nh, qk]; ckv: [B, w]; qa: [B, ql] */
    float *out = S->att, *qlat = out + B * nh * M->vd, *lctx = qlat + B * nh * lat;
    float t[1024];                                                       /* interleaved rotation's scratch (rope <= 1024) */
    tm_rms_norm(S->x, B, H, L->in_norm, 1, L->eps, S->h);                  /* h: [B, H] */
    if (ql) {
        if ((rc = lin_apply(&M->q_a, S->h, B, qa, nt, S->xq, S->xd, S->cap_B))) return rc;
        tm_rms_norm(qa, B, ql, M->q_a_norm, 1, M->lat_eps, qa);
        if ((rc = lin_apply(&M->q, qa, B, q, nt, S->xq, S->xd, S->cap_B))) return rc;
    } else if ((rc = lin_apply(&M->q, S->h, B, q, nt, S->xq, S->xd, S->cap_B)))
        return rc;
    if ((rc = lin_apply(&M->kv_a, S->h, B, ckv, nt, S->xq, S->xd, S->cap_B))) return rc;
    for (long b = 0; b < B; b++) {
        float *row = ckv + b * w;
        tm_rms_norm(row, 1, lat, M->kv_a_norm, 1, M->lat_eps, row);
        if (M->rot) {
            const float *c = S->cos + b * rope, *sn = S->ssin + b * rope;
            rope_rows(row + lat, rope, c, sn, M->rot, t);
            for (long h = 0; h < nh; h++) rope_rows(q + (b * nh + h) * qk + M->nope, rope, c, sn, M->rot, t);
        }
        memcpy(M->cache + S->write[b] * w, row, w * sizeof(float));
    }
    mla_job_t j = {L, M, S, q, qlat, lctx, out};
    pool_run(mla_job, &j, (int)(nt < B * nh ? nt : B * nh));
    return block_tail(L, S, out, nt);
}


/* ---- one linear-attention decoder layer's token mixer at decode: Gated DeltaNet (Qwen3-Next, Qwen3.5) and
 * Kimi Delta Attention (Kimi-Linear, Kimi K3) ---------------------------------------------------------------
 * runtime/model/linear_attention.py's GatedDeltaNet.step / KimiDeltaAttention.step in one call, over each
 * sequence's slot of the state arena (read and written in place, no gather / scatter): h = rmsnorm(x); the
 * projections of h; the short causal depthwise convolution over q | k | v from the slot's last W-1 inputs
 * (then shifted in) and SiLU; q, k L2-normalised per key head (q by 1/sqrt(dk) too); per value head (key head
 * = value head / (hv / hk)), with beta = sigmoid(b) and a decay per key channel i:
 *     S[i, :] <- decay_i S[i, :];  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
 * o's gated RMSNorm (o rmsnorm'd over dv, times norm, times act(gate)); then block_tail (the output
 * projection, the residual, the post norm, the router, the dispatch) as for GQA.
 *   Gated DeltaNet (kind 0): one projection h -> [q | k | v | z | b | a] (the loader regroups Qwen3-Next's
 *     per-key-head rows flat); decay_i = exp(-exp(A_log[h]) softplus(a[h] + dt_bias[h])) for every i; act SiLU.
 *   KDA (kind 1, hk = hv, dk = dv): qkv from one projection, b from another, the decay's f = f_b(f_a(h)) and
 *     the gate g_b(g_a(h)) low-rank; decay_i = exp(-exp(A_log[h]) softplus(f[h, i] + dt_bias[h, i])); act
 *     sigmoid. */

/* Where a step's rows are in the qkv scratch: the conv'd q | k | v, the gate's input, beta's and the decay's
 * (row strides; GDN: all in the one projection's rows, KDA: blocks of B rows each). */
typedef struct {
    const tm_gdn_t *G; const tm_step_t *S;
    float *mix; long ld_mix;
    const float *gz, *bt, *dc; long ld_gz, ld_bt, ld_dc;
    float *out;
} gdn_job_t;

static inline float softplus1(float x) { return x > 20.0f ? x : log1pf(expf(x)); }   /* torch's threshold 20 */
static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

/* One (sequence, value head): the rule on the slot's [dk, dv] memory, then the gated norm of its output. */
static void gdn_job(void *arg, int ith, int nth, tm_bar *bar) {
    const gdn_job_t *J = (const gdn_job_t *)arg;
    const tm_gdn_t *G = J->G;
    const tm_step_t *S = J->S;
    const long hv = G->hv, dk = G->dk, dv = G->dv, r = G->hv / G->hk, kd = (long)G->hk * dk;
    (void)bar;
    SPLIT(S->B * hv, t0, t1);
    for (long t = t0; t < t1; t++) {
        const long b = t / hv, h = t % hv, g = h / r;
        const float *p = J->mix + b * J->ld_mix;             /* the sequence's q | k | v, conv'd and normed */
        const float *q = p + g * dk, *k = p + kd + g * dk, *v = p + 2 * kd + h * dv;
        const float *z = J->gz + b * J->ld_gz + h * dv;
        const float beta = sigmoid1(J->bt[b * J->ld_bt + h]), A = expf(G->A_log[h]);
        float *M = G->R + (G->state[b] * hv + h) * dk * dv;  /* M: [dk, dv] */
        float *o = J->out + t * dv;                          /* out: [B, hv, dv] */
        float u[dv];
        for (long j = 0; j < dv; j++) u[j] = 0.0f;
        float decay = G->kind ? 0.0f : expf(-A * softplus1(J->dc[b * J->ld_dc + h] + G->dt_bias[h]));
        const float *f = J->dc + b * J->ld_dc + h * dk, *fb = G->dt_bias + h * dk;     /* KDA: per key channel */
        for (long i = 0; i < dk; i++) {                      /* M <- decay M, and u = M^T k on the way */
            if (G->kind) decay = expf(-A * softplus1(f[i] + fb[i]));
            float *row = M + i * dv;
            const __m256 d8 = _mm256_set1_ps(decay), k8 = _mm256_set1_ps(k[i]);
            long j = 0;
            for (; j + 8 <= dv; j += 8) {
                const __m256 m = _mm256_mul_ps(_mm256_loadu_ps(row + j), d8);
                _mm256_storeu_ps(row + j, m);
                _mm256_storeu_ps(u + j, _mm256_fmadd_ps(m, k8, _mm256_loadu_ps(u + j)));
            }
            for (; j < dv; j++) { row[j] *= decay; u[j] += row[j] * k[i]; }
        }
        for (long j = 0; j < dv; j++) { u[j] = (v[j] - u[j]) * beta; o[j] = 0.0f; }
        for (long i = 0; i < dk; i++) {                      /* M <- M + k u^T, and o = M^T q on the way */
            float *row = M + i * dv;
            const __m256 k8 = _mm256_set1_ps(k[i]), q8 = _mm256_set1_ps(q[i]);
            long j = 0;
            for (; j + 8 <= dv; j += 8) {
                const __m256 m = _mm256_fmadd_ps(k8, _mm256_loadu_ps(u + j), _mm256_loadu_ps(row + j));
                _mm256_storeu_ps(row + j, m);
                _mm256_storeu_ps(o + j, _mm256_fmadd_ps(m, q8, _mm256_loadu_ps(o + j)));
            }
            for (; j < dv; j++) { row[j] += k[i] * u[j]; o[j] += row[j] * q[i]; }
        }
        float ss = 0.0f;
        for (long j = 0; j < dv; j++) ss += o[j] * o[j];
        const float inv = 1.0f / sqrtf(ss / (float)dv + G->norm_eps);
        for (long j = 0; j < dv; j++)
            o[j] = G->norm[j] * (o[j] * inv) * (G->kind ? sigmoid1(z[j]) : silu1(z[j]));
    }
}

/* The qkv scratch a row needs: GDN the one projection [2 hk dk + 2 hv dv + 2 hv]; KDA q | k | v [3 hv dk], the
 * decay's f [hv dk], b [hv], the gate [hv dk] and the two low-rank rows [rank] each. */
static int64_t gdn_width(const tm_gdn_t *G) {
    const int64_t hv = G->hv, dk = G->dk, dv = G->dv, kd = (int64_t)G->hk * dk;
    return G->kind ? 5 * hv * dk + hv + 2 * (int64_t)G->rank : 2 * kd + 2 * hv * dv + 2 * hv;
}

static int gdn_check(const tm_layer_t *L, const tm_gdn_t *G, const tm_step_t *S) {
    const int64_t B = S->B, H = L->H, hv = G->hv, dk = G->dk;
    if (G->kind < 0 || G->kind > 1 || G->hk <= 0 || hv <= 0 || hv % G->hk || dk <= 0 || G->dv <= 0 || G->dv > 4096
        || G->W < 1 || G->W > 64 || L->nh != hv || (G->kind && (G->hk != hv || G->dv != dk || G->rank <= 0)))
        return TM_E_ARG;
    int rc = block_check(L, S, hv * G->dv);
    if (rc || !B) return rc;
    const int64_t kd = (int64_t)G->hk * dk, cd = 2 * kd + hv * G->dv;
    if (G->kind == 0 && (rc = desc_check(&G->in, H, cd + hv * G->dv + 2 * hv))) return rc;
    if (G->kind == 1 && ((rc = desc_check(&G->in, H, cd)) || (rc = desc_check(&G->f_a, H, G->rank))
                         || (rc = desc_check(&G->f_b, G->rank, hv * dk)) || (rc = desc_check(&G->b, H, hv))
                         || (rc = desc_check(&G->g_a, H, G->rank)) || (rc = desc_check(&G->g_b, G->rank, hv * dk))))
        return rc;
    if (gdn_width(G) > S->cap_qkv || (G->kind && G->rank > S->cap_K)) return TM_E_SCRATCH;
    if (!G->conv || !G->A_log || !G->dt_bias || !G->norm || !G->R || !G->C || !G->state) return TM_E_NULL;
    if (G->slots < 0) return TM_E_ARG;
    for (int64_t b = 0; b < B; b++) {
        if (G->state[b] < 0 || G->state[b] >= G->slots) return TM_E_SLOT;
        for (int64_t c = 0; c < b; c++)
            if (G->state[c] == G->state[b]) return TM_E_SLOT;          /* two sequences on one slot */
    }
    return 0;
}

/* The projections of h into the qkv scratch; fills the job's row pointers. */
static int gdn_project(const tm_gdn_t *G, const tm_step_t *S, int nt, gdn_job_t *j) {
    const long B = S->B, hv = G->hv, dk = G->dk, dv = G->dv, kd = (long)G->hk * dk, cd = 2 * kd + hv * dv;
    int rc;
#define LIN(d, x, y) if ((rc = lin_apply(d, x, B, y, nt, S->xq, S->xd, S->cap_B))) return rc
    if (G->kind == 0) {
        const long pw = cd + hv * dv + 2 * hv;
        LIN(&G->in, S->h, S->qkv);                                              /* qkv: [B, pw] */
        j->mix = S->qkv, j->gz = S->qkv + cd, j->bt = S->qkv + cd + hv * dv, j->dc = S->qkv + cd + hv * dv + hv;
        j->ld_mix = j->ld_gz = j->ld_bt = j->ld_dc = pw;
        return 0;
    }
    float *mix = S->qkv, *f = mix + B * cd, *bt = f + B * hv * dk, *gz = bt + B * hv, *r1 = gz + B * hv * dk;
    float *r2 = r1 + B * G->rank;
    LIN(&G->in, S->h, mix);                                                     /* [B, 3 hv dk] */
    LIN(&G->f_a, S->h, r1);
    LIN(&G->f_b, r1, f);                                                        /* [B, hv dk] */
    LIN(&G->b, S->h, bt);                                                       /* [B, hv] */
    LIN(&G->g_a, S->h, r2);
    LIN(&G->g_b, r2, gz);                                                       /* [B, hv dk] */
#undef LIN
    j->mix = mix, j->gz = gz, j->bt = bt, j->dc = f;
    j->ld_mix = cd, j->ld_gz = hv * dk, j->ld_bt = hv, j->ld_dc = hv * dk;
    return 0;
}

int tm_gdn_block(const tm_layer_t *L, const tm_gdn_t *G, const tm_step_t *S) {
    if (!L || !G || !S) return TM_E_NULL;
    int rc = gdn_check(L, G, S);
    if (rc || !S->B) return rc;
    const long B = S->B, H = L->H, W = G->W, kd = (long)G->hk * G->dk, cd = 2 * kd + (long)G->hv * G->dv;
    const int nt = S->nthreads > 0 ? S->nthreads : 1;
    gdn_job_t j = {G, S, 0, 0, 0, 0, 0, 0, 0, 0, S->att};
    tm_rms_norm(S->x, B, H, L->in_norm, 1, L->eps, S->h);                  /* h: [B, H] */
    if ((rc = gdn_project(G, S, nt, &j))) return rc;
    for (long b = 0; b < B; b++) {
        float *p = j.mix + b * j.ld_mix, *cs = G->C + G->state[b] * cd * (W - 1);
        for (long c = 0; c < cd; c++) {                  /* the causal conv's newest output, the input shifted in */
            const float *w = G->conv + c * W;
            float *st = cs + c * (W - 1), acc = 0.0f;
            for (long i = 0; i < W - 1; i++) acc += st[i] * w[i];
            acc += p[c] * w[W - 1];
            for (long i = 0; i + 1 < W - 1; i++) st[i] = st[i + 1];
            if (W > 1) st[W - 2] = p[c];
            p[c] = silu1(acc);
        }
        for (long g = 0; g < 2L * G->hk; g++) {          /* q and k heads L2-normalised (as FLA: + 1e-6 inside) */
            float *u = p + g * G->dk, ss = 0.0f;
            for (long i = 0; i < G->dk; i++) ss += u[i] * u[i];
            const float inv = 1.0f / sqrtf(ss + 1e-6f) * (g < G->hk ? 1.0f / sqrtf((float)G->dk) : 1.0f);
            for (long i = 0; i < G->dk; i++) u[i] *= inv;
        }
    }
    const long work = B * G->hv;
    pool_run(gdn_job, &j, (int)(nt < work ? nt : work));
    return block_tail(L, S, S->att, nt);
}

/* A dense SwiGLU MLP after a fused block (tm_mlp_t): x += [sigmoid(gate . h) *] down(act(gate_up h)) on the
 * step's post-norm rows h [B, H] - a MoE block's shared experts after tm_moe added the routed sum, or a dense
 * layer's MLP - in one call where Python ran two or three projections and as many elementwise ops. The
 * projections are lin_apply's (the composed Linear's kernels), the activation the experts' swiglu_row. */
int tm_mlp_block(const tm_mlp_t *M, const tm_step_t *S) {
    if (!M || !S) return TM_E_NULL;
    const long B = S->B, H = M->H, I = M->I;
    if (B < 0 || H <= 0 || I <= 0 || (M->act != 0 && M->act != 2)) return TM_E_ARG;
    int rc;
    if ((rc = desc_check(&M->gate_up, H, 2 * I)) || (rc = desc_check(&M->down, I, H))
        || (M->gate.W && (rc = desc_check(&M->gate, H, 1))))
        return rc;
    if (B > S->cap_B || H > S->cap_H || H > S->cap_K || I > S->cap_K || B * (3 * I + 1) > M->scratch_n)
        return TM_E_SCRATCH;
    if (!B) return 0;
    if (!S->x || !S->h || !S->tmp || !S->xq || !S->xd || !M->scratch) return TM_E_NULL;
    const int nt = S->nthreads > 0 ? S->nthreads : 1;
    float *gu = M->scratch, *a = gu + B * 2 * I, *g = a + B * I;      /* gu: [B, 2I], a: [B, I], g: [B] */
    if ((rc = lin_apply(&M->gate_up, S->h, B, gu, nt, S->xq, S->xd, S->cap_B))) return rc;
    tm_moe_t act = {0};
    act.I = (int32_t)I, act.act = M->act, act.limit = M->limit;
    for (long b = 0; b < B; b++) {
        swiglu_row(&act, gu + b * 2 * I, 0);                             /* gu[b, :I] = act(gate, up) */
        memcpy(a + b * I, gu + b * 2 * I, I * sizeof(float));
    }
    if ((rc = lin_apply(&M->down, a, B, S->tmp, nt, S->xq, S->xd, S->cap_B))) return rc;   /* tmp: [B, H] */
    if (M->gate.W && (rc = lin_apply(&M->gate, S->h, B, g, nt, S->xq, S->xd, S->cap_B))) return rc;
    for (long b = 0; b < B; b++) {
        const float s = M->gate.W ? sigmoid1(g[b]) : 1.0f;
        float *x = S->x + b * H;
        const float *t = S->tmp + b * H;
        if (M->gate.W)
            for (long i = 0; i < H; i++) x[i] += t[i] * s;
        else
            for (long i = 0; i < H; i++) x[i] += t[i];
    }
    return 0;
}

/* A decode step's consecutive fused layers in one call, where Python made four to six calls per layer (the token
 * mixer, the experts' pointers and rows, tm_moe, the MLP) around the store's bookkeeping: each layer's block (x +=
 * mixer, h = post norm, routing, dispatch), then its routed experts - read from the layer's residency table - through
 * tm_moe into x, then its shared experts or dense MLP through tm_mlp_block. The routing of each layer is copied out
 * (ids, used, counts) for the caller's bookkeeping after the call (the store's requests, the recorded trace: the
 * caller calls this only while every expert is resident and nothing moves, so the requests can follow the compute).
 * *done: the layers completed. A layer that routes to an expert its table lacks, or gives an expert more rows than
 * max_rows, stops the call after its block (return 0, *done = its index, its dispatch in S as tm_attn_block leaves
 * it): the caller runs its experts the general way and calls again from the next layer. An error code: the layer
 * *done refused (what it wrote before stays). */
int tm_decode_layers(const tm_fused_layer_t *layers, int64_t n, const tm_step_t *S, int64_t *done) {
    if (!layers || !S || !done) return TM_E_NULL;
    *done = 0;
    if (n < 0) return TM_E_ARG;
    for (int64_t i = 0; i < n; i++) {
        const tm_fused_layer_t *F = layers + i;
        if (!F->L || F->kind < 0 || F->kind > 2 || (F->kind && !F->ext)) return TM_E_ARG;
        tm_step_t St = *S;
        if (F->write) {                                 /* a window ring's rows in place of the paged ones */
            if (!F->read || !F->pos) return TM_E_NULL;
            St.write = F->write, St.read = F->read, St.pos = F->pos, St.n = F->n;
        }
        int rc = F->kind == 0 ? tm_attn_block(F->L, &St)
               : F->kind == 1 ? tm_mla_block(F->L, (const tm_mla_t *)F->ext, &St)
               : tm_gdn_block(F->L, (const tm_gdn_t *)F->ext, &St);
        if (rc) return rc;
        const long B = S->B;
        if (F->moe && B) {
            const tm_layer_t *L = F->L;
            const long k = L->k, E = L->E, nu = *S->n_used;
            if (L->router < 0 || !F->table || !F->ptrs || !F->ids || !F->used || !F->counts || !F->n_used) return TM_E_NULL;
            if (nu < 0 || nu > E) return TM_E_ARG;
            memcpy(F->ids, S->ids, B * k * sizeof(int64_t));
            memcpy(F->used, S->used, nu * sizeof(int64_t));
            memcpy(F->counts, S->rows, nu * sizeof(int64_t));
            *F->n_used = nu;
            for (long j = 0; j < nu; j++) {
                const int64_t e = S->used[j], *t = F->table + e * P_N;
                if (e < 0 || e >= E) return TM_E_ARG;
                if (!t[P_GATE_W] || S->rows[j] > F->max_rows) return 0;        /* *done = i: the caller takes over */
                memcpy(F->ptrs + j * P_N, t, P_N * sizeof(int64_t));
            }
            tm_moe_t a = *F->moe;
            a.n_exp = (int32_t)nu, a.nthreads = S->nthreads;
            a.row0 = S->row0, a.rows = S->rows, a.ptrs = F->ptrs;
            a.xin = S->h, a.tok = S->tok, a.back = S->back, a.wts = S->wts, a.out = S->x;
            a.T = B, a.k = k, a.out_add = 1, a.n_in = B, a.n_rows = B * k;
            const long t0 = F->moe_ns ? now_ns() : 0;
            if ((rc = tm_moe(&a))) return rc;
            if (F->moe_ns) *F->moe_ns = now_ns() - t0;
        }
        if (F->mlp && (rc = tm_mlp_block(F->mlp, S))) return rc;
        *done = i + 1;
    }
    return 0;
}
