/* The elementwise layer kernels (RMSNorm, RoPE, SwiGLU; fp32 and bf16) and the sampler's
 * noise and draw (part of cpu_kernels.c's one translation unit, included by it; every function
 * here without ``static`` is an entry point called through ctypes). */

/* ---- elementwise layers (one pass over the data instead of several torch ops) ---- */

/* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w for rows t of width n; x rows at x + t*x_stride,
 * y contiguous [T, n]. The sum of squares is accumulated in double. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *y, int64_t num_rows,
                  int64_t n, float eps) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (num_rows * n >= 32768)
#endif
    for (int64_t t = 0; t < num_rows; t++) {
        const float *xr = x + t * x_stride;
        float *yr = y + t * n;
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        const float inv = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
#pragma omp simd
        for (int64_t i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* Rotate-half RoPE in place on x [T, H, D] (row t at x + t*x_stride, heads contiguous):
 * x1' = x1*c - x2*s, x2' = x2*c + x1*s with (x1, x2) the two halves of each head and c, s the
 * rows of cos/sin [T, D/2] (contiguous). */
void rope_f32(float *x, int64_t x_stride, const float *cos_t, const float *sin_t,
              int64_t num_tokens, int64_t num_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (num_tokens * num_heads * head_dim >= 32768)
#endif
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos_t + t * half;
        const float *s = sin_t + t * half;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x1 = x + t * x_stride + h * head_dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* silu(g) * u lane-wise: g * sigmoid(g) with sigmoid from e = exp(-|g|) (never overflows);
 * defined for a vector type V (VI: its int32 twin, EXP: exp of its non-positive lanes) */
#define SILU_MUL_FOR(NAME, V, VI, EXP)                                                          \
    static inline V NAME(V g, V u) {                                                            \
        const VI sign = (VI){0} + INT32_MIN; /* the sign bit in every lane */                   \
        V e = EXP((V)((VI)g | sign));                                                           \
        VI neg = g < 0.0f;                                                                      \
        V num = (V)(((VI)e & neg) | ((VI)(e * 0.0f + 1.0f) & ~neg)); /* e if g < 0 else 1 */   \
        return g * (num / (1.0f + e)) * u;                                                      \
    }
SILU_MUL_FOR(silu_mul16, v16, vi16, exp16_nonpos)
/* at the native width (a v16 off AVX-512 goes through the stack) */
SILU_MUL_FOR(silu_muln, vn, vin, expn_nonpos)

/* SwiGLU activation in place: g[t] <- silu(g[t]) * u[t] with g, u the two halves of row t of
 * gate_up [T, 2I] (contiguous). */
void silu_mul_f32(float *gate_up, int64_t num_rows, int64_t inter) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (num_rows * inter >= 32768)
#endif
    for (int64_t t = 0; t < num_rows; t++) {
        float *g = gate_up + t * 2 * inter;
        const float *u = g + inter;
        int64_t i = 0;
        for (; i + VL <= inter; i += VL) storen(g + i, silu_muln(loadn(g + i), loadn(u + i)));
        if (i < inter) {
            float gb[VL] = {0}, ub[VL] = {0}, yb[VL];
            memcpy(gb, g + i, sizeof(float) * (inter - i));
            memcpy(ub, u + i, sizeof(float) * (inter - i));
            storen(yb, silu_muln(loadn(gb), loadn(ub)));
            memcpy(g + i, yb, sizeof(float) * (inter - i));
        }
    }
}

/* ---- the elementwise layers on bf16 tensors: torch's bf16 ops, each computed in fp32 and
 * rounded to bf16 (round_bf16) where torch stores a bf16 tensor ---- */

/* RMSNorm as batchgen's RMSNorm (Hugging Face's formula) on bf16: with x in fp32,
 * y = bf16(w * bf16(x * inv)), inv = 1 / sqrtf(mean(x^2) + eps) in fp32 (the squares of bf16
 * values are exact; their sum is taken in double, the mean rounded to fp32). x rows at
 * x + t*x_stride, y contiguous [T, n]. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *y,
                   int64_t num_rows, int64_t n, float eps) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (num_rows * n >= 32768)
#endif
    for (int64_t t = 0; t < num_rows; t++) {
        const uint16_t *xr = x + t * x_stride;
        uint16_t *yr = y + t * n;
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) {
            const double xi = bf16_to_f32(xr[i]);
            ss += xi * xi;
        }
        const float ms = (float)(ss / (double)n);
        const float inv = 1.0f / sqrtf(ms + eps);
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            store16_bf16(yr + i, load16_bf16(w + i) * round16_bf16(load16_bf16(xr + i) * inv));
        for (; i < n; i++)
            yr[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
    }
}

/* rope_f32 on bf16 x, cos and sin, bit for bit batchgen's rope_ on bf16 tensors:
 * x1' = bf16(bf16(x1*c) - bf16(x2*s)), x2' = bf16(bf16(x2*c) + bf16(x1*s)). */
void rope_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos_t, const uint16_t *sin_t,
               int64_t num_tokens, int64_t num_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (num_tokens * num_heads * head_dim >= 32768)
#endif
    for (int64_t t = 0; t < num_tokens; t++) {
        const uint16_t *c = cos_t + t * half;
        const uint16_t *s = sin_t + t * half;
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *x1 = x + t * x_stride + h * head_dim;
            uint16_t *x2 = x1 + half;
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) {
                const v16 a = load16_bf16(x1 + i), b = load16_bf16(x2 + i);
                const v16 cv = load16_bf16(c + i), sv = load16_bf16(s + i);
                store16_bf16(x1 + i, round16_bf16(a * cv) - round16_bf16(b * sv));
                store16_bf16(x2 + i, round16_bf16(b * cv) + round16_bf16(a * sv));
            }
            for (; i < half; i++) {
                const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                const float cv = bf16_to_f32(c[i]), sv = bf16_to_f32(s[i]);
                x1[i] = f32_to_bf16(round_bf16(a * cv) - round_bf16(b * sv));
                x2[i] = f32_to_bf16(round_bf16(b * cv) + round_bf16(a * sv));
            }
        }
    }
}

/* SwiGLU in place on bf16 gate_up [T, 2I] (contiguous), as batchgen's silu_mul_ on bf16:
 * g <- bf16(bf16(silu(g)) * u), silu in fp32. */
void silu_mul_bf16(uint16_t *gate_up, int64_t num_rows, int64_t inter) {
    const v16 one = (v16){0} + 1.0f;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (num_rows * inter >= 32768)
#endif
    for (int64_t t = 0; t < num_rows; t++) {
        uint16_t *g = gate_up + t * 2 * inter;
        const uint16_t *u = g + inter;
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16)
            store16_bf16(g + i, round16_bf16(silu_mul16(load16_bf16(g + i), one)) *
                                    load16_bf16(u + i));
        if (i < inter) {
            uint16_t gb[16] = {0}, ub[16] = {0}, yb[16];
            memcpy(gb, g + i, sizeof(uint16_t) * (inter - i));
            memcpy(ub, u + i, sizeof(uint16_t) * (inter - i));
            store16_bf16(yb, round16_bf16(silu_mul16(load16_bf16(gb), one)) * load16_bf16(ub));
            memcpy(g + i, yb, sizeof(uint16_t) * (inter - i));
        }
    }
}

/* 1 when this build's bf16 attention uses the AVX512-BF16 dot products, else 0 */
int cpu_kernels_avx512bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* the fp32 lanes of the tiles' vectors: 16 in AVX-512 builds, 8 in AVX2 ones */
int cpu_kernels_lanes(void) { return VL; }

/* ---- the sampler's counter-based noise (batchgen/engine/sampler.py, bit for bit) ---- */

/* the sampler's 64-bit mix (SplitMix64's finalizer), defined for a scalar or vector type T of
 * uint64 lanes */
#define MIX64_FOR(NAME, T)                                                                    \
    static inline T NAME(T z) {                                                               \
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;                                           \
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;                                           \
        return z ^ (z >> 31);                                                                 \
    }
MIX64_FOR(mix64, uint64_t)

/* u[r, j] for r < S, j < K: z = (ids[r, j] + 1) * GAMMA + state[r] (mod 2^64), mixed; 48 bits
 * as hi * 2^-24 + lo * 2^-48 (one rounding), clamped to [2^-49, 1 - 2^-24]. ids row r at
 * ids + r * ids_stride (stride 0: one row for all); NULL ids means ids[r, j] = j. */
void uniform_noise_f32(const int64_t *state, const int64_t *ids, int64_t ids_stride,
                       float *out, int64_t num_rows, int64_t k) {
    const uint64_t gamma = 0x9E3779B97F4A7C15ULL;
    const float lo_min = 0x1p-49f, hi_max = 1.0f - 0x1p-24f;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (num_rows * k >= 65536)
#endif
    for (int64_t r = 0; r < num_rows; r++) {
        const uint64_t s = (uint64_t)state[r];
        const int64_t *id_row = ids ? ids + r * ids_stride : NULL;
        float *o = out + r * k;
#pragma omp simd
        for (int64_t j = 0; j < k; j++) {
            const uint64_t id = id_row ? (uint64_t)id_row[j] : (uint64_t)j;
            const uint64_t z = mix64((id + 1) * gamma + s);
            const float hi = (float)(int32_t)((z >> 40) & 0xFFFFFF);
            const float lo = (float)(int32_t)((z >> 16) & 0xFFFFFF);
            float u = hi * 0x1p-24f + lo * 0x1p-48f;
            u = u < lo_min ? lo_min : u;
            o[j] = u > hi_max ? hi_max : u;
        }
    }
}

/* The exponential race over whole rows (the sampler's plain draw, fused):
 *   tokens[r] = argmax_j w_j / E_j,  w_j = exp(s_j - max s),  s_j = x[r, j] / temperature[r],
 *   E_j = -log1p(-u_j) with u_j the hashed uniform of uniform_noise_f32 at (state[r], j),
 * the first index on ties. This is argmax softmax(s)_j / E_j without the normalization (the
 * argmax is scale-invariant). Exactness without a logarithm per element: E >= u, so a token with
 * w_j <= R * u_j * (1 - 2^-20), R the best ratio so far, has w_j / E_j < R strictly (the margin
 * covers log1pf's rounding and lies beyond one float step of R, so it cannot even tie); only the
 * few tokens passing that test get their E computed. logits rows at x + r * x_stride. */
typedef uint64_t vu8 __attribute__((vector_size(64), aligned(8)));

/* whether any lane of a comparison result is set (an OR-fold of the halves) */
static inline int any16(vi16 m) {
    typedef int32_t vi8 __attribute__((vector_size(32)));
    typedef int32_t vi4 __attribute__((vector_size(16)));
    const vi8 a = __builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7) |
                  __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15);
    const vi4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) | __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] | b[1] | b[2] | b[3]) != 0;
}

/* mix64 on 8 lanes */
MIX64_FOR(mix64x8, vu8)

/* the hashed uniforms of ids j0 .. j0+15 of a row with state st (uniform_noise_f32's formula) */
static inline v16 uniform16(uint64_t st, int64_t j0) {
    const uint64_t gamma = 0x9E3779B97F4A7C15ULL;
    const vu8 lane = {1, 2, 3, 4, 5, 6, 7, 8};
    const vu8 z0 = mix64x8((lane + (uint64_t)j0) * gamma + st);
    const vu8 z1 = mix64x8((lane + (uint64_t)(j0 + 8)) * gamma + st);
    typedef float v8 __attribute__((vector_size(32)));
    typedef int64_t vi8 __attribute__((vector_size(64)));
    const v8 h0 = __builtin_convertvector((vi8)((z0 >> 40) & 0xFFFFFF), v8);
    const v8 h1 = __builtin_convertvector((vi8)((z1 >> 40) & 0xFFFFFF), v8);
    const v8 l0 = __builtin_convertvector((vi8)((z0 >> 16) & 0xFFFFFF), v8);
    const v8 l1 = __builtin_convertvector((vi8)((z1 >> 16) & 0xFFFFFF), v8);
    const v16 hi = __builtin_shufflevector(h0, h1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const v16 lo = __builtin_shufflevector(l0, l1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    v16 u = hi * 0x1p-24f + lo * 0x1p-48f;
    u = max16(u, (v16){0} + 0x1p-49f);
    return -max16(-u, (v16){0} - (1.0f - 0x1p-24f)); /* min(u, 1 - 2^-24) */
}

#if VL == 16
#define uniformn uniform16
#define anyn any16
#else
typedef uint64_t vu4 __attribute__((vector_size(32), aligned(8)));

/* mix64 on 4 lanes */
MIX64_FOR(mix64x4, vu4)

/* uniform16 at AVX2's 8 lanes: the hashed uniforms of ids j0 .. j0+7, lane for lane the same */
static inline vn uniformn(uint64_t st, int64_t j0) {
    const uint64_t gamma = 0x9E3779B97F4A7C15ULL;
    const vu4 lane = {1, 2, 3, 4};
    const vu4 z0 = mix64x4((lane + (uint64_t)j0) * gamma + st);
    const vu4 z1 = mix64x4((lane + (uint64_t)(j0 + 4)) * gamma + st);
    typedef int32_t vi4 __attribute__((vector_size(16)));
    /* the 24-bit fields, narrowed to int32 (exact) before the conversion to float */
    const vi4 h0 = __builtin_convertvector((z0 >> 40) & 0xFFFFFF, vi4);
    const vi4 h1 = __builtin_convertvector((z1 >> 40) & 0xFFFFFF, vi4);
    const vi4 l0 = __builtin_convertvector((z0 >> 16) & 0xFFFFFF, vi4);
    const vi4 l1 = __builtin_convertvector((z1 >> 16) & 0xFFFFFF, vi4);
    const vn hi = __builtin_convertvector(__builtin_shufflevector(h0, h1, 0, 1, 2, 3, 4, 5, 6, 7), vn);
    const vn lo = __builtin_convertvector(__builtin_shufflevector(l0, l1, 0, 1, 2, 3, 4, 5, 6, 7), vn);
    vn u = hi * 0x1p-24f + lo * 0x1p-48f;
    u = maxn(u, (vn){0} + 0x1p-49f);
    return -maxn(-u, (vn){0} - (1.0f - 0x1p-24f)); /* min(u, 1 - 2^-24) */
}

/* whether any lane of a comparison result is set */
static inline int anyn(vin m) {
    typedef int32_t vi4 __attribute__((vector_size(16)));
    const vi4 b = __builtin_shufflevector(m, m, 0, 1, 2, 3) | __builtin_shufflevector(m, m, 4, 5, 6, 7);
    return (b[0] | b[1] | b[2] | b[3]) != 0;
}
#endif

void race_draw_f32(const float *x, int64_t x_stride, const float *temperature,
                   const int64_t *state, int64_t num_rows, int64_t vocab, int64_t *tokens) {
    const float margin = 1.0f - 0x1p-20f;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (num_rows * vocab >= 65536)
#endif
    for (int64_t r = 0; r < num_rows; r++) {
        const float *row = x + r * x_stride;
        const float t = temperature[r];
        const uint64_t st = (uint64_t)state[r];
        const int64_t full = vocab & ~(int64_t)(VL - 1);
        const int rest = (int)(vocab - full);
        float tail[VL];
        for (int i = 0; i < VL; i++) tail[i] = i < rest ? row[full + i] / t : -INFINITY;
        /* pass 1: m = max s and its first index; per lane the first index of the lane's max */
        vn mv = (vn){0} - INFINITY;
        vin mi = {0}, lane;
        for (int i = 0; i < VL; i++) lane[i] = i;
        for (int64_t j = 0; j < vocab; j += VL) {
            const vn sv = j < full ? loadn(row + j) / t : loadn(tail);
            const vin gt = sv > mv;
            mv = (vn)(((vin)sv & gt) | ((vin)mv & ~gt));
            mi = ((lane + (int32_t)j) & gt) | (mi & ~gt);
        }
        float m = mv[0];
        for (int i = 1; i < VL; i++) m = mv[i] > m ? mv[i] : m;
        int64_t best = vocab;
        for (int i = 0; i < VL; i++)
            if (mv[i] == m && mi[i] < best) best = mi[i];
        /* pass 2: the race, VL tokens at a time; at the maximum w = exp(0) = 1 */
        float u_best[VL];
        storen(u_best, uniformn(st, best));
        float best_r = 1.0f / -log1pf(-u_best[0]);
        for (int64_t j0 = 0; j0 < vocab; j0 += VL) {
            const vn u = uniformn(st, j0);
            /* w <= 1: a lane with u * best_r * margin >= 1 cannot pass; most chunks stop here */
            if (!anyn(u * (best_r * margin) < 1.0f)) continue;
            const vn s = j0 < full ? loadn(row + j0) / t : loadn(tail);
            const vn w = expn_nonpos(s - m);
            const vin pass = w > u * (best_r * margin);
            if (!anyn(pass)) continue;
            for (int i = 0; i < VL; i++) {
                if (!pass[i] || j0 + i >= vocab) continue;
                const float ratio = w[i] / -log1pf(-u[i]);
                if (ratio > best_r || (ratio == best_r && j0 + i < best)) {
                    best_r = ratio;
                    best = j0 + i;
                }
            }
        }
        tokens[r] = best;
    }
}
