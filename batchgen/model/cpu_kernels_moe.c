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
        __m512 a[MT];
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
    v16 a[MT];
    float tail[MT];
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
    float r[MT];
    for (int j = 0; j < nn; j++) {
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
