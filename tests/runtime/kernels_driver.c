/* Calls the host kernels from C, for a build the test process cannot load: the aarch64 build, run under
 * qemu-aarch64 on an x86 machine (tests/runtime/test_kernels_aarch64.py). The same driver, compiled for this
 * machine, runs the x86 build on the same inputs, so the two are compared output for output; where a case has
 * a reference written here from the formats' definitions (dequantize, then float64 sums), both are held to it.
 *
 * Cases: the quantized and bf16 linears, RMSNorm, the grouped expert call, GQA decode over a paged cache and a
 * linear-attention layer's decode (tm_gdn_block: Gated DeltaNet and KDA, the state arena in place), a gated shared
 * expert (tm_mlp_block).
 * Usage: kernels_driver LIBRARY.so OUT.bin. Inputs come from a fixed xorshift generator (the same on every
 * machine). Each case appends one record to OUT.bin: name (char[48]), n (int64), n float32 outputs, nref
 * (int64: n or 0), nref float32 reference values. Exit status: 0, or 2 when the library or a call fails. */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "moe_cpu.h"

static struct {
    int (*version)(void), (*isa)(void), (*moe)(const tm_moe_t *), (*linear_q)(const tm_lin_t *);
    int64_t (*q8_ldd)(int64_t);
    int (*linear_bf16)(const float *, int64_t, int64_t, const uint16_t *, int64_t, float *, int32_t);
    int (*rms_norm)(const float *, int64_t, int64_t, const float *, int64_t, float, float *);
    int (*gqa_decode)(float *, int64_t, const float *, int64_t, const float *, const float *, int64_t, float *, float *,
                      int64_t, const int64_t *, const int64_t *, int64_t, const int64_t *, int64_t, int64_t, int64_t,
                      int64_t, float, const float *, float *, float *, int32_t);
    int (*gdn_block)(const tm_layer_t *, const tm_gdn_t *, const tm_step_t *);
    int (*mlp_block)(const tm_mlp_t *, const tm_step_t *);
} K;
static FILE *out;

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t)(rng >> 16); }
static float unif(void) { return (float)(next() % 2000001) / 1e6f - 1.0f; }          /* [-1, 1] */
static void fill(float *x, long n) { for (long i = 0; i < n; i++) x[i] = unif(); }
static void *xmalloc(size_t n) { void *p = calloc(1, n ? n : 1); if (!p) { perror("calloc"); exit(2); } return p; }

/* ---- the formats, by their definitions ---------------------------------------------------------------------- */
static float bf16_val(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t bf16_of(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }   /* truncated */
static float f16_val(uint16_t h) {    /* IEEE half: sign, 5-bit exponent (bias 15), 10-bit mantissa */
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e ? ldexpf(1.0f + m / 1024.0f, e - 15) : ldexpf(m / 1024.0f, -14);
    return (h >> 15) ? -v : v;
}
static uint16_t f16_rand(void) { return (uint16_t)(((next() & 1) << 15) | ((10 + next() % 6) << 10) | (next() % 1024)); }
static const float E2M1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
enum { SFMT_E8M0 = 99 };

/* A quantized matrix [rows, cols] in one of the kernels' formats, and its values. */
typedef struct { int fmt, sfmt, group; long rows, cols; void *W, *S; float *val; } qmat;

static qmat qmat_make(int fmt, int sfmt, int group, long rows, long cols) {
    qmat q = {fmt, fmt == F_MXFP4 ? SFMT_E8M0 : sfmt, fmt == F_MXFP4 ? 32 : group, rows, cols, 0, 0, 0};
    const long ng = cols / q.group;
    q.val = xmalloc(sizeof(float) * rows * cols);
    q.S = xmalloc((size_t)rows * ng * 4);
    if (fmt == F_INT8) q.W = xmalloc((size_t)rows * cols);
    else q.W = xmalloc((size_t)rows * cols / 2);
    for (long r = 0; r < rows; r++)
        for (long g = 0; g < ng; g++) {
            float s;
            if (q.sfmt == SFMT_E8M0) { uint8_t b = (uint8_t)(122 + next() % 6); ((uint8_t *)q.S)[r * ng + g] = b; s = ldexpf(1.0f, b - 127); }
            else if (q.sfmt == S_F32) { s = unif() * 0.05f; ((float *)q.S)[r * ng + g] = s; }
            else if (q.sfmt == S_BF16) { uint16_t b = bf16_of(unif() * 0.05f); ((uint16_t *)q.S)[r * ng + g] = b; s = bf16_val(b); }
            else { uint16_t h = f16_rand(); ((uint16_t *)q.S)[r * ng + g] = h; s = f16_val(h); }
            for (long c = g * q.group; c < (g + 1) * q.group; c++) {
                float v;
                if (fmt == F_INT8) { int8_t code = (int8_t)((int)(next() % 255) - 127); ((int8_t *)q.W)[r * cols + c] = code; v = code; }
                else {
                    uint8_t code = (uint8_t)(next() & 15), *b = (uint8_t *)q.W + (r * cols + c) / 2;
                    *b = (c & 1) ? (uint8_t)((*b & 0x0F) | (code << 4)) : (uint8_t)((*b & 0xF0) | code);
                    v = fmt == F_MXFP4 ? E2M1[code] : (float)((int)code - 8);
                }
                q.val[r * cols + c] = v * s;
            }
        }
    return q;
}
static void qmat_free(qmat *q) { free(q->W); free(q->S); free(q->val); }

static void record(const char *name, const float *y, long n, const float *ref) {
    char nm[48] = {0};
    strncpy(nm, name, sizeof nm - 1);
    int64_t nn = n, nr = ref ? n : 0;
    fwrite(nm, 1, sizeof nm, out);
    fwrite(&nn, 8, 1, out);
    fwrite(y, 4, (size_t)n, out);
    fwrite(&nr, 8, 1, out);
    if (ref) fwrite(ref, 4, (size_t)n, out);
}
static void check(int rc, const char *what) { if (rc) { fprintf(stderr, "%s: error %d\n", what, rc); exit(2); } }

/* The kernels' 8-bit activations (q8, llama.cpp's Q8_0): per 32 values d = max|v| / 127 and v = d * round(v / d),
 * rounding to nearest even; x [n, K] -> a copy holding the values the integer dots see. */
static float *q8_values(const float *x, long n, long Kd) {
    float *q = xmalloc(4 * n * Kd);
    for (long c = 0; c < n * Kd / 32; c++) {
        const float *v = x + 32 * c;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) q[32 * c + j] = d * (float)lrintf(v[j] * id);
    }
    return q;
}

/* y[n, N] = x[n, K] @ val^T in float64 */
static void ref_matmul_t(const float *x, long n, long Kd, const float *val, long N, float *y) {
    for (long r = 0; r < n; r++)
        for (long o = 0; o < N; o++) {
            double s = 0;
            for (long k = 0; k < Kd; k++) s += (double)x[r * Kd + k] * val[o * Kd + k];
            y[r * N + o] = (float)s;
        }
}

static void case_linear_q(int fmt, int sfmt, int group, int q8, long n) {
    const long Kd = 256, N = 37;
    qmat q = qmat_make(fmt, sfmt, group, N, Kd);
    float *x = xmalloc(4 * n * Kd), *y = xmalloc(4 * n * N), *ref = xmalloc(4 * n * N);
    fill(x, n * Kd);
    tm_lin_t l;
    memset(&l, 0, sizeof l);
    l.fmt = fmt; l.sfmt = sfmt; l.group = q.group; l.q8 = q8; l.nthreads = 2; l.n = n; l.K = Kd; l.N = N;
    l.x = x; l.y = y; l.W = q.W; l.S = q.S;
    l.xq = xmalloc((size_t)n * Kd); l.xd = xmalloc(4 * (size_t)n * K.q8_ldd(Kd)); l.xq_rows = n;
    check(K.linear_q(&l), "tm_linear_q");
    float *xr = q8 ? q8_values(x, n, Kd) : x;
    ref_matmul_t(xr, n, Kd, q.val, N, ref);
    if (q8) free(xr);
    char name[48];
    snprintf(name, sizeof name, "linear_q/fmt%d/s%d/g%d/q8%d/n%ld", fmt, sfmt, q.group, q8, n);
    record(name, y, n * N, ref);
    free(x); free(y); free(ref); free(l.xq); free(l.xd); qmat_free(&q);
}

static void case_linear_bf16(long n) {
    const long Kd = 200, N = 37;
    uint16_t *W = xmalloc(2 * N * Kd);
    float *val = xmalloc(4 * N * Kd), *x = xmalloc(4 * n * Kd), *y = xmalloc(4 * n * N), *ref = xmalloc(4 * n * N);
    for (long i = 0; i < N * Kd; i++) { W[i] = bf16_of(unif()); val[i] = bf16_val(W[i]); }
    fill(x, n * Kd);
    check(K.linear_bf16(x, n, Kd, W, N, y, 2), "tm_linear_bf16");
    ref_matmul_t(x, n, Kd, val, N, ref);
    char name[48];
    snprintf(name, sizeof name, "linear_bf16/n%ld", n);
    record(name, y, n * N, ref);
    free(W); free(val); free(x); free(y); free(ref);
}

static void case_rms_norm(long G) {
    const long rows = 6, D = 100;
    float *x = xmalloc(4 * rows * D), *w = xmalloc(4 * G * D), *y = xmalloc(4 * rows * D), *ref = xmalloc(4 * rows * D);
    fill(x, rows * D);
    fill(w, G * D);
    check(K.rms_norm(x, rows, D, w, G, 1e-6f, y), "tm_rms_norm");
    for (long r = 0; r < rows; r++) {
        double ss = 0;
        for (long i = 0; i < D; i++) ss += (double)x[r * D + i] * x[r * D + i];
        const double inv = 1.0 / sqrt(ss / D + 1e-6);
        for (long i = 0; i < D; i++) ref[r * D + i] = (float)(w[(r % G) * D + i] * (x[r * D + i] * inv));
    }
    char name[48];
    snprintf(name, sizeof name, "rms_norm/G%ld", G);
    record(name, y, rows * D, ref);
    free(x); free(w); free(y); free(ref);
}

/* Three experts of 1, 3 and 4 rows (the kernels' one- to four-row paths): SwiGLU silu(x Wg) * (x Wu) then Wd. */
static void case_moe(int fmt, int sfmt, int q8) {
    const int Hin = 128, I = 96, Hout = 64, E = 3;
    const int64_t row0[3] = {0, 1, 4}, rows[3] = {1, 3, 4};
    const long n = 8;
    int64_t ptrs[3 * P_N];
    memset(ptrs, 0, sizeof ptrs);
    float *gv[3], *uv[3], *dv[3];                 /* values: gate / up [I, Hin], down [Hout, I] */
    qmat qs[9];
    void *dense_w[6] = {0};
    for (int e = 0; e < E; e++) {
        if (fmt == F_BF16) {                      /* input-major: gate|up fused [Hin, 2I], down [I, Hout] */
            uint16_t *gu = xmalloc(2 * (size_t)Hin * 2 * I), *dw = xmalloc(2 * (size_t)I * Hout);
            gv[e] = xmalloc(4 * I * Hin); uv[e] = xmalloc(4 * I * Hin); dv[e] = xmalloc(4 * Hout * I);
            for (int i = 0; i < Hin; i++)
                for (int j = 0; j < 2 * I; j++) {
                    uint16_t b = bf16_of(unif() * 0.2f);
                    gu[i * 2 * I + j] = b;
                    if (j < I) gv[e][j * Hin + i] = bf16_val(b); else uv[e][(j - I) * Hin + i] = bf16_val(b);
                }
            for (int i = 0; i < I; i++)
                for (int o = 0; o < Hout; o++) { uint16_t b = bf16_of(unif() * 0.2f); dw[i * Hout + o] = b; dv[e][o * I + i] = bf16_val(b); }
            ptrs[e * P_N + P_GATE_W] = (int64_t)(intptr_t)gu;
            ptrs[e * P_N + P_DOWN_W] = (int64_t)(intptr_t)dw;
            dense_w[2 * e] = gu; dense_w[2 * e + 1] = dw;
        } else {                                  /* output-major codes and scales */
            qs[3 * e] = qmat_make(fmt, sfmt, 32, I, Hin);
            qs[3 * e + 1] = qmat_make(fmt, sfmt, 32, I, Hin);
            qs[3 * e + 2] = qmat_make(fmt, sfmt, 32, Hout, I);
            gv[e] = qs[3 * e].val; uv[e] = qs[3 * e + 1].val; dv[e] = qs[3 * e + 2].val;
            int64_t *p = ptrs + e * P_N;
            p[P_GATE_W] = (int64_t)(intptr_t)qs[3 * e].W; p[P_GATE_S] = (int64_t)(intptr_t)qs[3 * e].S;
            p[P_UP_W] = (int64_t)(intptr_t)qs[3 * e + 1].W; p[P_UP_S] = (int64_t)(intptr_t)qs[3 * e + 1].S;
            p[P_DOWN_W] = (int64_t)(intptr_t)qs[3 * e + 2].W; p[P_DOWN_S] = (int64_t)(intptr_t)qs[3 * e + 2].S;
        }
    }
    float *x = xmalloc(4 * n * Hin), *y = xmalloc(4 * n * Hout), *h = xmalloc(4 * n * 2 * I), *ref = xmalloc(4 * n * Hout);
    fill(x, n * Hin);
    const long ldq = Hin > I ? Hin : I;
    tm_moe_t a;
    memset(&a, 0, sizeof a);
    a.fmt = fmt; a.sfmt = sfmt; a.group = 32; a.bias_fmt = -1; a.act = 0; a.H_in = Hin; a.I = I; a.H_out = Hout;
    a.n_exp = E; a.nthreads = 2; a.row0 = row0; a.rows = rows; a.ptrs = ptrs; a.x = x; a.y = y; a.h = h; a.q8 = q8;
    a.xq = xmalloc((size_t)n * ldq); a.xd = xmalloc(4 * (size_t)n * K.q8_ldd(ldq)); a.n_rows = n; a.scratch_rows = n;
    check(K.moe(&a), "tm_moe");
    /* The activation between the two halves (h [rows, :I] holds it after the call) against its reference; the down
     * projection's reference then starts from the kernel's own activation: with 8-bit activations a value that
     * lands within float rounding of a half step may round to the other code in the two (a step of the block's
     * scale), which is the q8 rule applied to equal-but-for-rounding inputs, not an error of the down projection. */
    float *g = xmalloc(4 * I), *u = xmalloc(4 * I), *act = xmalloc(4 * n * I), *act_ref = xmalloc(4 * n * I);
    const int qa = q8 && fmt != F_BF16;
    for (int e = 0; e < E; e++)
        for (long r = row0[e]; r < row0[e] + rows[e]; r++) {
            float *xr = qa ? q8_values(x + r * Hin, 1, Hin) : x + r * Hin;
            ref_matmul_t(xr, 1, Hin, gv[e], I, g);
            ref_matmul_t(xr, 1, Hin, uv[e], I, u);
            for (int j = 0; j < I; j++) act_ref[r * I + j] = (float)(g[j] / (1.0 + exp(-(double)g[j])) * u[j]);
            memcpy(act + r * I, h + r * 2 * I, 4 * (size_t)I);
            const float *in = qa ? act + r * I : act_ref + r * I;
            float *gr = qa ? q8_values(in, 1, I) : (float *)in;
            ref_matmul_t(gr, 1, I, dv[e], Hout, ref + r * Hout);
            if (qa) { free(xr); free(gr); }
        }
    char name[48];
    snprintf(name, sizeof name, "moe/fmt%d/s%d/q8%d/act", fmt, sfmt, q8);
    record(name, act, n * I, act_ref);
    snprintf(name, sizeof name, "moe/fmt%d/s%d/q8%d", fmt, sfmt, q8);
    record(name, y, n * Hout, ref);
    for (int e = 0; e < E; e++) {
        if (fmt == F_BF16) { free(gv[e]); free(uv[e]); free(dv[e]); free(dense_w[2 * e]); free(dense_w[2 * e + 1]); }
        else for (int i = 0; i < 3; i++) qmat_free(&qs[3 * e + i]);
    }
    free(x); free(y); free(h); free(ref); free(g); free(u); free(act); free(act_ref); free(a.xq); free(a.xd);
}

/* GQA decode over a paged cache: 3 sequences at positions 4, 8 and 11 of their 12 read slots (scattered), 8 query
 * heads on 2 kv heads of 64, rotate-half RoPE on the first 32 channels; with sinks (gpt-oss) or without. */
static void case_gqa(int with_sinks) {
    enum { B = 3, NH = 8, NKV = 2, HD = 64, RD = 32, N = 12, SLOTS = 40 };
    const long ld = (NH + NKV) * HD;
    const int64_t pos[B] = {4, 8, 11};
    int64_t read[B * N], write[B];
    int perm[SLOTS];
    for (int i = 0; i < SLOTS; i++) perm[i] = i;
    for (int i = SLOTS - 1; i > 0; i--) { int j = (int)(next() % (uint32_t)(i + 1)), t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    for (int i = 0; i < B * N; i++) read[i] = perm[i];
    for (int b = 0; b < B; b++) write[b] = read[b * N + pos[b]];
    float *qk = xmalloc(4 * B * ld), *v = xmalloc(4 * B * NKV * HD), *cs = xmalloc(4 * B * RD), *sn = xmalloc(4 * B * RD);
    float *Kc = xmalloc(4 * SLOTS * NKV * HD), *Vc = xmalloc(4 * SLOTS * NKV * HD), sinks[NH];
    float *out = xmalloc(4 * B * NH * HD), *ref = xmalloc(4 * B * NH * HD), *scratch = xmalloc(4 * B * NH * N);
    fill(qk, B * ld); fill(v, B * NKV * HD); fill(Kc, SLOTS * NKV * HD); fill(Vc, SLOTS * NKV * HD); fill(sinks, NH);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < RD / 2; i++) {          /* angle a: cos a on both halves, sin a signed -, + */
            const double a = (pos[b] + 1) * pow(1e4, -2.0 * i / RD);
            cs[b * RD + i] = cs[b * RD + i + RD / 2] = (float)cos(a);
            sn[b * RD + i] = (float)-sin(a);
            sn[b * RD + i + RD / 2] = (float)sin(a);
        }
    /* the reference first, from copies: rotate q and the new k, write k and v, softmax(q k / sqrt(hd)) v */
    double *q = xmalloc(8 * B * ld), *kc = xmalloc(8 * SLOTS * NKV * HD), *vc = xmalloc(8 * SLOTS * NKV * HD);
    for (long i = 0; i < B * ld; i++) q[i] = qk[i];
    for (long i = 0; i < SLOTS * NKV * HD; i++) { kc[i] = Kc[i]; vc[i] = Vc[i]; }
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH + NKV; h++) {
            double *x = q + b * ld + h * HD, t[RD];
            for (int i = 0; i < RD; i++)
                t[i] = x[i] * cs[b * RD + i] + x[(i + RD / 2) % RD] * sn[b * RD + i];
            memcpy(x, t, sizeof t);
        }
        for (int i = 0; i < NKV * HD; i++) {
            kc[write[b] * NKV * HD + i] = q[b * ld + NH * HD + i];
            vc[write[b] * NKV * HD + i] = v[b * NKV * HD + i];
        }
        for (int h = 0; h < NH; h++) {
            const int kv = h / (NH / NKV);
            double p[N], mx = with_sinks ? sinks[h] : -INFINITY, sum = 0;
            for (int j = 0; j <= pos[b]; j++) {
                double s = 0;
                for (int i = 0; i < HD; i++) s += q[b * ld + h * HD + i] * kc[(read[b * N + j] * NKV + kv) * HD + i];
                p[j] = s / sqrt((double)HD);
                mx = p[j] > mx ? p[j] : mx;
            }
            if (with_sinks) sum += exp(sinks[h] - mx);
            for (int j = 0; j <= pos[b]; j++) { p[j] = exp(p[j] - mx); sum += p[j]; }
            for (int i = 0; i < HD; i++) {
                double o = 0;
                for (int j = 0; j <= pos[b]; j++) o += p[j] / sum * vc[(read[b * N + j] * NKV + kv) * HD + i];
                ref[b * NH * HD + h * HD + i] = (float)o;
            }
        }
    }
    check(K.gqa_decode(qk, ld, v, NKV * HD, cs, sn, RD, Kc, Vc, SLOTS, write, read, N, pos, B, NH, NKV, HD,
                       (float)(1.0 / sqrt((double)HD)), with_sinks ? sinks : 0, out, scratch, 2), "tm_gqa_decode");
    char name[48];
    snprintf(name, sizeof name, "gqa_decode/sinks%d", with_sinks);
    record(name, out, B * NH * HD, ref);
    free(qk); free(v); free(cs); free(sn); free(Kc); free(Vc); free(out); free(ref); free(scratch); free(q); free(kc); free(vc);
}

/* float32 input-major [K, N] weights (tm_lin_desc kind 0), scaled by 1/sqrt(K) */
static float *lin_make(tm_lin_desc *d, long Kd, long N) {
    float *w = xmalloc(4 * Kd * N);
    fill(w, Kd * N);
    for (long i = 0; i < Kd * N; i++) w[i] /= sqrtf((float)Kd);
    d->kind = 0, d->K = Kd, d->N = N, d->W = w;
    return w;
}
/* y[N] = x[K] @ w [K, N] in float64 */
static void ref_in_major(const double *x, long Kd, const float *w, long N, double *y) {
    for (long o = 0; o < N; o++) { double s = 0; for (long k = 0; k < Kd; k++) s += x[k] * w[k * N + o]; y[o] = s; }
}
static void ref_rms(double *x, long n, const float *w, double eps) {
    double ss = 0;
    for (long i = 0; i < n; i++) ss += x[i] * x[i];
    const double inv = 1.0 / sqrt(ss / n + eps);
    for (long i = 0; i < n; i++) x[i] *= inv * w[i];
}
static double sig(double v) { return 1.0 / (1.0 + exp(-v)); }
static double softplus(double v) { return v > 20 ? v : log1p(exp(v)); }

/* kind 0 Gated DeltaNet (hk 2, hv 4, dk 16, dv 8), 1 KDA (3 heads of 16, rank 6); two sequences on slots 3 and 0
 * of five; no router (the block stops at the logits). Records x after the call and the whole state arena. */
static void case_gdn(int kind) {
    enum { H = 48, E = 8, B = 2, W = 4, SLOTS = 5, RANK = 6 };
    const long hk = kind ? 3 : 2, hv = kind ? 3 : 4, dk = 16, dv = kind ? 16 : 8, kd = hk * dk, cd = 2 * kd + hv * dv;
    const long pw = cd + hv * dv + 2 * hv, width = kind ? 5 * hv * dk + hv + 2 * RANK : pw, Kmax = H > hv * dv ? H : hv * dv;
    const int64_t state[B] = {3, 0}, zero[B] = {0, 0};
    tm_layer_t L = {0};
    tm_gdn_t G = {0};
    tm_step_t S = {0};
    float in_norm[H], post_norm[H], norm[16], A_log[4], dt_bias[3 * 16];
    fill(in_norm, H); fill(post_norm, H); fill(norm, dv); fill(A_log, hv); fill(dt_bias, kind ? hv * dk : hv);
    for (int i = 0; i < H; i++) { in_norm[i] = fabsf(in_norm[i]) + 0.5f; post_norm[i] = fabsf(post_norm[i]) + 0.5f; }
    for (int i = 0; i < dv; i++) norm[i] = fabsf(norm[i]) + 0.5f;
    L.H = H, L.nh = (int32_t)hv, L.nkv = 1, L.hd = (int32_t)dk, L.E = E, L.k = 1, L.router = -1, L.eps = 1e-6f;
    L.in_norm = in_norm, L.post_norm = post_norm;
    float *Wo = lin_make(&L.o, hv * dv, H), *Wg = lin_make(&L.gate, H, E);
    G.kind = kind, G.hk = (int32_t)hk, G.hv = (int32_t)hv, G.dk = (int32_t)dk, G.dv = (int32_t)dv, G.W = W;
    G.rank = kind ? RANK : 0, G.norm_eps = 1e-6f;
    float *Win = lin_make(&G.in, H, kind ? cd : pw), *Wfa = 0, *Wfb = 0, *Wb = 0, *Wga = 0, *Wgb = 0;
    if (kind) {
        Wfa = lin_make(&G.f_a, H, RANK), Wfb = lin_make(&G.f_b, RANK, hv * dk), Wb = lin_make(&G.b, H, hv);
        Wga = lin_make(&G.g_a, H, RANK), Wgb = lin_make(&G.g_b, RANK, hv * dk);
    }
    float *conv = xmalloc(4 * cd * W), *R = xmalloc(4 * SLOTS * hv * dk * dv), *C = xmalloc(4 * SLOTS * cd * (W - 1));
    float *x = xmalloc(4 * B * H);
    fill(conv, cd * W); fill(R, SLOTS * hv * dk * dv); fill(C, SLOTS * cd * (W - 1)); fill(x, B * H);
    G.conv = conv, G.A_log = A_log, G.dt_bias = dt_bias, G.norm = norm, G.R = R, G.C = C, G.slots = SLOTS, G.state = state;
    float *h = xmalloc(4 * B * H), *qkv = xmalloc(4 * B * width), *att = xmalloc(4 * B * hv * dv), *tmp = xmalloc(4 * B * H);
    float *scores = xmalloc(4 * B * hv), *logits = xmalloc(4 * B * E), *wts = xmalloc(4 * B), *xd = xmalloc(4 * B * K.q8_ldd(Kmax));
    int8_t *xq = xmalloc(B * Kmax);
    S.B = B, S.n = 1, S.x = x, S.write = zero, S.read = zero, S.pos = zero, S.nthreads = 2;
    S.h = h, S.qkv = qkv, S.att = att, S.tmp = tmp, S.scores = scores, S.logits = logits, S.wts = wts, S.xq = xq, S.xd = xd;
    S.cap_B = B, S.cap_n = 1, S.cap_H = H, S.cap_qkv = width, S.cap_att = hv * dv, S.cap_heads = hv, S.cap_E = E;
    S.cap_k = 1, S.cap_K = Kmax;
    /* the reference, in float64 from copies */
    const long nR = SLOTS * hv * dk * dv;
    double *Rr = xmalloc(8 * nR), *Cr = xmalloc(8 * SLOTS * cd * (W - 1));
    float *xref = xmalloc(4 * B * H), *Rref = xmalloc(4 * nR);
    for (long i = 0; i < nR; i++) Rr[i] = R[i];
    for (long i = 0; i < SLOTS * cd * (W - 1); i++) Cr[i] = C[i];
    for (int b = 0; b < B; b++) {
        double hn[H], p[3 * 16 * 3 + 64], f[48], bt[4], gz[48], r1[RANK], o[4 * 16], y[H];
        for (int i = 0; i < H; i++) hn[i] = x[b * H + i];
        ref_rms(hn, H, in_norm, 1e-6);
        ref_in_major(hn, H, Win, kind ? cd : pw, p);
        if (kind) {
            ref_in_major(hn, H, Wfa, RANK, r1); ref_in_major(r1, RANK, Wfb, hv * dk, f);
            ref_in_major(hn, H, Wb, hv, bt);
            ref_in_major(hn, H, Wga, RANK, r1); ref_in_major(r1, RANK, Wgb, hv * dk, gz);
        } else {
            for (long i = 0; i < hv * dv; i++) gz[i] = p[cd + i];
            for (long i = 0; i < hv; i++) { bt[i] = p[cd + hv * dv + i]; f[i] = p[cd + hv * dv + hv + i]; }
        }
        double *cs = Cr + state[b] * cd * (W - 1);
        for (long c = 0; c < cd; c++) {
            double acc = p[c] * conv[c * W + W - 1];
            for (int j = 0; j < W - 1; j++) acc += cs[c * (W - 1) + j] * conv[c * W + j];
            for (int j = 0; j < W - 2; j++) cs[c * (W - 1) + j] = cs[c * (W - 1) + j + 1];
            cs[c * (W - 1) + W - 2] = p[c];
            p[c] = acc * sig(acc);
        }
        for (long g = 0; g < 2 * hk; g++) {
            double ss = 0;
            for (long i = 0; i < dk; i++) ss += p[g * dk + i] * p[g * dk + i];
            const double inv = 1.0 / sqrt(ss + 1e-6) / (g < hk ? sqrt((double)dk) : 1.0);
            for (long i = 0; i < dk; i++) p[g * dk + i] *= inv;
        }
        for (long hh = 0; hh < hv; hh++) {
            const long g = hh / (hv / hk);
            const double *q = p + g * dk, *k = p + kd + g * dk, *v = p + 2 * kd + hh * dv, beta = sig(bt[hh]);
            double *M = Rr + (state[b] * hv + hh) * dk * dv, u[16];
            for (long i = 0; i < dk; i++) {
                const double dec = exp(-exp(A_log[hh]) * softplus(kind ? f[hh * dk + i] + dt_bias[hh * dk + i] : f[hh] + dt_bias[hh]));
                for (long j = 0; j < dv; j++) M[i * dv + j] *= dec;
            }
            for (long j = 0; j < dv; j++) {
                double s = 0;
                for (long i = 0; i < dk; i++) s += M[i * dv + j] * k[i];
                u[j] = beta * (v[j] - s);
            }
            for (long i = 0; i < dk; i++)
                for (long j = 0; j < dv; j++) M[i * dv + j] += k[i] * u[j];
            for (long j = 0; j < dv; j++) {
                double s = 0;
                for (long i = 0; i < dk; i++) s += M[i * dv + j] * q[i];
                o[hh * dv + j] = s;
            }
            ref_rms(o + hh * dv, dv, norm, 1e-6);
            for (long j = 0; j < dv; j++) {
                const double z = gz[hh * dv + j];
                o[hh * dv + j] *= kind ? sig(z) : z * sig(z);
            }
        }
        ref_in_major(o, hv * dv, Wo, H, y);
        for (int i = 0; i < H; i++) xref[b * H + i] = (float)(x[b * H + i] + y[i]);
    }
    for (long i = 0; i < nR; i++) Rref[i] = (float)Rr[i];
    check(K.gdn_block(&L, &G, &S), "tm_gdn_block");
    char name[48];
    snprintf(name, sizeof name, "gdn_block/kind%d/x", kind);
    record(name, x, B * H, xref);
    snprintf(name, sizeof name, "gdn_block/kind%d/state", kind);
    record(name, R, nR, Rref);
    free(Wo); free(Wg); free(Win); free(Wfa); free(Wfb); free(Wb); free(Wga); free(Wgb); free(conv); free(R); free(C);
    free(x); free(h); free(qkv); free(att); free(tmp); free(scores); free(logits); free(wts); free(xd); free(xq);
    free(Rr); free(Cr); free(xref); free(Rref);
}

/* A gated shared expert (tm_mlp_block): x += sigmoid(h . w_gate) down(silu(h W_g) * (h W_u)) on two post-norm rows. */
static void case_mlp(void) {
    enum { H = 64, I = 96, B = 2 };
    tm_mlp_t M = {0};
    tm_step_t S = {0};
    M.H = H, M.I = I;
    float *Wgu = lin_make(&M.gate_up, H, 2 * I), *Wd = lin_make(&M.down, I, H), *Wg = lin_make(&M.gate, H, 1);
    float *x = xmalloc(4 * B * H), *h = xmalloc(4 * B * H), *tmp = xmalloc(4 * B * H), *xref = xmalloc(4 * B * H);
    float *scratch = xmalloc(4 * B * (3 * I + 1)), *xd = xmalloc(4 * B * K.q8_ldd(I));
    int8_t *xq = xmalloc(B * I);
    fill(x, B * H); fill(h, B * H);
    M.scratch = scratch, M.scratch_n = B * (3 * I + 1);
    S.B = B, S.x = x, S.h = h, S.tmp = tmp, S.xq = xq, S.xd = xd, S.nthreads = 2;
    S.cap_B = B, S.cap_H = H, S.cap_K = I;
    for (int b = 0; b < B; b++) {
        double hh[H], gu[2 * I], a[I], y[H], g;
        for (int i = 0; i < H; i++) hh[i] = h[b * H + i];
        ref_in_major(hh, H, Wgu, 2 * I, gu);
        for (int j = 0; j < I; j++) a[j] = gu[j] * sig(gu[j]) * gu[I + j];
        ref_in_major(a, I, Wd, H, y);
        ref_in_major(hh, H, Wg, 1, &g);
        for (int i = 0; i < H; i++) xref[b * H + i] = (float)(x[b * H + i] + sig(g) * y[i]);
    }
    check(K.mlp_block(&M, &S), "tm_mlp_block");
    record("mlp_block/gated", x, B * H, xref);
    free(Wgu); free(Wd); free(Wg); free(x); free(h); free(tmp); free(xref); free(scratch); free(xd); free(xq);
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s LIBRARY.so OUT.bin\n", argv[0]); return 2; }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 2; }
#define SYM(f, s) if (!(*(void **)&K.f = dlsym(lib, s))) { fprintf(stderr, "no %s\n", s); return 2; }
    SYM(version, "tm_version") SYM(isa, "tm_isa") SYM(moe, "tm_moe") SYM(linear_q, "tm_linear_q")
    SYM(q8_ldd, "tm_q8_ldd") SYM(linear_bf16, "tm_linear_bf16") SYM(rms_norm, "tm_rms_norm")
    SYM(gqa_decode, "tm_gqa_decode") SYM(gdn_block, "tm_gdn_block")
    SYM(mlp_block, "tm_mlp_block")
    if (!(out = fopen(argv[2], "wb"))) { perror(argv[2]); return 2; }
    printf("abi %d isa %d\n", K.version(), K.isa());
    static const long ns[] = {1, 2, 3, 4, 5, 8};
    for (int q8 = 0; q8 < 2; q8++)
        for (unsigned i = 0; i < sizeof ns / sizeof *ns; i++) {
            for (int s = S_F32; s <= S_F16; s++) case_linear_q(F_INT4, s, 32, q8, ns[i]);
            case_linear_q(F_INT4, S_BF16, 64, q8, ns[i]);
            case_linear_q(F_MXFP4, 0, 32, q8, ns[i]);
            case_linear_q(F_INT8, S_F16, 32, q8, ns[i]);
        }
    for (long n = 1; n <= 5; n++) case_linear_bf16(n);
    case_rms_norm(1);
    case_rms_norm(3);
    case_gqa(0);
    case_gqa(1);
    case_gdn(0);
    case_gdn(1);
    case_mlp();
    case_moe(F_BF16, 0, 0);
    for (int q8 = 0; q8 < 2; q8++) {
        case_moe(F_INT4, S_BF16, q8);
        case_moe(F_MXFP4, 0, q8);
        case_moe(F_INT8, S_F16, q8);
    }
    fclose(out);
    return 0;
}
