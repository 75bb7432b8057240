/* The bf16 GEMM of the linear layers on CPUs with AVX512-BF16 and no AMX (part of
 * cpu_kernels.c's one translation unit; every function here without ``static`` is an entry
 * point called through ctypes). Python side: batchgen/model/dpbf16_linear.py.
 *
 *   y[m][n] = bf16(sum_k x[m][k] w[n][k] + bias[n] + add[m][n])      m < M, n < N, k < K
 *
 * x [M, K] bf16, row m at x + m*ldx; w is held packed (the layout below); bias
 * [N] bf16 or NULL; add [M, N] bf16 (row stride ld_add) or NULL; y [M, N] bf16, row stride ldy.
 * y may be add itself (each element is read before it is written, by the same thread); x must
 * not overlap y. The sum runs in fp32 (vdpbf16ps: exact products of bf16 pairs), over k in
 * ascending pairs, the same order for every row whatever M or the row's place in the call: a
 * row's result does not depend on the rows beside it. bias and add are added to the fp32 sum
 * and the result is rounded to bf16 once (to nearest even, as torch rounds).
 *
 * Packed layout: P [ceil(N/16)][ceil(K/2)][16][2] bf16, P[b][j][c][t] = w[16b + c][2j + t]
 * (zero beyond N or K): for each block of 16 outputs, one 64-byte vector per pair of inputs,
 * which vdpbf16ps multiplies by one broadcast pair of x and adds into 16 fp32 sums.
 *
 * Packed by batchgen/model/dpbf16_linear.py's pack (PyTorch ops, once at load).
 *
 * The loop: each thread takes an even share of the 16-output blocks, in panels of GEMM_NB
 * blocks (48 outputs; contiguous in P). A panel is read from memory once per row chunk (up to
 * GEMM_CHUNK_BYTES of x), then from cache for each GEMM_MR-row tile: per pair of inputs, 3
 * vector loads and 8 broadcasts feed 24 dot products into 24 accumulator registers. While a
 * panel computes, the next one is prefetched, spread evenly over the panel's tiles: a decode
 * step's GEMM (M of 1-64 rows) streams its weights from memory at the pace of its arithmetic,
 * not in bursts. */

#define GEMM_NB 3                   /* 16-output blocks per panel */
#define GEMM_MR 8                   /* rows per tile */
#define GEMM_CHUNK_BYTES (1 << 19)  /* bytes of x per pass over the weights: about half an L2 */

int cpu_kernels_gemm_dpbf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)

/* 16 bf16 -> fp32 (m: the lanes to read; others 0) */
static inline __m512 gemm_load_bf16(const uint16_t *p, __mmask16 m) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* One tile: MR rows (MR <= GEMM_MR) x NB blocks (NB <= GEMM_NB), both compile-time constants.
 * p: the panel (block j at p + j*blk); K2 pairs, of which the last is half when K is odd
 * (odd). pf .. pf_end: lines of the next panel to prefetch, pf_per per pair. mask: the valid
 * lanes of the last block. */
static inline __attribute__((always_inline)) void gemm_tile(
    const uint16_t *x, int64_t ldx, const int MR, const uint16_t *p, int64_t blk, const int NB,
    int64_t K2, int odd, const char *pf, const char *pf_end, int pf_per, const uint16_t *bias,
    const uint16_t *add, int64_t ld_add, uint16_t *y, int64_t ldy, __mmask16 mask) {
    __m512 acc[GEMM_MR][GEMM_NB];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t full = K2 - odd;
    for (int64_t kp = 0; kp < full; kp++) {
        __m512bh w[GEMM_NB];
        for (int j = 0; j < NB; j++) w[j] = (__m512bh)_mm512_loadu_si512(p + j * blk + kp * 32);
        for (int u = 0; u < pf_per; u++, pf += 64)
            if (pf < pf_end) _mm_prefetch(pf, _MM_HINT_T0);
        for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, x + i * ldx + 2 * kp, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, w[j]);
        }
    }
    if (odd) { /* the last input alone: its pair's second weight is 0, so is x's */
        __m512bh w[GEMM_NB];
        for (int j = 0; j < NB; j++) w[j] = (__m512bh)_mm512_loadu_si512(p + j * blk + full * 32);
        for (int i = 0; i < MR; i++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[i * ldx + 2 * full]);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, w[j]);
        }
    }
    for (int j = 0; j < NB; j++) {
        const __mmask16 m = j == NB - 1 ? mask : (__mmask16)0xFFFF;
        const __m512 b = bias ? gemm_load_bf16(bias + 16 * j, m) : _mm512_setzero_ps();
        for (int i = 0; i < MR; i++) {
            __m512 r = _mm512_add_ps(acc[i][j], b);
            if (add) r = _mm512_add_ps(r, gemm_load_bf16(add + i * ld_add + 16 * j, m));
            _mm256_mask_storeu_epi16(y + i * ldy + 16 * j, m, (__m256i)to_bf16x16((v16)r));
        }
    }
}

/* The rows m0 .. m0+M-1 against one panel of NB blocks: full tiles, then one tile of the
 * remaining rows; the next panel (pf, pf_bytes) is prefetched over all the tiles. */
static inline __attribute__((always_inline)) void gemm_panel(
    const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *p, int64_t blk, const int NB,
    int64_t K2, int odd, const char *pf, int64_t pf_bytes, const uint16_t *bias,
    const uint16_t *add, int64_t ld_add, uint16_t *y, int64_t ldy, __mmask16 mask) {
    const int64_t tiles = (M + GEMM_MR - 1) / GEMM_MR;
    const int64_t lines = pf ? pf_bytes / 64 : 0;
    /* prefetches per pair: all the next panel's lines over this panel's tiles x K2 pairs */
    const int per = (int)((lines + tiles * K2 - 1) / (tiles * K2));
    const char *pf_end = pf ? pf + pf_bytes : NULL;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t m = t * GEMM_MR;
        const char *tpf = pf ? pf + t * K2 * per * 64 : NULL;
        const uint16_t *a = add ? add + m * ld_add : NULL;
        switch (M - m < GEMM_MR ? (int)(M - m) : GEMM_MR) {
#define GEMM_TILE(R)                                                                        \
    case R:                                                                                 \
        gemm_tile(x + m * ldx, ldx, R, p, blk, NB, K2, odd, tpf, pf_end, per, bias, a,      \
                  ld_add, y + m * ldy, ldy, mask);                                          \
        break;
            GEMM_TILE(1) GEMM_TILE(2) GEMM_TILE(3) GEMM_TILE(4)
            GEMM_TILE(5) GEMM_TILE(6) GEMM_TILE(7) GEMM_TILE(8)
#undef GEMM_TILE
        }
    }
}

#endif /* __AVX512BF16__ */

/* y = x W^T + bias + add (the header comment's semantics); p in the packed layout for N
 * outputs of K inputs. Returns 0, or -1 where the build has no AVX512-BF16. */
int gemm_bf16_dpbf16(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, const uint16_t *p,
                     int64_t N, const uint16_t *bias, const uint16_t *add, int64_t ld_add,
                     uint16_t *y, int64_t ldy, int num_threads) {
#if defined(__AVX512BF16__)
    if (M <= 0 || N <= 0) return 0;
    const int64_t K2 = (K + 1) / 2, blk = K2 * 32, blocks = (N + 15) / 16;
    const int odd = (int)(K & 1);
    const int64_t chunk_rows = GEMM_CHUNK_BYTES / (2 * K) > GEMM_MR ? GEMM_CHUNK_BYTES / (2 * K)
                                                                    : GEMM_MR;
    const int nt = blocks < num_threads ? (int)blocks : num_threads;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
#else
        const int t = 0, n_t = 1;
#endif
        /* this thread's blocks: an even share (panels of GEMM_NB would leave one thread a
         * panel more where their count is odd: 11 panels of a 512-wide output on 2 threads) */
        const int64_t lo = blocks * t / n_t, hi = blocks * (t + 1) / n_t;
        for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
            const int64_t rows = M - m0 < chunk_rows ? M - m0 : chunk_rows;
            for (int64_t b0 = lo; b0 < hi; b0 += GEMM_NB) {
                const int nb = hi - b0 < GEMM_NB ? (int)(hi - b0) : GEMM_NB;
                const int64_t b1 = b0 + nb; /* the next panel's first block */
                const int64_t next = hi - b1 < GEMM_NB ? hi - b1 : GEMM_NB;
                const int64_t left = N - 16 * (b1 - 1); /* outputs from the last block on */
                const __mmask16 mask =
                    left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
                const uint16_t *pp = p + b0 * blk;
                const char *pf = next > 0 ? (const char *)(p + b1 * blk) : NULL;
                const uint16_t *bb = bias ? bias + 16 * b0 : NULL;
                const uint16_t *aa = add ? add + m0 * ld_add + 16 * b0 : NULL;
                const uint16_t *xx = x + m0 * ldx;
                uint16_t *yy = y + m0 * ldy + 16 * b0;
                switch (nb) {
#define GEMM_PANEL(B)                                                                           \
    case B:                                                                                     \
        gemm_panel(xx, ldx, rows, pp, blk, B, K2, odd, pf, next * blk * 2, bb, aa, ld_add, yy, \
                   ldy, mask);                                                                  \
        break;
                    GEMM_PANEL(1) GEMM_PANEL(2) GEMM_PANEL(3)
#undef GEMM_PANEL
                }
            }
        }
    }
    return 0;
#else
    (void)x, (void)ldx, (void)M, (void)K, (void)p, (void)N, (void)bias, (void)add, (void)ld_add,
        (void)y, (void)ldy, (void)num_threads;
    return -1;
#endif
}
