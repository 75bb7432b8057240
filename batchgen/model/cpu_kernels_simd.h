/* Vector types and helpers shared by the CPU kernels (part of cpu_kernels.c's one translation
 * unit, included by it): the fp32 vector of the native width, exp of non-positive lanes, loads and
 * stores of fp32, bf16 and int8 data, softmax of a row and horizontal sums. */

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

/* exp(x) lane-wise for x <= 0: x = n*ln2 + r, |r| <= ln2/2, e^r by its degree-7 Taylor polynomial
 * (relative error < 1e-8, below fp32 rounding), 2^n through the exponent bits; 0 below -87.
 * EXP_NONPOS_GENERIC defines it for a generic vector type V (VI: its int32 twin). */
#define EXP_NONPOS_GENERIC(NAME, V, VI)                                                       \
    static inline V NAME(V x) {                                                                \
        VI under = x < -87.0f; /* -1 where e^x underflows */                                   \
        V xc = (V)(((VI)x & ~under) | ((VI)((V){0} - 87.0f) & under));                         \
        V t = xc * 1.44269504088896341f + 0.5f;                                                \
        VI ni = __builtin_convertvector(t, VI); /* truncates toward zero */                   \
        ni += (VI)(__builtin_convertvector(ni, V) > t); /* floor: -1 where it went up */        \
        V n = __builtin_convertvector(ni, V);                                                  \
        V r = (xc - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;                   \
        V p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;                                            \
        p = p * r + 1.0f / 120.0f;                                                             \
        p = p * r + 1.0f / 24.0f;                                                              \
        p = p * r + 1.0f / 6.0f;                                                               \
        p = p * r + 0.5f;                                                                      \
        p = p * r + 1.0f;                                                                      \
        p = p * r + 1.0f;                                                                      \
        V two_n = (V)((ni + 127) << 23);                                                       \
        return (V)((VI)(p * two_n) & ~under);                                                  \
    }
#if defined(__AVX512F__)
/* AVX-512: rounding and the 2^n scaling are single instructions (vrndscaleps, vscalefps) */
static inline v16 exp16_nonpos(v16 x) {
    const __m512 xv = (__m512)x;
    const __mmask16 keep = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 xc = _mm512_max_ps(xv, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.0f / 5040.0f), _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return (v16)_mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}
#else
EXP_NONPOS_GENERIC(exp16_nonpos, v16, vi16)
#endif

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 max16(v16 a, v16 b) {
    vi16 gt = b > a;
    return (v16)(((vi16)b & gt) | ((vi16)a & ~gt));
}

/* The native vector: VL fp32 lanes in one register (a zmm with AVX-512, else a ymm). GCC keeps a
 * v16 in registers only where it is native; elsewhere it moves every v16 through the stack in
 * 8-byte pieces, so hot loops that hold many vectors live (the tiles below) use vn. */
#if defined(__AVX512F__)
#define VL 16
typedef v16 vn;
typedef vi16 vin;
static inline vn expn_nonpos(vn x) { return exp16_nonpos(x); }
#else
#define VL 8
typedef float vn __attribute__((vector_size(32)));
typedef int32_t vin __attribute__((vector_size(32)));
EXP_NONPOS_GENERIC(expn_nonpos, vn, vin)
#endif

static inline vn loadn(const float *p) {
    vn v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storen(float *p, vn v) { memcpy(p, &v, sizeof v); }

static inline vn maxn(vn a, vn b) {
    vin gt = b > a;
    return (vn)(((vin)b & gt) | ((vin)a & ~gt));
}

/* ---- bf16: the upper 16 bits of an fp32; fp32 -> bf16 rounds to nearest even (as torch) ---- */

typedef uint16_t vh16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4)));

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* bf16 rounding of an fp32 value, as an fp32 (the value torch's bf16 tensor op would store) */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512BW__)
/* 16 bf16 values as fp32: one widening move and a shift (GCC splits the generic form,
 * convertvector and << 16, into 256-bit halves) */
static inline v16 widen16_bf16(__m256i h) {
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
#endif

static inline v16 load16_bf16(const uint16_t *p) {
#if defined(__AVX512BW__)
    return widen16_bf16(_mm256_loadu_si256((const __m256i *)p));
#else
    vh16 h;
    memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, vu16) << 16);
#endif
}

#if defined(__AVX512BW__)
/* f32_to_bf16 per lane, kept in the 32-bit lanes: the bf16 bits in the upper half, zeros below
 * (the value as fp32 is the rounded one) */
static inline __m512i round_bits16(v16 x) {
    const __m512i u = _mm512_castps_si512((__m512)x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), hi);
    const __mmask16 nan = _mm512_cmp_ps_mask((__m512)x, (__m512)x, _CMP_UNORD_Q);
    return _mm512_mask_and_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)), hi);
}
#endif

/* fp32 -> bf16 lane-wise, to nearest even, a NaN kept a (quiet) NaN: f32_to_bf16 per lane */
static inline vh16 to_bf16x16(v16 x) {
#if defined(__AVX512BF16__)
    /* one instruction, bit for bit f32_to_bf16 (NaNs included; checked on every 7th of the 2^32
     * patterns) but for fp32 subnormals (|x| < 1.2e-38), which it flushes to a signed zero */
    return (vh16)_mm512_cvtneps_pbh((__m512)x);
#elif defined(__AVX512BW__)
    /* round16_bf16's arithmetic in AVX-512 instructions (GCC's code for the generic form below
     * took about a third of silu_mul_bf16's time), the upper halves gathered by one
     * permutation */
    const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 31, 29,
                                         27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i h = _mm512_permutexvar_epi16(idx, round_bits16(x));
    return (vh16)_mm512_castsi512_si256(h);
#else
    const vu16 u = (vu16)x;
    const vu16 r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const vu16 nan = (vu16)(x != x);
    return __builtin_convertvector((r & ~nan) | (((u >> 16) | 0x40u) & nan), vh16);
#endif
}

static inline void store16_bf16(uint16_t *p, v16 v) {
    const vh16 h = to_bf16x16(v);
    memcpy(p, &h, sizeof h);
}

static inline v16 round16_bf16(v16 x) {
#if defined(__AVX512BF16__)
    return widen16_bf16((__m256i)_mm512_cvtneps_pbh((__m512)x));
#elif defined(__AVX512BW__)
    return (v16)_mm512_castsi512_ps(round_bits16(x));
#else
    return (v16)(__builtin_convertvector(to_bf16x16(x), vu16) << 16);
#endif
}

/* 16 elements from i of an fp32 (bf = 0) or bf16 (bf = 1) array, as fp32; bf a constant */
static inline __attribute__((always_inline)) v16 load16_any(const void *p, int64_t i,
                                                            const int bf) {
    return bf ? load16_bf16((const uint16_t *)p + i) : load16((const float *)p + i);
}

static inline __attribute__((always_inline)) float load1_any(const void *p, int64_t i,
                                                             const int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* element i of an fp32 or bf16 array, as a pointer */
static inline void *at_any(const void *p, int64_t i, int bf) {
    return (char *)p + i * (bf ? 2 : 4);
}

/* dst[0..n) <- src[0..n) (fp32) in fp32 or rounded to bf16 */
static void store_row_any(void *dst, const float *src, int n, int bf) {
    if (!bf) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    int i = 0;
    for (; i + 16 <= n; i += 16) store16_bf16(d + i, load16(src + i));
    for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

/* dst[0..n) (fp32) <- src[0..n) (fp32 or bf16) */
static void load_row_any(float *dst, const void *src, int64_t n, int bf) {
    if (!bf) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16(dst + i, load16_bf16(s + i));
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

/* ---- int8 cache (per token and KV head scales; kernels/reference.py's quantize_kv_ref) ---- */

/* 16 int8 values as fp32 (exact) */
static inline v16 load16_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    typedef int8_t vc16 __attribute__((vector_size(16), aligned(1)));
    vc16 c;
    memcpy(&c, p, sizeof c);
    return __builtin_convertvector(__builtin_convertvector(c, vi16), v16);
#endif
}

/* K/V cache element i as a pointer: fp32, bf16 (bf) or int8 (i8); bf, i8 constants */
static inline __attribute__((always_inline)) const void *at_kv(const void *p, int64_t i,
                                                               const int bf, const int i8) {
    return i8 ? (const void *)((const int8_t *)p + i) : (const void *)at_any(p, i, bf);
}

/* 16 K/V cache elements from i as fp32, unscaled (int8: the integers) */
static inline __attribute__((always_inline)) v16 load16_kv(const void *p, int64_t i,
                                                           const int bf, const int i8) {
    return i8 ? load16_i8((const int8_t *)p + i) : load16_any(p, i, bf);
}

static inline __attribute__((always_inline)) float load1_kv(const void *p, int64_t i,
                                                            const int bf, const int i8) {
    return i8 ? (float)((const int8_t *)p)[i] : load1_any(p, i, bf);
}

/* VL K/V cache elements from i as fp32, unscaled (int8: the integers): load16_kv at the native
 * width */
static inline __attribute__((always_inline)) vn loadn_kv(const void *p, int64_t i, const int bf,
                                                         const int i8) {
#if VL == 16
    return load16_kv(p, i, bf, i8);
#else
    if (i8) {
        typedef int8_t vc8 __attribute__((vector_size(8), aligned(1)));
        vc8 c;
        memcpy(&c, (const int8_t *)p + i, sizeof c);
        return __builtin_convertvector(__builtin_convertvector(c, vin), vn);
    }
    if (bf) {
        typedef uint16_t vh8 __attribute__((vector_size(16), aligned(2)));
        typedef uint32_t vu8 __attribute__((vector_size(32)));
        vh8 h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        return (vn)(__builtin_convertvector(h, vu8) << 16);
    }
    return loadn((const float *)p + i);
#endif
}

/* dst[0..D) (fp32) <- the cache row at element off (fp32, bf16 or, i8, int8 dequantized as
 * q * scales[off / D] in fp32: the reference's dequantize_kv_ref exactly) */
static void load_kv_row(float *dst, const void *cache, const float *scales, int64_t off, int D,
                        int bf, int i8) {
    if (!i8) {
        load_row_any(dst, at_any(cache, off, bf), D, bf);
        return;
    }
    const int8_t *src = (const int8_t *)cache + off;
    const float sc = scales[off / D];
    int i = 0;
    for (; i + 16 <= D; i += 16) store16(dst + i, load16_i8(src + i) * sc);
    for (; i < D; i++) dst[i] = (float)src[i] * sc;
}

/* s[0..n) <- softmax(s) in place (n >= 1); *lse <- log(sum(exp(s))) when lse is not NULL. In
 * vectors of the native width (VL lanes: each lane's partial sum, then the lanes in order). */
static void softmax_row(float *s, int n, float *lse) {
    const int full = n & ~(VL - 1);
    float tail[VL];
    const int rest = n - full;
    for (int i = 0; i < VL; i++) tail[i] = i < rest ? s[full + i] : -INFINITY;
    vn mv = loadn(tail);
    for (int j = 0; j < full; j += VL) mv = maxn(mv, loadn(s + j));
    float m = mv[0];
    for (int i = 1; i < VL; i++) m = mv[i] > m ? mv[i] : m;
    vn sum = {0};
    for (int j = 0; j < full; j += VL) {
        vn e = expn_nonpos(loadn(s + j) - m);
        storen(s + j, e);
        sum += e;
    }
    vn et = expn_nonpos(loadn(tail) - m); /* -inf lanes give 0 */
    sum += et;
    float total = 0.0f;
    for (int i = 0; i < VL; i++) total += sum[i];
    if (lse) *lse = m + logf(total);
    const float inv = 1.0f / total;
    for (int j = 0; j < full; j += VL) storen(s + j, loadn(s + j) * inv);
    et *= inv;
    for (int i = 0; i < rest; i++) s[full + i] = et[i];
}

/* r[i] = sum of the 16 lanes of a[i], i < 16: a transpose-and-add tree (15 vector adds). */
static inline v16 hsum16(const v16 *a) {
    v16 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: a[2i] partial, 8-15: a[2i+1] partial */
        t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* 4-lane partials of 4 vectors */
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* 2-lane partials of 8 vectors */
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}

#if VL == 8
/* r[i] = sum of the 8 lanes of a[i], i < 8: hsum16's tree at 8 lanes (7 vector adds). */
static inline vn hsum8(const vn *a) {
    vn t[4], u[2];
    for (int i = 0; i < 4; i++) /* lanes 0-3: a[2i]'s 4 partials, 4-7: a[2i+1]'s */
        t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* 2-lane partials of 4 vectors */
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif
