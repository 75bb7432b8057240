/* The mixture-of-experts kernel (part of cpu_kernels.c's one translation unit, included by it
 * after the layer kernels, whose silu_mul16 it uses; every function here without ``static`` is
 * an entry point called through ctypes). */

/* ---- mixture-of-experts: each expert's SwiGLU MLP over the (token, slot) pairs routed to it
 * (FusedExperts in batchgen/model/layers/moe.py) ----
 *
 * x [T, H] (row t at x + t*x_stride); gate_up [E, 2I, H] (expert e's gate rows, then its up
 * rows) and down [E, H, I] contiguous; all fp32 or all bf16 (BF). The P pairs are sorted by
 * expert: pair p reads token row rows[p]; expert e's pairs are starts[e] .. starts[e+1]-1. act
 * [P, I] (scratch) and out [P, H] are contiguous, in x's dtype, in that sorted order:
 *   act[p][n] = silu(x_p . gate_up[e][n]) * (x_p . gate_up[e][I+n])
 *   out[p][j] = act[p] . down[e][j]
 * Dot products sum in fp32; bf16 rounds where the PyTorch path's bf16 tensors are stored (each
 * GEMM's outputs, silu, the product; silu_mul_bf16's formula). Only the experts e with
 * 0 < pairs <= max_rows are computed; the caller runs the others as GEMMs.
 *
 * Decode steps give each expert a few pairs, so the work is a stream over the selected experts'
 * weights: a task is 16 weight rows of one expert (each row read once from memory, then from L1
 * for every 4-pair tile), tasks spread over the threads. */

#define MOE_ROWS 16 /* weight rows (outputs) per task */
#define MOE_TILE 8  /* at most this many pairs per pass over a weight row */

/* r[i] = xs[i] . w over K for the MT rows xs (fp32 sums); MT and BF compile-time constants */
static inline __attribute__((always_inline)) void moe_dots(const void *const *xs, const void *w,
                                                           int64_t K, const int MT, const int BF,
                                                           float *r) {
#if defined(__AVX512BF16__)
    if (BF && K % 32 == 0) {
        __m512 a[MOE_TILE];
        for (int i = 0; i < MT; i++) a[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < K; c += 32) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const uint16_t *)w + c);
            for (int i = 0; i < MT; i++)
                a[i] = _mm512_dpbf16_ps(
                    a[i], (__m512bh)_mm512_loadu_si512((const uint16_t *)xs[i] + c), wv);
        }
        for (int i = 0; i < MT; i++) r[i] = _mm512_reduce_add_ps(a[i]);
        return;
    }
#endif
    v16 a[MOE_TILE];
    float tail[MOE_TILE];
    for (int i = 0; i < MT; i++) a[i] = (v16){0}, tail[i] = 0.0f;
    int64_t c = 0;
    for (; c + 16 <= K; c += 16) {
        const v16 wv = load16_any(w, c, BF);
        for (int i = 0; i < MT; i++) a[i] += load16_any(xs[i], c, BF) * wv;
    }
    for (; c < K; c++) {
        const float wv = load1_any(w, c, BF);
        for (int i = 0; i < MT; i++) tail[i] += load1_any(xs[i], c, BF) * wv;
    }
    for (int i = 0; i < MT; i++) {
        float s[16];
        store16(s, a[i]);
        float t = 0.0f;
        for (int l = 0; l < 16; l++) t += s[l];
        r[i] = t + tail[i];
    }
}

#if defined(__AVX512BF16__)
/* the four sums of a[0..3]'s 16 lanes each (every sum reduced in the same order whatever its
 * neighbours: a pair's result does not depend on the rows or pairs computed beside it) */
static inline __attribute__((always_inline)) __m128 moe_sum4(const __m512 *a) {
    __m256 b[4];
    for (int i = 0; i < 4; i++)
        b[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* r[i][j0 + j] = xs[i] . (row j of w, rows ``row`` bytes apart) for MT pairs and 4 weight rows,
 * bf16 operands, K % 32 == 0, fp32 sums: 4 + MT loads feed 4 * MT dot products per 32 columns
 * (the one-row loop of moe_dots reloads every x row per weight row). The 4 rows are one
 * contiguous block (row == 2 K); ``pf``: the bytes after it, prefetched at the same pace (four
 * short row streams defeat the hardware prefetcher where one long one did not), or NULL. */
static inline __attribute__((always_inline)) void moe_dots4(const void *const *xs, const char *w,
                                                            int64_t row, int64_t K, const int MT,
                                                            float r[][16], int j0,
                                                            const char *pf) {
    __m512 a[4][4]; /* fixed sizes: an array sized by MT is a VLA, kept in memory */
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += 32) {
        if (pf != NULL)
            for (int l = 0; l < 4; l++) _mm_prefetch(pf + c * 8 + l * 64, _MM_HINT_T0);
        __m512bh wv[4];
        for (int j = 0; j < 4; j++)
            wv[j] = (__m512bh)_mm512_loadu_si512((const uint16_t *)(w + j * row) + c);
        for (int i = 0; i < MT; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)xs[i] + c);
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MT; i++) _mm_storeu_ps(r[i] + j0, moe_sum4(a[i]));
}
#endif

/* store n <= 16 fp32 values v at dst[0..n) of an fp32 or bf16 (BF) row */
static inline __attribute__((always_inline)) void moe_store(void *dst, v16 v, int n, const int BF) {
    if (n == 16) {
        if (BF)
            store16_bf16((uint16_t *)dst, v);
        else
            store16((float *)dst, v);
        return;
    }
    float buf[16];
    store16(buf, v);
    for (int l = 0; l < n; l++) {
        if (BF)
            ((uint16_t *)dst)[l] = f32_to_bf16(buf[l]);
        else
            ((float *)dst)[l] = buf[l];
    }
}

/* MT pairs (xs) through nn <= 16 weight rows from w0 (row stride K; the up rows of the gate
 * pass at + up): g[i][j], u[i][j] the dot products */
static inline __attribute__((always_inline)) void moe_tile(const void *const *xs, const char *w0,
                                                           int64_t K, int64_t up, int nn,
                                                           int gate_pass, const int MT,
                                                           const int BF, float g[][16],
                                                           float u[][16]) {
    const int64_t row = K * (BF ? 2 : 4);
    float r[MOE_TILE];
    int j = 0;
#if defined(__AVX512BF16__)
    /* tiles of 4 or 8 pairs: 4 weight rows at a time, 4 pairs per pass (4 x 4 accumulators; a
     * second pass reads the rows again from L1); tiles of 1-2 pairs keep the one-row loop below,
     * whose single sequential stream over the rows measured faster there */
    if (BF && K % 32 == 0 && MT >= 4) {
        for (; j + 4 <= nn; j += 4) {
            const char *wg = w0 + j * row, *wu = w0 + up + j * row;
            moe_dots4(xs, wg, row, K, 4, g, j, wg + 4 * row);
            if (MT > 4) moe_dots4(xs + 4, wg, row, K, MT - 4, g + 4, j, NULL);
            if (!gate_pass) continue;
            moe_dots4(xs, wu, row, K, 4, u, j, wu + 4 * row);
            if (MT > 4) moe_dots4(xs + 4, wu, row, K, MT - 4, u + 4, j, NULL);
        }
    }
#endif
    for (; j < nn; j++) {
        moe_dots(xs, w0 + j * row, K, MT, BF, r);
        for (int i = 0; i < MT; i++) g[i][j] = r[i];
        if (gate_pass) {
            moe_dots(xs, w0 + up + j * row, K, MT, BF, r);
            for (int i = 0; i < MT; i++) u[i][j] = r[i];
        }
    }
}

/* one task of the gate-up pass (rows n0 .. n0+nn-1 of expert e's gate and up halves) or the down
 * pass (rows n0 .. n0+nn-1 of down[e]) over the expert's pairs p0 .. p0+m-1 */
static inline __attribute__((always_inline)) void moe_task(
    const void *x, int64_t x_stride, const int64_t *rows, const void *gate_up, const void *down,
    void *act, void *out, int64_t H, int64_t I, int64_t e, int64_t p0, int64_t m, int64_t n0,
    int nn, int gate_pass, const int BF) {
    const int64_t esz = BF ? 2 : 4;
    const v16 one = (v16){0} + 1.0f;
    const char *w0 = gate_pass ? (const char *)gate_up + (e * 2 * I + n0) * H * esz
                               : (const char *)down + (e * H + n0) * I * esz;
    const int64_t K = gate_pass ? H : I;
    for (int64_t i0 = 0; i0 < m;) {
        const int64_t left = m - i0;
        const int tile = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const void *xs[MOE_TILE];
        for (int i = 0; i < tile; i++) {
            const int64_t p = p0 + i0 + i;
            xs[i] = gate_pass ? (const char *)x + rows[p] * x_stride * esz
                              : (const char *)act + p * I * esz;
        }
        float g[MOE_TILE][16] = {{0}}, u[MOE_TILE][16] = {{0}};
        const int64_t up = I * H * esz;
        if (tile == 8)
            moe_tile(xs, w0, K, up, nn, gate_pass, 8, BF, g, u);
        else if (tile == 4)
            moe_tile(xs, w0, K, up, nn, gate_pass, 4, BF, g, u);
        else if (tile == 2)
            moe_tile(xs, w0, K, up, nn, gate_pass, 2, BF, g, u);
        else
            moe_tile(xs, w0, K, up, nn, gate_pass, 1, BF, g, u);
        for (int i = 0; i < tile; i++) {
            const int64_t p = p0 + i0 + i;
            v16 gv = load16(g[i]);
            if (gate_pass) {
                v16 uv = load16(u[i]);
                v16 y;
                if (BF) {
                    gv = round16_bf16(gv), uv = round16_bf16(uv);
                    y = round16_bf16(silu_mul16(gv, one)) * uv;
                } else {
                    y = silu_mul16(gv, uv);
                }
                moe_store((char *)act + (p * I + n0) * esz, y, nn, BF);
            } else {
                moe_store((char *)out + (p * H + n0) * esz, gv, nn, BF);
            }
        }
        i0 += tile;
    }
}

static int moe_experts(const void *x, int64_t x_stride, const int64_t *rows,
                       const int64_t *starts, const void *gate_up, const void *down, void *act,
                       void *out, int64_t E, int64_t H, int64_t I, int64_t max_rows,
                       int num_threads, const int BF) {
    for (int pass = 0; pass < 2; pass++) {
        const int gate_pass = pass == 0;
        const int64_t n = gate_pass ? I : H; /* outputs per pair */
        const int64_t blocks = (n + MOE_ROWS - 1) / MOE_ROWS;
        int64_t num_tasks = 0;
        for (int64_t e = 0; e < E; e++) {
            const int64_t m = starts[e + 1] - starts[e];
            if (m > 0 && m <= max_rows) num_tasks += blocks;
        }
        if (num_tasks == 0) return 0;
        int64_t *tasks = malloc(sizeof(int64_t) * num_tasks); /* e * blocks + block */
        if (tasks == NULL) return -1;
        int64_t t = 0;
        for (int64_t e = 0; e < E; e++) {
            const int64_t m = starts[e + 1] - starts[e];
            if (m > 0 && m <= max_rows)
                for (int64_t b = 0; b < blocks; b++) tasks[t++] = e * blocks + b;
        }
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
#endif
        for (int64_t i = 0; i < num_tasks; i++) {
            const int64_t e = tasks[i] / blocks, n0 = (tasks[i] % blocks) * MOE_ROWS;
            const int nn = n - n0 < MOE_ROWS ? (int)(n - n0) : MOE_ROWS;
            const int64_t p0 = starts[e], m = starts[e + 1] - p0;
            moe_task(x, x_stride, rows, gate_up, down, act, out, H, I, e, p0, m, n0, nn,
                     gate_pass, BF);
        }
        free(tasks);
    }
    return 0;
}

int moe_experts_f32(const float *x, int64_t x_stride, const int64_t *rows, const int64_t *starts,
                    const float *gate_up, const float *down, float *act, float *out, int64_t E,
                    int64_t H, int64_t I, int64_t max_rows, int num_threads) {
    return moe_experts(x, x_stride, rows, starts, gate_up, down, act, out, E, H, I, max_rows,
                       num_threads, 0);
}

int moe_experts_bf16(const uint16_t *x, int64_t x_stride, const int64_t *rows,
                     const int64_t *starts, const uint16_t *gate_up, const uint16_t *down,
                     uint16_t *act, uint16_t *out, int64_t E, int64_t H, int64_t I,
                     int64_t max_rows, int num_threads) {
    return moe_experts(x, x_stride, rows, starts, gate_up, down, act, out, E, H, I, max_rows,
                       num_threads, 1);
}

/* ---- the weighted sum of each token's expert outputs (combine in batchgen/model/layers/moe.py),
 * read in place from the experts' sorted output rows ----
 *
 * y [P, H] (fp32 or bf16, BF), pos [T * k] (pair (t, j)'s row in y), w [T, k] fp32 -> out [T, H]
 * fp32: out[t] = (...(y[pos[t k]] w[t, 0] + y[pos[t k + 1]] w[t, 1]) + ...), summed in slot order
 * (a product and its sum may be one fused multiply-add, unlike the PyTorch combine's addcmul_: a
 * token's sum is the same whatever the other tokens of its step) */
static void moe_combine(const void *y, const int64_t *pos, const float *w, float *out, int64_t T,
                        int64_t k, int64_t H, int num_threads, const int BF) {
    const int64_t esz = BF ? 2 : 4;
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) schedule(static)
#endif
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        for (int64_t j = 0; j < k; j++) {
            const char *row = (const char *)y + pos[t * k + j] * H * esz;
            const float wj = w[t * k + j];
            const v16 wv = (v16){0} + wj;
            int64_t c = 0;
            for (; c + 16 <= H; c += 16) {
                const v16 p = load16_any(row, c, BF) * wv;
                store16(o + c, j == 0 ? p : load16(o + c) + p);
            }
            for (; c < H; c++) {
                const float p = load1_any(row, c, BF) * wj;
                o[c] = j == 0 ? p : o[c] + p;
            }
        }
    }
}

void moe_combine_f32(const float *y, const int64_t *pos, const float *w, float *out, int64_t T,
                     int64_t k, int64_t H, int num_threads) {
    moe_combine(y, pos, w, out, T, k, H, num_threads, 0);
}

void moe_combine_bf16(const uint16_t *y, const int64_t *pos, const float *w, float *out,
                      int64_t T, int64_t k, int64_t H, int num_threads) {
    moe_combine(y, pos, w, out, T, k, H, num_threads, 1);
}
