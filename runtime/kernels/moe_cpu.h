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

/* ---- the fused decode layers (runtime/model/layers/fused.py mirrors these with ctypes) ------------------ */
/* one dense projection as a layer holds it */
typedef struct {
    int32_t kind;         /* 0: float32 input-major wt [K, N]; 1: bf16 [N, K]; 2: quantized codes W / scales S [N, K] */
    int32_t fmt, sfmt, group, q8;
    int64_t K, N;
    const void *W, *S;
    const float *bias;    /* [N] float32 or NULL */
} tm_lin_desc;

/* a decoder layer's own arguments: its attention's sizes, norms, projections and cache, and its router */
typedef struct {
    int32_t H, nh, nkv, hd, rd;       /* rd: rotary channels of a head (RoPE on the first rd) */
    int32_t qk_norm;                  /* 0 none, 1 per head ([nh + nkv, hd] weights), 2 over q and k ([nh hd], [nkv hd]) */
    int32_t E, k, router, renorm, n_group, topk_group;
    float eps, scale, route_scale;
    const float *in_norm, *post_norm, *q_norm, *k_norm, *correction;
    tm_lin_desc qkv, o, gate;         /* gate: the router (W NULL with router -1: a dense layer, stop at the post norm) */
    float *K, *V;                     /* this layer's cache [slots, nkv, hd] */
    int64_t slots;                    /* rows of K / V: every write and read slot is below it */
    const float *sinks;               /* [nh] attention sinks (gpt-oss), or NULL */
    int32_t gated;                    /* 1: qkv ends with a per-channel output gate [nh hd], att *= sigmoid(gate) (Qwen3-Next) */
} tm_layer_t;

/* one decode step's rows and scratch, shared by the step's fused layers */
typedef struct {
    int64_t B, n;                     /* sequences (one token each), keys per sequence read */
    float *x;                         /* [B, H] the residual stream, updated in place */
    const float *cos, *ssin;          /* [B, rd] */
    const int64_t *write, *read, *pos;  /* [B], [B, n], [B] */
    float *h, *qkv, *att, *tmp, *scores, *logits, *wts;
    int64_t *ids;                     /* [B, k] */
    int8_t *xq;
    float *xd;
    /* dispatch (out): experts with tokens ascending, their counts and first sorted rows; the token of
     * each sorted row and the sorted row of each (token, slot) */
    int64_t *n_used, *used, *counts, *row0, *rows, *tok, *back;
    int32_t nthreads;
    /* The scratch's sizes, as layers/fused.py's StepBuffers allocated it (each buffer a product of
     * these: h [cap_B, cap_H], qkv [cap_B, cap_qkv], att [cap_B, cap_att], scores [cap_B cap_heads cap_n],
     * logits [cap_B, cap_E], ids / wts / tok / back [cap_B cap_k], xq [cap_B cap_K], xd [cap_B,
     * tm_q8_ldd(cap_K)], used / counts / row0 / rows [cap_E]): a layer or a batch past one is refused. */
    int64_t cap_B, cap_n, cap_H, cap_qkv, cap_att, cap_heads, cap_E, cap_k, cap_K;
} tm_step_t;

/* a linear-attention token mixer's half of a layer (tm_gdn_block: Gated DeltaNet or KDA) */
typedef struct {
    int32_t kind;                     /* 0 Gated DeltaNet, 1 KDA */
    int32_t hk, hv, dk, dv;           /* key heads, value heads (a multiple of hk), their widths */
    int32_t W;                        /* the convolution's kernel (taps); the slot keeps the last W - 1 inputs */
    int32_t rank;                     /* KDA: the low-rank width of f_a / g_a */
    float norm_eps;                   /* the gated output norm's eps */
    tm_lin_desc in;                   /* GDN: h -> [2 hk dk + hv dv (conv'd: q | k | v) | hv dv (z) | hv (b) | hv (a)];
                                       * KDA: h -> [3 hv dk] (q | k | v) */
    tm_lin_desc f_a, f_b, b, g_a, g_b;  /* KDA: h -> rank -> hv dk (decay); h -> hv (beta); h -> rank -> hv dk (gate) */
    const float *conv;                /* [2 hk dk + hv dv, W] taps, oldest input first */
    const float *A_log, *dt_bias;     /* [hv]; dt_bias [hv] (GDN) or [hv dk] (KDA) */
    const float *norm;                /* [dv] */
    float *R;                         /* [slots, hv, dk, dv] the recurrent memory, float32 */
    float *C;                         /* [slots, 2 hk dk + hv dv, W - 1] the convolution's last inputs */
    int64_t slots;                    /* rows of R and C: every state slot is below it */
    const int64_t *state;             /* [B] each sequence's slot (distinct) */
} tm_gdn_t;

/* a dense SwiGLU MLP on the step's post-norm rows (tm_mlp_block): a MoE block's shared experts, or a dense
 * layer's MLP */
typedef struct {
    int32_t H, I;                     /* hidden, intermediate width */
    int32_t act;                      /* 0: silu(gate) * up; 2: silu(min(gate, limit)) * clamp(up, +-limit) */
    float limit;
    tm_lin_desc gate_up;              /* H -> [gate (I) | up (I)] */
    tm_lin_desc down;                 /* I -> H */
    tm_lin_desc gate;                 /* H -> 1: the output scaled by sigmoid of it (Qwen2-MoE / Qwen3-Next); W NULL: none */
    float *scratch;                   /* [scratch_n] floats: B (3 I + 1) are used */
    int64_t scratch_n;
} tm_mlp_t;

/* one fused layer of a decode step (tm_decode_layers) */
typedef struct {
    int32_t kind;                     /* its token mixer: 0 GQA (tm_attn_block), 1 MLA (tm_mla_block), 2 linear (tm_gdn_block) */
    int32_t max_rows;                 /* routed: the most rows an expert may have in the one-call path */
    const tm_layer_t *L;
    const void *ext;                  /* kind 1: its tm_mla_t, 2: its tm_gdn_t */
    const tm_mlp_t *mlp;              /* the shared experts, or the dense layer's MLP; NULL: none */
    const tm_moe_t *moe;              /* routed experts: tm_moe's arguments but the call's rows (formats, sizes, scratch
                                       * h / xq / xd / x / y for scratch_rows rows); NULL: a dense layer */
    const int64_t *table;             /* [E, P_N] each expert's part addresses where it is resident, 0 where it is not */
    int64_t *ptrs;                    /* [E, P_N] scratch: the used experts' parts */
    const int64_t *write, *read, *pos;  /* a window ring's addressing in place of the step's (write NULL: the step's) */
    int64_t n;                        /* keys per sequence the ring's read holds */
    int64_t *ids, *used, *counts, *n_used;   /* out: the routing ([cap_B k]), its experts ([E]), their rows, how many */
    int64_t *moe_ns;                  /* out: nanoseconds its experts took (NULL: not timed) */
} tm_fused_layer_t;

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
int tm_attn_block(const tm_layer_t *L, const tm_step_t *S);
int tm_gdn_block(const tm_layer_t *L, const tm_gdn_t *G, const tm_step_t *S);
int tm_mlp_block(const tm_mlp_t *M, const tm_step_t *S);
int tm_decode_layers(const tm_fused_layer_t *layers, int64_t n, const tm_step_t *S, int64_t *done);
const char *tm_strerror(int code);
#endif
