/* The GEMMs of the linear layers (part of cpu_kernels.c's one translation unit; every function
 * here without ``static`` is an entry point called through ctypes; Python side:
 * batchgen/model/kernel_linear.py): bf16 on CPUs with AVX512-BF16 and no AMX (first), fp32 with
 * FMA on AVX2 and AVX-512 (at the end of the file).
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

/* This thread's share of a GEMM's 16-output blocks [lo, hi): an even share (panels of several
 * blocks would leave one thread a panel more where their count is odd: 11 panels of a 512-wide
 * output on 2 threads). Called inside the parallel region. */
static inline void gemm_thread_blocks(int64_t blocks, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), n_t = omp_get_num_threads();
#else
    const int t = 0, n_t = 1;
#endif
    *lo = blocks * t / n_t;
    *hi = blocks * (t + 1) / n_t;
}

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
        int64_t lo, hi;
        gemm_thread_blocks(blocks, &lo, &hi);
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

/* ---- fp32 ----
 *
 *   y[m][n] = sum_k x[m][k] w[n][k] + bias[n] + add[m][n]       m < M, n < N, k < K
 *
 * x [M, K] fp32, row m at x + m*ldx; bias [N] or NULL; add [M, N] (row stride ld_add) or NULL;
 * y [M, N], row stride ldy; y may be add itself, x must not overlap y. Each sum is one chain of
 * fused multiply-adds over k ascending, then + bias, then + add: the same operations for every
 * row whatever M or the row's place in the call, and the same in AVX2 and AVX-512 builds (the
 * vector width changes which lanes run together, not what each lane computes).
 *
 * Packed layout: P [ceil(N/16)][K][16] fp32, P[b][k][c] = w[16b + c][k] (zero beyond N): for
 * each block of 16 outputs, one 64-byte line per input, whatever the build's vector width.
 *
 * The loop is gemm_bf16_dpbf16's: each thread an even share of the 16-output blocks, in panels
 * of G32_NB blocks, each read from memory once per chunk of rows (G32_CHUNK_BYTES of x) and from
 * cache for each tile of up to G32_MR rows (the chunk's rows spread evenly over its tiles, so no
 * tile is left with a row or two). Where K > G32_KC the inputs are split into blocks of about
 * equal size, so that a panel's share of one block stays in L2 while the chunk's tiles pass
 * over it (a 4,864-input panel alone, 934 KB, would not); the tiles' partial sums wait in a
 * per-thread scratch of the chunk's rows and continue the same chain of multiply-adds.
 *
 * Per input, G32_NB*16/VL vector loads of weights and G32_MR broadcasts of x feed the tile's
 * G32_MR*G32_NB*16/VL accumulators: 8 x 3 zmm (24 of 32 registers) with AVX-512, 6 x 2 ymm (12
 * of 16) with AVX2. While a panel computes, its tiles prefetch the next panel, each an even
 * share of its lines (one line of each of its blocks per step, past W's end too: prefetches
 * never fault; with no next panel, a tile's own lines, already in cache: no branches). */

#if defined(__AVX512F__)
#define G32_MR 8
#define G32_NB 3
#else
#define G32_MR 6
#define G32_NB 1
#endif
#define G32_VB (16 / VL)             /* vectors per 16-output block */
#define G32_CHUNK_BYTES (1 << 19)    /* bytes of x per pass over the weights: about half an L2 */
#define G32_KC 1024                  /* most inputs per block of inputs (a panel's: 192 KB) */
#define G32_SLD (G32_NB * 16)        /* the scratch's row stride: a panel's outputs */
/* chunks of rows where K is split (then each block has at least G32_KC/2 inputs) */
#define G32_SCRATCH_ROWS (G32_CHUNK_BYTES / (4 * (G32_KC / 2)))

int cpu_kernels_gemm_f32(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0; /* compiled, never chosen: no measured advantage without FMA vectors */
#endif
}

/* -1 in the lanes below n (any n) */
static inline vin g32_lanes_below(int n) {
    static const int32_t ids[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vin v;
    memcpy(&v, ids, sizeof v);
    return v < n;
}

/* x[0] in every lane; loads and stores of the lanes set in m (others read as 0, not written) */
#if defined(__AVX512F__)
static inline vn g32_broadcast(const float *x) { return (vn)_mm512_set1_ps(*x); }
static inline vn g32_load_part(const float *p, vin m) {
    return (vn)_mm512_maskz_loadu_ps(_mm512_test_epi32_mask((__m512i)m, (__m512i)m), p);
}
static inline void g32_store_part(float *p, vn v, vin m) {
    _mm512_mask_storeu_ps(p, _mm512_test_epi32_mask((__m512i)m, (__m512i)m), (__m512)v);
}
#elif defined(__AVX2__)
static inline vn g32_broadcast(const float *x) { return (vn)_mm256_broadcast_ss(x); }
static inline vn g32_load_part(const float *p, vin m) {
    return (vn)_mm256_maskload_ps(p, (__m256i)m);
}
static inline void g32_store_part(float *p, vn v, vin m) {
    _mm256_maskstore_ps(p, (__m256i)m, (__m256)v);
}
#else
static inline vn g32_broadcast(const float *x) {
    vn v;
    for (int c = 0; c < VL; c++) v[c] = *x;
    return v;
}
static inline vn g32_load_part(const float *p, vin m) {
    vn v = {0};
    for (int c = 0; c < VL; c++)
        if (m[c]) v[c] = p[c];
    return v;
}
static inline void g32_store_part(float *p, vn v, vin m) {
    for (int c = 0; c < VL; c++)
        if (m[c]) p[c] = v[c];
}
#endif

/* One tile: MR rows (MR <= G32_MR) x NB blocks (NB <= G32_NB), both compile-time constants, over
 * the K inputs from x[.][0], p[.][0][.] on. p: the panel (block j at p + j*blk); pf: the panel
 * to prefetch (block j at pf + j*blk), line pos >> 16 of each block at the first input, then
 * pos advancing by step per input (16-bit fixed point). in: the sums so far
 * (row i at in + i*G32_SLD), NULL: none. Writes acc + bias + add to y, masked to last_n outputs
 * in the panel's last block (16 but at the end of W); a partial sum goes to the scratch rows
 * with bias, add NULL and last_n 16. The loads and stores are masked throughout: with a branch
 * between full and partial vectors GCC kept the accumulators in memory. */
static inline __attribute__((always_inline)) void gemm_f32_tile(
    const float *x, int64_t ldx, const int MR, const float *p, int64_t blk, const int NB,
    int64_t K, const float *pf, uint64_t pos, uint64_t step, const float *in, const float *bias,
    const float *add, int64_t ld_add, float *y, int64_t ldy, int last_n) {
    vn acc[G32_MR][G32_NB * G32_VB];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NB * G32_VB; j++)
            acc[i][j] = in ? loadn(in + i * G32_SLD + j * VL) : (vn){0};
    /* the lines the epilogue reads and writes, fetched while the sums run (a residual of
     * thousands of rows comes from memory: its misses cost a prefill's o and down
     * projections 10-20%) */
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NB; j++) {
            if (add) __builtin_prefetch(add + i * ld_add + j * 16, 0, 3);
            __builtin_prefetch(y + i * ldy + j * 16, 1, 3);
        }
#pragma GCC unroll 2
    for (int64_t k = 0; k < K; k++) {
        vn w[G32_NB * G32_VB];
        for (int j = 0; j < NB * G32_VB; j++)
            w[j] = loadn(p + (j / G32_VB) * blk + k * 16 + (j % G32_VB) * VL);
        const float *line = pf + (pos >> 16) * 16;
        for (int j = 0; j < NB; j++) __builtin_prefetch(line + j * blk, 0, 3);
        pos += step;
        for (int i = 0; i < MR; i++) {
            const vn xb = g32_broadcast(x + i * ldx + k);
            for (int j = 0; j < NB * G32_VB; j++) acc[i][j] += xb * w[j];
        }
    }
    for (int j = 0; j < NB * G32_VB; j++) {
        /* the valid lanes of vector j: all but in the last block */
        const vin m = g32_lanes_below(j / G32_VB == NB - 1 ? last_n - (j % G32_VB) * VL : VL);
        const vn b = bias ? g32_load_part(bias + j * VL, m) : (vn){0};
        for (int i = 0; i < MR; i++) {
            vn r = acc[i][j] + b;
            if (add) r += g32_load_part(add + i * ld_add + j * VL, m);
            g32_store_part(y + i * ldy + j * VL, r, m);
        }
    }
}

/* The rows 0 .. M-1 against one panel of NB blocks, in ceil(M/G32_MR) tiles of as even a size
 * as they can have, one block of inputs after the other (kb of them, as even in size; partial
 * sums in scratch, M rows of G32_SLD); pf: the next panel (NULL: none), prefetched over all
 * the tiles, each taking an even share of its lines (a decode step's weights then stream from
 * memory at the pace of the arithmetic, not in a burst during the first tile). */
static inline __attribute__((always_inline)) void gemm_f32_panel(
    const float *x, int64_t ldx, int64_t M, const float *p, int64_t blk, const int NB, int64_t K,
    int64_t kb, const float *pf, const float *bias, const float *add, int64_t ld_add, float *y,
    int64_t ldy, int last_n, float *scratch) {
    const int64_t tiles = (M + G32_MR - 1) / G32_MR;
    for (int64_t b = 0; b < kb; b++) {
        const int64_t k0 = K * b / kb, kc = K * (b + 1) / kb - k0;
        const int last = b == kb - 1;
        for (int64_t t = 0, m = 0; t < tiles; t++) {
            const int64_t rows = M * (t + 1) / tiles - M * t / tiles;
            /* tile t prefetches lines k0 + (t*kc .. (t+1)*kc - 1) / tiles of the next panel's
             * block; without one, its own lines (in cache), one per input */
            const float *tpf = (pf ? pf : p) + k0 * 16;
            const uint64_t step = pf ? ((uint64_t)1 << 16) / (uint64_t)tiles : (uint64_t)1 << 16;
            const uint64_t pos = pf ? (uint64_t)t * (uint64_t)kc * step : 0;
            const float *in = b > 0 ? scratch + m * G32_SLD : NULL;
            const float *bb = last ? bias : NULL;
            const float *a = last && add ? add + m * ld_add : NULL;
            float *out = last ? y + m * ldy : scratch + m * G32_SLD;
            const int64_t ld_out = last ? ldy : G32_SLD;
            const int n_last = last ? last_n : 16;
            switch ((int)rows) {
#define G32_TILE(R)                                                                             \
    case R:                                                                                     \
        gemm_f32_tile(x + m * ldx + k0, ldx, R, p + k0 * 16, blk, NB, kc, tpf, pos, step, in,   \
                      bb, a, ld_add, out, ld_out, n_last);                                      \
        break;
                G32_TILE(1) G32_TILE(2) G32_TILE(3) G32_TILE(4) G32_TILE(5) G32_TILE(6)
#if G32_MR > 6
                G32_TILE(7) G32_TILE(8)
#endif
#undef G32_TILE
            }
            m += rows;
        }
    }
}

/* y = x W^T + bias + add (the fp32 section's semantics); p in its packed layout for N outputs
 * of K inputs. Returns 0. */
int gemm_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const float *p, int64_t N,
             const float *bias, const float *add, int64_t ld_add, float *y, int64_t ldy,
             int num_threads) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t blk = K * 16, blocks = (N + 15) / 16;
    const int64_t kb = (K + G32_KC - 1) / G32_KC, kc = (K + kb - 1) / kb; /* kc >= G32_KC/2 */
    int64_t chunk_rows = G32_CHUNK_BYTES / (4 * kc) > G32_MR ? G32_CHUNK_BYTES / (4 * kc) : G32_MR;
    if (kb > 1 && chunk_rows > G32_SCRATCH_ROWS) chunk_rows = G32_SCRATCH_ROWS;
    const int nt = blocks < num_threads ? (int)blocks : num_threads;
#pragma omp parallel num_threads(nt)
    {
        float scratch[kb > 1 ? G32_SCRATCH_ROWS * G32_SLD : 1];
        int64_t lo, hi;
        gemm_thread_blocks(blocks, &lo, &hi);
        /* chunks of as even a size as they can have (no last chunk of a few rows, which
         * would stream every panel for them alone) */
        const int64_t chunks = (M + chunk_rows - 1) / chunk_rows;
        for (int64_t c = 0, m0 = 0; c < chunks; c++) {
            const int64_t rows = M * (c + 1) / chunks - M * c / chunks;
            for (int64_t b0 = lo; b0 < hi; b0 += G32_NB) {
                const int nb = hi - b0 < G32_NB ? (int)(hi - b0) : G32_NB;
                const int64_t b1 = b0 + nb; /* the next panel's first block */
                const int64_t left = N - 16 * (b1 - 1); /* outputs from the last block on */
                /* the next panel: this chunk's next, else the next chunk's first */
                const float *pf = b1 < hi ? p + b1 * blk : m0 + rows < M ? p + lo * blk : NULL;
                switch (nb) {
#define G32_PANEL(B)                                                                          \
    case B:                                                                                   \
        gemm_f32_panel(x + m0 * ldx, ldx, rows, p + b0 * blk, blk, B, K, kb, pf,              \
                       bias ? bias + 16 * b0 : NULL, add ? add + m0 * ld_add + 16 * b0 : NULL, \
                       ld_add, y + m0 * ldy + 16 * b0, ldy, left >= 16 ? 16 : (int)left,       \
                       scratch);                                                              \
        break;
                    G32_PANEL(1)
#if G32_NB > 1
                    G32_PANEL(2) G32_PANEL(3)
#endif
#undef G32_PANEL
                }
            }
            m0 += rows;
        }
    }
    return 0;
}
