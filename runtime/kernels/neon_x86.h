/* The x86 intrinsics moe_cpu.c's AVX2 path uses, written for aarch64 Advanced SIMD (NEON), so that one source
 * is the kernels of both machines: a 256-bit AVX2 register is a pair of 128-bit NEON registers (lo: elements
 * 0..3 / bytes 0..15, hi: the rest), a 128-bit one is one NEON register. Each function does what Intel's
 * Intrinsics Guide defines for the x86 instruction, bit for bit, on every input the kernels give it:
 *   - pshufb: index bit 7 set -> 0, else the low 4 bits (vqtbl1q gives 0 for an index >= 16: masked 0x8F);
 *   - pmaddubsw: unsigned x signed byte products (exact in 16 bits), adjacent pairs added with saturation;
 *   - pmaddwd: signed 16 x 16 products, adjacent pairs added in 32 bits;
 *   - psignb: -a where b < 0 (wrapping: -(-128) = -128), 0 where b == 0, a where b > 0;
 *   - minps / maxps: the second operand unless the first compares less / greater (so a NaN gives the second);
 *   - cvttps2dq: truncation toward zero (NEON saturates where x86 gives INT_MIN: never reached here).
 * Built by runtime/kernels/build.py for aarch64 (-march=armv8-a, the baseline every 64-bit ARM core has;
 * fp16 conversions and fma are part of it); checked by tests/runtime/test_kernels_aarch64.py, which runs
 * the kernels under qemu-aarch64 against the same references as the x86 builds. */
#ifndef TM_NEON_X86_H
#define TM_NEON_X86_H
#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

typedef float32x4_t __m128;
typedef int32x4_t __m128i;
typedef struct { float32x4_t lo, hi; } __m256;
typedef struct { int32x4_t lo, hi; } __m256i;

#define TM_SI static inline __attribute__((always_inline))
#define U8(x) vreinterpretq_u8_s32(x)
#define S8(x) vreinterpretq_s8_s32(x)
#define U16(x) vreinterpretq_u16_s32(x)
#define S16(x) vreinterpretq_s16_s32(x)
#define FROM_U8(x) vreinterpretq_s32_u8(x)
#define FROM_S8(x) vreinterpretq_s32_s8(x)
#define FROM_U16(x) vreinterpretq_s32_u16(x)
#define FROM_S16(x) vreinterpretq_s32_s16(x)
#define TM_M256(lo_, hi_) ((__m256){(lo_), (hi_)})
#define TM_M256I(lo_, hi_) ((__m256i){(lo_), (hi_)})

/* ---- hints ---------------------------------------------------------------------------------------- */
#define _MM_HINT_NTA 0
#define _MM_HINT_T1 2
#define _mm_prefetch(p, hint) __builtin_prefetch((const void *)(p), 0, 0)
TM_SI void _mm_pause(void) { __asm__ __volatile__("yield" ::: "memory"); }
TM_SI float _cvtsh_ss(uint16_t h) { __fp16 f; memcpy(&f, &h, 2); return (float)f; }

/* ---- 128-bit ---------------------------------------------------------------------------------------- */
TM_SI __m128i _mm_loadu_si128(const __m128i *p) { return FROM_U8(vld1q_u8((const uint8_t *)p)); }
TM_SI void _mm_storeu_si128(__m128i *p, __m128i a) { vst1q_u8((uint8_t *)p, U8(a)); }
TM_SI __m128i _mm_loadl_epi64(const __m128i *p) {
    return FROM_U8(vcombine_u8(vld1_u8((const uint8_t *)p), vdup_n_u8(0)));
}
TM_SI __m128i _mm_and_si128(__m128i a, __m128i b) { return vandq_s32(a, b); }
TM_SI __m128i _mm_srli_epi16(__m128i a, int n) {
    return n > 15 ? vdupq_n_s32(0) : FROM_U16(vshlq_u16(U16(a), vdupq_n_s16((int16_t)-n)));
}
TM_SI __m128i _mm_set1_epi8(char c) { return FROM_S8(vdupq_n_s8((int8_t)c)); }
TM_SI __m128i _mm_setr_epi8(char e0, char e1, char e2, char e3, char e4, char e5, char e6, char e7, char e8,
                            char e9, char e10, char e11, char e12, char e13, char e14, char e15) {
    const int8_t v[16] = {e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
    return FROM_S8(vld1q_s8(v));
}
TM_SI __m128i _mm_shuffle_epi8(__m128i a, __m128i b) {
    return FROM_U8(vqtbl1q_u8(U8(a), vandq_u8(U8(b), vdupq_n_u8(0x8F))));
}
TM_SI __m128i _mm_unpacklo_epi8(__m128i a, __m128i b) { return FROM_U8(vzip1q_u8(U8(a), U8(b))); }
TM_SI __m128i _mm_unpackhi_epi8(__m128i a, __m128i b) { return FROM_U8(vzip2q_u8(U8(a), U8(b))); }
TM_SI __m128i _mm_unpackhi_epi64(__m128i a, __m128i b) {
    return vreinterpretq_s32_s64(vcombine_s64(vget_high_s64(vreinterpretq_s64_s32(a)),
                                              vget_high_s64(vreinterpretq_s64_s32(b))));
}
TM_SI __m128 _mm_castsi128_ps(__m128i a) { return vreinterpretq_f32_s32(a); }
TM_SI __m128 _mm_loadu_ps(const float *p) { return vld1q_f32(p); }
TM_SI __m128 _mm_add_ps(__m128 a, __m128 b) { return vaddq_f32(a, b); }
TM_SI __m128 _mm_set1_ps(float f) { return vdupq_n_f32(f); }
TM_SI __m128 _mm_add_ss(__m128 a, __m128 b) { return vsetq_lane_f32(vgetq_lane_f32(a, 0) + vgetq_lane_f32(b, 0), a, 0); }
/* [b2, b3, a2, a3] */
TM_SI __m128 _mm_movehl_ps(__m128 a, __m128 b) { return vcombine_f32(vget_high_f32(b), vget_high_f32(a)); }
/* [a1, a1, a3, a3] */
TM_SI __m128 _mm_movehdup_ps(__m128 a) { return vtrn2q_f32(a, a); }
TM_SI float _mm_cvtss_f32(__m128 a) { return vgetq_lane_f32(a, 0); }

/* ---- 256-bit floats ----------------------------------------------------------------------------------- */
TM_SI __m256 _mm256_set1_ps(float a) { return TM_M256(vdupq_n_f32(a), vdupq_n_f32(a)); }
TM_SI __m256 _mm256_setzero_ps(void) { return _mm256_set1_ps(0.0f); }
TM_SI __m256 _mm256_loadu_ps(const float *p) { return TM_M256(vld1q_f32(p), vld1q_f32(p + 4)); }
TM_SI void _mm256_storeu_ps(float *p, __m256 a) { vst1q_f32(p, a.lo); vst1q_f32(p + 4, a.hi); }
TM_SI __m256 _mm256_add_ps(__m256 a, __m256 b) { return TM_M256(vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)); }
TM_SI __m256 _mm256_sub_ps(__m256 a, __m256 b) { return TM_M256(vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)); }
TM_SI __m256 _mm256_mul_ps(__m256 a, __m256 b) { return TM_M256(vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)); }
TM_SI __m256 _mm256_div_ps(__m256 a, __m256 b) { return TM_M256(vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)); }
/* a * b + c and c - a * b, one rounding (as vfmadd / vfnmadd) */
TM_SI __m256 _mm256_fmadd_ps(__m256 a, __m256 b, __m256 c) {
    return TM_M256(vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi));
}
TM_SI __m256 _mm256_fnmadd_ps(__m256 a, __m256 b, __m256 c) {
    return TM_M256(vfmsq_f32(c.lo, a.lo, b.lo), vfmsq_f32(c.hi, a.hi, b.hi));
}
TM_SI __m256 _mm256_min_ps(__m256 a, __m256 b) {
    return TM_M256(vbslq_f32(vcltq_f32(a.lo, b.lo), a.lo, b.lo), vbslq_f32(vcltq_f32(a.hi, b.hi), a.hi, b.hi));
}
TM_SI __m256 _mm256_max_ps(__m256 a, __m256 b) {
    return TM_M256(vbslq_f32(vcgtq_f32(a.lo, b.lo), a.lo, b.lo), vbslq_f32(vcgtq_f32(a.hi, b.hi), a.hi, b.hi));
}
TM_SI __m256 _mm256_floor_ps(__m256 a) { return TM_M256(vrndmq_f32(a.lo), vrndmq_f32(a.hi)); }
TM_SI __m128 _mm256_castps256_ps128(__m256 a) { return a.lo; }
#define _mm256_extractf128_ps(a, i) ((i) ? (a).hi : (a).lo)
TM_SI __m256 _mm256_castsi256_ps(__m256i a) {
    return TM_M256(vreinterpretq_f32_s32(a.lo), vreinterpretq_f32_s32(a.hi));
}
TM_SI __m256 _mm256_cvtepi32_ps(__m256i a) { return TM_M256(vcvtq_f32_s32(a.lo), vcvtq_f32_s32(a.hi)); }
TM_SI __m256i _mm256_cvttps_epi32(__m256 a) { return TM_M256I(vcvtq_s32_f32(a.lo), vcvtq_s32_f32(a.hi)); }
/* 8 halfs (the low 128 bits) -> 8 floats */
TM_SI __m256 _mm256_cvtph_ps(__m128i a) {
    float16x8_t h = vreinterpretq_f16_s32(a);
    return TM_M256(vcvt_f32_f16(vget_low_f16(h)), vcvt_f32_f16(vget_high_f16(h)));
}

/* ---- 256-bit integers ----------------------------------------------------------------------------------- */
TM_SI __m256i _mm256_loadu_si256(const __m256i *p) {
    const uint8_t *b = (const uint8_t *)p;
    return TM_M256I(FROM_U8(vld1q_u8(b)), FROM_U8(vld1q_u8(b + 16)));
}
TM_SI __m256i _mm256_and_si256(__m256i a, __m256i b) { return TM_M256I(vandq_s32(a.lo, b.lo), vandq_s32(a.hi, b.hi)); }
TM_SI __m256i _mm256_or_si256(__m256i a, __m256i b) { return TM_M256I(vorrq_s32(a.lo, b.lo), vorrq_s32(a.hi, b.hi)); }
TM_SI __m256i _mm256_xor_si256(__m256i a, __m256i b) { return TM_M256I(veorq_s32(a.lo, b.lo), veorq_s32(a.hi, b.hi)); }
TM_SI __m256i _mm256_add_epi32(__m256i a, __m256i b) { return TM_M256I(vaddq_s32(a.lo, b.lo), vaddq_s32(a.hi, b.hi)); }
TM_SI __m256i _mm256_sub_epi32(__m256i a, __m256i b) { return TM_M256I(vsubq_s32(a.lo, b.lo), vsubq_s32(a.hi, b.hi)); }
TM_SI __m256i _mm256_slli_epi32(__m256i a, int n) {
    if (n > 31) return TM_M256I(vdupq_n_s32(0), vdupq_n_s32(0));
    return TM_M256I(vshlq_s32(a.lo, vdupq_n_s32(n)), vshlq_s32(a.hi, vdupq_n_s32(n)));
}
TM_SI __m256i _mm256_set1_epi8(char c) { __m128i v = FROM_S8(vdupq_n_s8((int8_t)c)); return TM_M256I(v, v); }
TM_SI __m256i _mm256_set1_epi16(short c) { __m128i v = FROM_S16(vdupq_n_s16(c)); return TM_M256I(v, v); }
TM_SI __m256i _mm256_set1_epi32(int c) { return TM_M256I(vdupq_n_s32(c), vdupq_n_s32(c)); }
TM_SI __m256i _mm256_set_m128i(__m128i hi, __m128i lo) { return TM_M256I(lo, hi); }
TM_SI __m256 _mm256_set_m128(__m128 hi, __m128 lo) { return TM_M256(lo, hi); }
TM_SI __m256i _mm256_srli_epi16(__m256i a, int n) { return TM_M256I(_mm_srli_epi16(a.lo, n), _mm_srli_epi16(a.hi, n)); }
/* wrapping, as paddw */
TM_SI __m256i _mm256_add_epi16(__m256i a, __m256i b) {
    return TM_M256I(FROM_S16(vaddq_s16(S16(a.lo), S16(b.lo))), FROM_S16(vaddq_s16(S16(a.hi), S16(b.hi))));
}
TM_SI __m256i _mm256_broadcastsi128_si256(__m128i a) { return TM_M256I(a, a); }
/* in each 128-bit lane, as pshufb */
TM_SI __m256i _mm256_shuffle_epi8(__m256i a, __m256i b) {
    return TM_M256I(_mm_shuffle_epi8(a.lo, b.lo), _mm_shuffle_epi8(a.hi, b.hi));
}
TM_SI int8x16_t tm_sign8(int8x16_t a, int8x16_t b) {
    int8x16_t r = vbslq_s8(vcltzq_s8(b), vnegq_s8(a), a);
    return vandq_s8(r, vreinterpretq_s8_u8(vmvnq_u8(vceqzq_s8(b))));
}
TM_SI __m256i _mm256_sign_epi8(__m256i a, __m256i b) {
    return TM_M256I(FROM_S8(tm_sign8(S8(a.lo), S8(b.lo))), FROM_S8(tm_sign8(S8(a.hi), S8(b.hi))));
}
/* unsigned a x signed b bytes, adjacent pairs summed with signed saturation -> 8 int16 per 128 bits */
TM_SI int16x8_t tm_maddubs(uint8x16_t a, int8x16_t b) {
    int16x8_t p0 = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(a))), vmovl_s8(vget_low_s8(b)));
    int16x8_t p1 = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(a))), vmovl_s8(vget_high_s8(b)));
    return vqaddq_s16(vuzp1q_s16(p0, p1), vuzp2q_s16(p0, p1));
}
TM_SI __m256i _mm256_maddubs_epi16(__m256i a, __m256i b) {
    return TM_M256I(FROM_S16(tm_maddubs(U8(a.lo), S8(b.lo))), FROM_S16(tm_maddubs(U8(a.hi), S8(b.hi))));
}
/* signed 16 x 16 products, adjacent pairs summed -> 4 int32 per 128 bits */
TM_SI int32x4_t tm_madd16(int16x8_t a, int16x8_t b) {
    return vpaddq_s32(vmull_s16(vget_low_s16(a), vget_low_s16(b)), vmull_high_s16(a, b));
}
TM_SI __m256i _mm256_madd_epi16(__m256i a, __m256i b) {
    return TM_M256I(tm_madd16(S16(a.lo), S16(b.lo)), tm_madd16(S16(a.hi), S16(b.hi)));
}
/* the low 8 bytes / 8 shorts of a 128-bit register, widened to 8 int32 */
TM_SI __m256i _mm256_cvtepi8_epi32(__m128i a) {
    int16x8_t w = vmovl_s8(vget_low_s8(S8(a)));
    return TM_M256I(vmovl_s16(vget_low_s16(w)), vmovl_s16(vget_high_s16(w)));
}
TM_SI __m256i _mm256_cvtepu8_epi32(__m128i a) {
    uint16x8_t w = vmovl_u8(vget_low_u8(U8(a)));
    return TM_M256I(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(w))), vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(w))));
}
TM_SI __m256i _mm256_cvtepu16_epi32(__m128i a) {
    uint16x8_t w = U16(a);
    return TM_M256I(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(w))), vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(w))));
}
#endif
