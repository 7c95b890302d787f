/* The host kernels' C interface (moe_cpu.c): the formats, the argument structs of the expert and quantized-linear
 * entry points, and their prototypes. runtime/kernels/__init__.py mirrors them with ctypes (MoEArgs, LinArgs);
 * tests/runtime/kernels_driver.c calls them from C (the aarch64 build under qemu). tm_version() is the ABI's
 * number: a change here that moves a field bumps it. */
#ifndef TM_MOE_CPU_H
#define TM_MOE_CPU_H
#include <stdint.h>

enum { F_F32 = 0, F_BF16 = 1, F_F16 = 2, F_MXFP4 = 3, F_INT4 = 4, F_FP8 = 5, F_INT8 = 6 };
enum { S_F32 = 0, S_BF16 = 1, S_F16 = 2 };
enum { P_GATE_W, P_GATE_S, P_UP_W, P_UP_S, P_DOWN_W, P_DOWN_S, P_GU_BIAS, P_DOWN_BIAS, P_N };

typedef struct {
    int32_t fmt;          /* F_* of the expert matrices */
    int32_t sfmt;         /* S_* of int4 scales */
    int32_t group;        /* int4 elements per scale (a multiple of 32); mxfp4: 32 */
    int32_t bo, bi;       /* fp8 scale tile (rows, cols) */
    int32_t bias_fmt;     /* -1: no biases, else F_F32 / F_BF16 / F_F16 */
    int32_t act;          /* 0: silu(gate) * up; 1: gpt-oss clamped SwiGLU; 2: silu(min(gate, limit)) * clamp(up, +-limit) */
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
    int32_t out_add;      /* out += the weighted sum instead of out = (the residual stream, in place) */
    /* What the buffers hold, as the caller allocated them: checked against row0 / rows / tok / back
     * before any work, so a bad index is an error code rather than a write past a buffer. */
    int64_t n_rows;       /* rows of x and y (and entries of tok, when given) */
    int64_t scratch_rows; /* rows of h (and of xq / xd with q8) */
    int64_t n_in;         /* rows of xin (gather): every tok < n_in */
} tm_moe_t;

/* ---- quantized dense weights (--dense-quant: int8 / int4 as the int8 / int4 expert formats) --------
 * y[n, N] = x[n, K] @ W^T (+ bias), W [N, K] codes with scales S: the experts' row kernels over one
 * matrix, output rows split across threads; q8: the rows of x quantized to 8 bits first. */
typedef struct {
    int32_t fmt, sfmt, group, q8, nthreads;
    int64_t n, K, N;
    const float *x;
    float *y;
    const void *W, *S;
    const float *bias;    /* [N] float32 or NULL */
    int8_t *xq;           /* q8 scratch [xq_rows, K] */
    float *xd;            /* q8 scales [xq_rows, tm_q8_ldd(K)] */
    int64_t xq_rows;      /* rows xq / xd hold (q8): n <= xq_rows */
} tm_lin_t;

int tm_version(void);
int tm_isa(void);
int64_t tm_q8_ldd(int64_t K);
int tm_moe(const tm_moe_t *a);
int tm_linear_q(const tm_lin_t *l);
int tm_linear_bf16(const float *x, int64_t n, int64_t K, const uint16_t *W, int64_t N, float *y, int32_t nthreads);
int tm_rms_norm(const float *x, int64_t rows, int64_t D, const float *w, int64_t G, float eps, float *out);
int tm_gqa_decode(float *qk, int64_t qk_ld, const float *v, int64_t v_ld, const float *cos, const float *ssin,
                  int64_t rd, float *K, float *V, int64_t slots, const int64_t *write, const int64_t *read, int64_t n,
                  const int64_t *pos, int64_t B, int64_t nh, int64_t nkv, int64_t hd, float scale,
                  const float *sinks, float *out, float *scratch, int32_t nthreads);
const char *tm_strerror(int code);
#endif
