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
 * threads: OpenMP (the libgomp torch itself loaded: one thread pool), work split by output rows or
 * column blocks of every expert, so at decode's one token per expert both threads stream weights. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { F_F32 = 0, F_BF16 = 1, F_F16 = 2, F_MXFP4 = 3, F_INT4 = 4, F_FP8 = 5 };
enum { S_F32 = 0, S_BF16 = 1, S_F16 = 2 };
enum { P_GATE_W, P_GATE_S, P_UP_W, P_UP_S, P_DOWN_W, P_DOWN_S, P_GU_BIAS, P_DOWN_BIAS, P_N };

typedef struct {
    int32_t fmt;          /* F_* of the expert matrices */
    int32_t sfmt;         /* S_* of int4 scales */
    int32_t group;        /* int4 elements per scale (a multiple of 32); mxfp4: 32 */
    int32_t bo, bi;       /* fp8 scale tile (rows, cols) */
    int32_t bias_fmt;     /* -1: no biases, else F_F32 / F_BF16 / F_F16 */
    int32_t act;          /* 0: silu(gate) * up; 1: gpt-oss clamped SwiGLU */
    float limit, alpha;   /* act 1 */
    int32_t H_in, I, H_out;
    int32_t n_exp, nthreads;
    const int64_t *row0;  /* [n_exp] first row of each expert in x / y */
    const int64_t *rows;  /* [n_exp] its row count */
    const int64_t *ptrs;  /* [n_exp * P_N] addresses of its parts (0 where absent) */
    const float *x;       /* [*, H_in] */
    float *y;             /* [*, H_out] */
    float *h;             /* scratch [*, 2I], rows as x */
    int32_t q8;           /* mxfp4 / int4: activations quantized to 8 bits per 32 (llama.cpp's Q8_0), integer dots */
    int8_t *xq;           /* q8 scratch [*, max(H_in, I)] */
    float *xd;            /* q8 scales [*, max(H_in, I) / 32] */
    /* Optional gather and combine (decode: one call does the layer's whole routed part):
     * tok: [rows] token of each sorted row - x rows are then gathered from xin [T, H_in] into x;
     * back: [T * k] sorted row of each (token, slot), wts: [T * k] its weight; out: [T, H_out] =
     * sum over k of wts * y[back]. NULL: x is already sorted rows / y is the output. */
    const int64_t *tok;
    const float *xin;
    const int64_t *back;
    const float *wts;
    float *out;
    int64_t T, k;
} tm_moe_t;

int tm_version(void) { return 1; }

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
static void init_tables(void) {
    if (E8M0[1] != 0.0f) return;
    for (int s = 0; s < 255; s++) E8M0[s] = ldexpf(1.0f, s - 128);
    E8M0[255] = NAN;
}

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

static void dense_proj(int fmt, const void *W, long ldw, int K, long n0, long n1, const float *x, long ldx,
                       long nrows, float *y, long ldy) {
    for (long r = 0; r < nrows; r++) memset(y + r * ldy + n0, 0, (n1 - n0) * sizeof(float));
    for (long r = 0; r < nrows; r += 2) {
        const int R = nrows - r >= 2 ? 2 : 1;
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        for (long k = 0; k < K; k++) {
            if (fmt == F_BF16) { if (R == 2) axpy1(F_BF16, 2, W, ldw, k, n0, n1, xr, ldx, yr, ldy); else axpy1(F_BF16, 1, W, ldw, k, n0, n1, xr, ldx, yr, ldy); }
            else if (fmt == F_F32) { if (R == 2) axpy1(F_F32, 2, W, ldw, k, n0, n1, xr, ldx, yr, ldy); else axpy1(F_F32, 1, W, ldw, k, n0, n1, xr, ldx, yr, ldy); }
            else { if (R == 2) axpy1(F_F16, 2, W, ldw, k, n0, n1, xr, ldx, yr, ldy); else axpy1(F_F16, 1, W, ldw, k, n0, n1, xr, ldx, yr, ldy); }
        }
    }
}

/* ---- quantized output-major W [N, K]: y[r, o] = x[r] . w_o for o in [o0, o1) ------------------ */
static inline __attribute__((always_inline)) void nib_row(const int R, const uint8_t *wrow, const void *srow,
        int sfmt, int group, int mx, int K, __m128i lut, const float *x, long ldx, float *out, long ldo) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int per = group / 32, nc = K / 32;
    for (int c = 0; c < nc; c++) {
        float s = mx ? E8M0[((const uint8_t *)srow)[c]] : scale_at(srow, sfmt, per == 1 ? c : c / per);
        __m256 sv = _mm256_set1_ps(s), w[4];
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
            __m256 w = _mm256_mul_ps(fp8x8(wrow + k), sv);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * ldx + k), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(acc[r]);
}

/* ---- 8-bit activations (q8) for the nibble formats ------------------------------------------------
 * x [K] -> per 32 values one scale d = amax / 127 and q = round(x / d), stored with the even elements
 * first and the odd ones after (the order a byte's low and high nibbles give), so a 32-code chunk
 * multiplies without shuffles: maddubs on |w| and sign(q, w), as llama.cpp's Q4_0 x Q8_0 dot. */
static void q8_quantize(const float *x, int K, int8_t *q, float *d) {
    for (int c = 0; c < K / 32; c++) {
        const float *v = x + 32 * c;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
        d[c] = dd;
        for (int j = 0; j < 16; j++) {
            q[32 * c + j] = (int8_t)lrintf(v[2 * j] * id);
            q[32 * c + 16 + j] = (int8_t)lrintf(v[2 * j + 1] * id);
        }
    }
}

static inline __attribute__((always_inline)) __m256i nib_codes(const uint8_t *p, __m128i lut) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, m4));
    __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m4));
    return _mm256_set_m128i(hi, lo);                                   /* evens | odds, as x is stored */
}

static inline __attribute__((always_inline)) void nib_row_q8(const int R, const uint8_t *wrow, const void *srow,
        int sfmt, int group, int mx, int K, __m128i lut, const int8_t *xq, const float *xd, long ldq, long ldd,
        float *out, long ldo) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int per = group / 32, nc = K / 32;
    for (int c = 0; c < nc; c++) {
        float sw = mx ? E8M0[((const uint8_t *)srow)[c]] : scale_at(srow, sfmt, per == 1 ? c : c / per);
        __m256i w = nib_codes(wrow + 16 * c, lut);
        __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * ldq + 32 * c));
            __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sw * xd[r * ldd + c]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * ldo] = hsum(acc[r]);
}

static void quant_proj(const tm_moe_t *a, const void *W, const void *S, int N, int K, long o0, long o1,
                       const float *x, long ldx, const int8_t *xq, const float *xd, long nrows, float *y, long ldy) {
    const long ldq = a->H_in > a->I ? a->H_in : a->I, ldd = ldq / 32;
    const int mx = a->fmt == F_MXFP4;
    const __m128i lut = mx ? _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
                           : _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const int group = mx ? 32 : a->group;
    const long nbi = (K + a->bi - 1) / (a->bi > 0 ? a->bi : 1);
    for (long o = o0; o < o1; o++) {
        for (long r = 0; r < nrows;) {
            long R = nrows - r >= 4 ? 4 : nrows - r;
            const float *xr = x + r * ldx;
            float *yr = y + r * ldy + o;
            if (a->fmt == F_FP8) {
                const uint8_t *wrow = (const uint8_t *)W + o * (long)K;
                const float *srow = (const float *)S + (o / a->bo) * nbi;
                switch (R) {
                    case 4: fp8_row(4, wrow, srow, a->bi, K, xr, ldx, yr, ldy); break;
                    case 3: fp8_row(3, wrow, srow, a->bi, K, xr, ldx, yr, ldy); break;
                    case 2: fp8_row(2, wrow, srow, a->bi, K, xr, ldx, yr, ldy); break;
                    default: fp8_row(1, wrow, srow, a->bi, K, xr, ldx, yr, ldy);
                }
            } else if (xq) {
                const uint8_t *wrow = (const uint8_t *)W + o * (long)(K / 2);
                long ng = K / group, ssz = mx ? 1 : (a->sfmt == S_F32 ? 4 : 2);
                const void *srow = (const char *)S + o * ng * ssz;
                const int8_t *qr = xq + r * ldq;
                const float *dr = xd + r * ldd;
                switch (R) {
                    case 4: nib_row_q8(4, wrow, srow, a->sfmt, group, mx, K, lut, qr, dr, ldq, ldd, yr, ldy); break;
                    case 3: nib_row_q8(3, wrow, srow, a->sfmt, group, mx, K, lut, qr, dr, ldq, ldd, yr, ldy); break;
                    case 2: nib_row_q8(2, wrow, srow, a->sfmt, group, mx, K, lut, qr, dr, ldq, ldd, yr, ldy); break;
                    default: nib_row_q8(1, wrow, srow, a->sfmt, group, mx, K, lut, qr, dr, ldq, ldd, yr, ldy);
                }
            } else {
                const uint8_t *wrow = (const uint8_t *)W + o * (long)(K / 2);
                long ng = K / group, ssz = mx ? 1 : (a->sfmt == S_F32 ? 4 : 2);
                const void *srow = (const char *)S + o * ng * ssz;
                switch (R) {
                    case 4: nib_row(4, wrow, srow, a->sfmt, group, mx, K, lut, xr, ldx, yr, ldy); break;
                    case 3: nib_row(3, wrow, srow, a->sfmt, group, mx, K, lut, xr, ldx, yr, ldy); break;
                    case 2: nib_row(2, wrow, srow, a->sfmt, group, mx, K, lut, xr, ldx, yr, ldy); break;
                    default: nib_row(1, wrow, srow, a->sfmt, group, mx, K, lut, xr, ldx, yr, ldy);
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

int tm_moe(const tm_moe_t *a) {
    init_tables();
    const int dense = a->fmt <= F_F16, I = a->I, Hin = a->H_in, Hout = a->H_out;
    if (!dense && (Hin % 32 || I % 32)) return -1;
    if (a->fmt == F_INT4 && a->group % 32) return -2;
    if (a->fmt == F_FP8 && (a->bi % 8 || Hin % 8 || I % 8)) return -3;
    const int nt = a->nthreads > 0 ? a->nthreads : 1;
    /* Tasks. Dense: the fused gate|up [in, 2I] as one projection of width 2I, whole rows of W per task
     * (one sequential stream) unless the experts are too few to keep every thread busy, then column
     * blocks (multiples of 64). Quantized: gate and up apart, BLK_QUANT output rows per task. */
    long w1 = dense ? 2L * I : I, blk1 = BLK_QUANT, blk3 = BLK_QUANT;
    int np1 = dense ? 1 : 2;     /* projections in phase 1: fused, or gate and up */
    if (dense) {
        long split = a->n_exp >= nt ? 1 : (nt + a->n_exp - 1) / a->n_exp;
        blk1 = ((w1 + split - 1) / split + 63) / 64 * 64;
        blk3 = ((Hout + split - 1) / split + 63) / 64 * 64;
    }
    const long nb1 = (w1 + blk1 - 1) / blk1, nb3 = (Hout + blk3 - 1) / blk3;
    const long t1 = (long)a->n_exp * np1 * nb1, t3 = (long)a->n_exp * nb3;
    const int q8 = a->q8 && (a->fmt == F_MXFP4 || a->fmt == F_INT4);
    const long ldq = Hin > I ? Hin : I, ldd = ldq / 32;
    float *xrows = (float *)a->x;      /* the sorted rows: gathered into x first when tok is given */
#pragma omp parallel num_threads(nt)
    {
        if (a->tok) {
#pragma omp for schedule(static)
            for (long e = 0; e < a->n_exp; e++)
                for (long r = a->row0[e]; r < a->row0[e] + a->rows[e]; r++)
                    memcpy(xrows + r * Hin, a->xin + a->tok[r] * Hin, Hin * sizeof(float));
        }
        if (q8) {
#pragma omp for schedule(static)
            for (long e = 0; e < a->n_exp; e++)
                for (long r = a->row0[e]; r < a->row0[e] + a->rows[e]; r++)
                    q8_quantize(a->x + r * Hin, Hin, a->xq + r * ldq, a->xd + r * ldd);
        }
#pragma omp for schedule(static)
        for (long t = 0; t < t1; t++) {           /* gate and up of every expert */
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
                           q8 ? a->xq + r0 * ldq : 0, q8 ? a->xd + r0 * ldd : 0, nr, h + which * I, 2 * (long)I);
        }
#pragma omp for schedule(static)
        for (long e = 0; e < a->n_exp; e++)       /* the activation, in place over the gate half */
            for (long r = 0; r < a->rows[e]; r++) {
                long row = a->row0[e] + r;
                swiglu_row(a, a->h + row * 2 * (long)I,
                           a->bias_fmt >= 0 ? (const void *)(intptr_t)a->ptrs[e * P_N + P_GU_BIAS] : 0);
                if (q8) q8_quantize(a->h + row * 2 * (long)I, I, a->xq + row * ldq, a->xd + row * ldd);
            }
#pragma omp for schedule(static)
        for (long t = 0; t < t3; t++) {           /* down */
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
                           h, 2 * (long)I, q8 ? a->xq + r0 * ldq : 0, q8 ? a->xd + r0 * ldd : 0, nr, y, Hout);
            if (a->bias_fmt >= 0) {
                const void *bd = (const void *)(intptr_t)p[P_DOWN_BIAS];
                for (long r = 0; r < nr; r++)
                    for (long c = n0; c < n1; c++) y[r * Hout + c] += load1(a->bias_fmt, bd, c);
            }
        }
        if (a->out) {
#pragma omp for schedule(static)
            for (long t = 0; t < a->T; t++) {
                float *o = a->out + t * Hout;
                for (long j = 0; j < a->k; j++) {
                    const float *yr = a->y + a->back[t * a->k + j] * Hout;
                    const float wt = a->wts[t * a->k + j];
                    if (j == 0) for (long c = 0; c < Hout; c++) o[c] = wt * yr[c];
                    else for (long c = 0; c < Hout; c++) o[c] += wt * yr[c];
                }
            }
        }
    }
    return 0;
}

/* ---- RMSNorm: out[r] = w[r % G] * (x[r] / sqrt(mean(x[r]^2) + eps)), rows of D --------------------- */
int tm_rms_norm(const float *x, int64_t rows, int64_t D, const float *w, int64_t G, float eps, float *out) {
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
static inline __attribute__((always_inline)) void bf16_row(const int R, const uint16_t *w, long K,
        const float *x, float *y, long N) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) {
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

int tm_linear_bf16(const float *x, int64_t n, int64_t K, const uint16_t *W, int64_t N, float *y, int32_t nthreads) {
    const long nb = (N + 31) / 32;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (long b = 0; b < nb; b++) {
        long o1 = (b + 1) * 32 < N ? (b + 1) * 32 : N;
        for (long o = b * 32; o < o1; o++)
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
    return 0;
}


/* ---- GQA decode over the paged KV cache ------------------------------------------------------------
 * One call per attention layer and step: RoPE on q and k (x cos + roll(x, rd/2) x signed sin on the
 * first rd channels of each head), k and v written to their token slots, then for each sequence and
 * head softmax(q K^T * scale) V over the keys at read[b, 0..pos[b]].
 * qk: [B, nh + nkv, hd] (row stride qk_ld floats, rotated in place); v: [B, nkv, hd] (row stride v_ld);
 * cos, ssin: [B, rd] or NULL; K, V: [slots, nkv, hd]; write: [B]; read: [B, n]; out: [B, nh * hd]. */
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

int tm_gqa_decode(float *qk, int64_t qk_ld, const float *v, int64_t v_ld, const float *cos, const float *ssin,
                  int64_t rd, float *K, float *V, const int64_t *write, const int64_t *read, int64_t n,
                  const int64_t *pos, int64_t B, int64_t nh, int64_t nkv, int64_t hd, float scale, float *out,
                  float *scratch, int32_t nthreads) {
    const long half = rd / 2, g = nh / nkv;
    for (long b = 0; b < B; b++) {
        float *row = qk + b * qk_ld;
        if (cos) {
            const float *c = cos + b * rd, *sn = ssin + b * rd;
            float tmp[1024];
            for (long h = 0; h < nh + nkv; h++) {
                float *x = row + h * hd;
                for (long i = 0; i < rd; i++) tmp[i] = x[i];
                for (long i = 0; i < rd; i++) x[i] = tmp[i] * c[i] + tmp[i < half ? i + half : i - half] * sn[i];
            }
        }
        memcpy(K + write[b] * nkv * hd, row + nh * hd, nkv * hd * sizeof(float));
        memcpy(V + write[b] * nkv * hd, v + b * v_ld, nkv * hd * sizeof(float));
    }
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (long t = 0; t < B * nh; t++) {
        long b = t / nh, h = t % nh, kv = h / g, m = pos[b] + 1;
        const float *q = qk + b * qk_ld + h * hd;
        float *p = scratch + t * n;
        float mx = -INFINITY;
        for (long j = 0; j < m; j++) {
            p[j] = dot_f32(q, K + (read[b * n + j] * nkv + kv) * hd, hd) * scale;
            mx = p[j] > mx ? p[j] : mx;
        }
        float sum = 0.0f;
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
    return 0;
}
