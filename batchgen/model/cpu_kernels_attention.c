/* The attention kernels' internals (part of cpu_kernels.c's one translation unit, included by
 * it; the entry points paged_attention_*, prefix_attention_merge_* and store_kv_* are there):
 * per-token attention of decodes, 16-row tiles of prefills and extends, shared prefixes
 * (cascades) merged into their rows, and int8 quantization of new K/V rows. Layouts and
 * semantics: the header comment of cpu_kernels.c. */

/* TILE_DPBF16: the tiles' q.k (prefills, extends, shared prefixes) on AVX512-BF16 dot products:
 * the keys stay bf16 rows, the queries bf16 pairs, and each instruction adds two exact products
 * in fp32 (then the scale). cpu_kernels.py asks for it (BATCHGEN_TILE_DPBF16) on CPUs without
 * AMX; with AMX the fp32 FMAs measured faster. */
#if defined(__AVX512BF16__) && defined(BATCHGEN_TILE_DPBF16)
#define TILE_DPBF16 1
typedef uint32_t u32_alias __attribute__((may_alias));
#endif

typedef struct {
    const void *q;       /* fp32 or bf16 (bf16) */
    const void *k_cache; /* fp32 or bf16 (bf16) */
    const void *v_cache;
    const int32_t *block_tables;
    const int32_t *cu_seqlens_q;
    const int32_t *seq_lens;
    const int32_t *k_start;
    const int32_t *seqs;
    void *out; /* fp32 or bf16 (out_bf16) */
    float *lse;
    int64_t q_stride;
    int64_t bt_stride;
    int num_seqs;
    int num_heads;
    int num_kv_heads;
    int head_dim;
    int block_size;
    int max_keys; /* longest key range of any selected sequence (scratch size) */
    float scale;
    int bf16;     /* q (and, unless kv_i8, k_cache and v_cache) hold bf16 (else fp32) */
    int out_bf16; /* out holds bf16 (else fp32) */
    int kv_i8;    /* k_cache, v_cache hold int8 with scales k_scale, v_scale (else q's dtype) */
    const float *k_scale; /* [num_blocks, block_size, Hkv]: scale of slot s, head h at s*Hkv+h */
    const float *v_scale;
    int window; /* sliding window (keys p-window+1 .. p), 0: none */
    float softcap; /* scores -> softcap * tanh(score / softcap); 0: none */
} Args;

typedef struct {
    const Args *a;
    int64_t item_begin, item_end; /* items i = seq_index * Hkv + kv_head */
    int failed;
} Task;

/* keys ahead of the current one whose K/V rows are prefetched */
#define PREFETCH 16

/* Prefetch the row of D elements (fp32, bf16 or int8 (I8)) at p: one hint per 64-byte line. */
static inline __attribute__((always_inline)) void prefetch_row(const void *p, const int D,
                                                               const int BF, const int I8) {
    for (int c = 0; c < D * (I8 ? 1 : BF ? 2 : 4); c += 64) __builtin_prefetch((const char *)p + c);
}

/* A chunk's dot products r[jj*G + g] (key j0 + jj, row g; jj < KPC) into scores[g*n + j0 + jj]
 * for the keys below n, times each key's scale for int8 keys (I8). */
static inline __attribute__((always_inline)) void store_chunk_scores(
    const float *r, int j0, int n, const int KPC, const int G, const int D, const int I8,
    const float *ks, const int64_t *key_off, float *scores) {
    const int m = n - j0 < KPC ? n - j0 : KPC;
    for (int jj = 0; jj < m; jj++) {
        const float sk = I8 ? ks[key_off[j0 + jj] / D] : 1.0f;
        for (int g = 0; g < G; g++)
            scores[g * n + j0 + jj] = I8 ? r[jj * G + g] * sk : r[jj * G + g];
    }
}

/* scores[g*n + j] = qs[g] . k_j for the n keys at k_base + key_off[j] (elements; fp32, or bf16
 * keys (BF), or int8 keys (I8): then k_j = ks[key_off[j] / D] * the integers, the scale applied
 * once to the fp32 dot product). Keys go in chunks of 16/G (rounded down) so that one hsum16
 * reduces all G x (16/G) dot products of a chunk (lanes past them are zero) and each key row is
 * loaded once. The value rows of the same keys (at v_base + key_off[j]) are prefetched as their
 * keys are read: p.v reads them next. G (<= 16), D (a multiple of 16), BF and I8 are compile-time
 * constants at each call site (always inlined): the loops unroll into registers. */
static inline __attribute__((always_inline)) void qk_v16(const float *qs, const void *k_base,
                                                         const void *v_base, const float *ks,
                                                         const int64_t *key_off, int n,
                                                         const int G, const int D, const int BF,
                                                         const int I8, float *scores) {
    const int KPC = 16 / G; /* keys per chunk */
    for (int jj = 0; jj < PREFETCH && jj < n; jj++) /* the first keys: nothing fetched them */
        prefetch_row(at_kv(k_base, key_off[jj], BF, I8), D, BF, I8);
    for (int j0 = 0; j0 < n; j0 += KPC) {
        v16 acc[16];
        for (int i = KPC * G; i < 16; i++) acc[i] = (v16){0};
        for (int jj = 0; jj < KPC; jj++) { /* key rows come from scattered blocks: prefetch */
            const int ahead = j0 + jj + PREFETCH < n ? j0 + jj + PREFETCH : n - 1;
            prefetch_row(at_kv(k_base, key_off[ahead], BF, I8), D, BF, I8);
            /* and the value rows p.v reads next, while the keys' dot products run */
            prefetch_row(at_kv(v_base, key_off[j0 + jj < n ? j0 + jj : n - 1], BF, I8), D, BF, I8);
        }
        for (int jj = 0; jj < KPC; jj++) {
            /* past the last key: reread it (the lanes are dropped below) */
            const int64_t kp = key_off[j0 + jj < n ? j0 + jj : n - 1];
            v16 kv[16]; /* D / 16 used; fixed sizes throughout: a VLA stays in memory */
            for (int c = 0; c < D / 16; c++) kv[c] = load16_kv(k_base, kp + 16 * c, BF, I8);
            for (int g = 0; g < G; g++) {
                v16 s = load16(qs + g * D) * kv[0];
                for (int c = 1; c < D / 16; c++) s += load16(qs + g * D + 16 * c) * kv[c];
                acc[jj * G + g] = s;
            }
        }
        float r[16];
        store16(r, hsum16(acc));
        store_chunk_scores(r, j0, n, KPC, G, D, I8, ks, key_off, scores);
    }
}

#if defined(__AVX512BF16__)
/* qk_v16 for bf16 q and K with vdpbf16ps: scores[g*n + j] = scale * (q[g] . k_j), q_h the G
 * unscaled bf16 rows; each instruction sums pairs of exact bf16 products into fp32 lanes;
 * value rows prefetched as there. D a multiple of 32. */
static inline __attribute__((always_inline)) void qk_dpbf16(const uint16_t *q_h, float scale,
                                                            const uint16_t *k_base,
                                                            const uint16_t *v_base,
                                                            const int64_t *key_off, int n,
                                                            const int G, const int D,
                                                            float *scores) {
    const int KPC = 16 / G;
    __m512bh qv[32]; /* [G][D / 32], G * D <= 1024 */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / 32; c++)
            qv[g * (D / 32) + c] = (__m512bh)_mm512_loadu_si512(q_h + g * D + 32 * c);
    for (int jj = 0; jj < PREFETCH && jj < n; jj++) prefetch_row(k_base + key_off[jj], D, 1, 0);
    for (int j0 = 0; j0 < n; j0 += KPC) {
        v16 acc[16];
        for (int i = KPC * G; i < 16; i++) acc[i] = (v16){0};
        for (int jj = 0; jj < KPC; jj++) { /* as in qk_v16 */
            const int ahead = j0 + jj + PREFETCH < n ? j0 + jj + PREFETCH : n - 1;
            prefetch_row(k_base + key_off[ahead], D, 1, 0);
            prefetch_row(v_base + key_off[j0 + jj < n ? j0 + jj : n - 1], D, 1, 0);
        }
        for (int jj = 0; jj < KPC; jj++) {
            const uint16_t *kp = k_base + key_off[j0 + jj < n ? j0 + jj : n - 1];
            __m512bh kv[8];
            for (int c = 0; c < D / 32; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kp + 32 * c);
            for (int g = 0; g < G; g++) {
                const __m512bh *qg = qv + g * (D / 32);
                __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qg[0], kv[0]);
                for (int c = 1; c < D / 32; c++) s = _mm512_dpbf16_ps(s, qg[c], kv[c]);
                acc[jj * G + g] = (v16)s;
            }
        }
        float r[16];
        store16(r, hsum16(acc) * scale);
        const int m = n - j0 < KPC ? n - j0 : KPC;
        for (int jj = 0; jj < m; jj++)
            for (int g = 0; g < G; g++) scores[g * n + j0 + jj] = r[jj * G + g];
    }
}
#endif

/* out rows g (out + g*D, fp32) = sum_j scores[g*n + j] v_j; int8 values (I8): v_j =
 * vs[key_off[j] / D] * the integers, the scale folded into the weight. G, D, BF, I8 compile-time
 * constants as above. */
static inline __attribute__((always_inline)) void pv_v16(const float *scores, const void *v_base,
                                                         const float *vs, const int64_t *key_off,
                                                         int n, const int G, const int D,
                                                         const int BF, const int I8, float *out) {
    v16 o[64]; /* [G][D / 16], G * D <= 1024 */
    for (int i = 0; i < G * (D / 16); i++) o[i] = (v16){0};
    for (int j = 0; j < n; j++) {
        const int64_t vp = key_off[j];
        prefetch_row(at_kv(v_base, key_off[j + PREFETCH < n ? j + PREFETCH : n - 1], BF, I8), D,
                     BF, I8);
        v16 vv[16];
        for (int c = 0; c < D / 16; c++) vv[c] = load16_kv(v_base, vp + 16 * c, BF, I8);
        const float sv = I8 ? vs[vp / D] : 1.0f;
        for (int g = 0; g < G; g++) {
            const float p = I8 ? scores[g * n + j] * sv : scores[g * n + j];
            for (int c = 0; c < D / 16; c++) o[g * (D / 16) + c] += p * vv[c];
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / 16; c++) store16(out + g * D + 16 * c, o[g * (D / 16) + c]);
}

#if VL == 8
/* qk_v16 and pv_v16 at AVX2's 8 lanes (builds without AVX-512, where GCC keeps a v16 on the
 * stack): the same scores and sums in registers of 8 lanes and 16 of them, so a chunk holds
 * 8/G keys (G <= 8), a key row is read 8 elements at a time (not kept whole), and p.v runs over
 * column slices of at most 12 accumulators. Each output's sum over keys runs in the same order
 * as pv_v16's; q.k sums its 8 lanes, not 16, in hsum8's order. */
static inline __attribute__((always_inline)) void qk_v8(const float *qs, const void *k_base,
                                                        const void *v_base, const float *ks,
                                                        const int64_t *key_off, int n, const int G,
                                                        const int D, const int BF, const int I8,
                                                        float *scores) {
    const int KPC = 8 / G; /* keys per chunk */
    for (int jj = 0; jj < PREFETCH && jj < n; jj++)
        prefetch_row(at_kv(k_base, key_off[jj], BF, I8), D, BF, I8);
    for (int j0 = 0; j0 < n; j0 += KPC) {
        vn acc[8];
        for (int i = KPC * G; i < 8; i++) acc[i] = (vn){0};
        for (int jj = 0; jj < KPC; jj++) { /* as in qk_v16 */
            const int ahead = j0 + jj + PREFETCH < n ? j0 + jj + PREFETCH : n - 1;
            prefetch_row(at_kv(k_base, key_off[ahead], BF, I8), D, BF, I8);
            prefetch_row(at_kv(v_base, key_off[j0 + jj < n ? j0 + jj : n - 1], BF, I8), D, BF, I8);
        }
        /* unrolled whole: else GCC keeps acc on the stack and each FMA waits for the store of
         * the one before (the whole kernel 1.4-1.5x slower with its K/V in cache, AMD Zen 3) */
#pragma GCC unroll 8
        for (int jj = 0; jj < KPC; jj++) {
            const int64_t kp = key_off[j0 + jj < n ? j0 + jj : n - 1];
#pragma GCC unroll 32
            for (int c = 0; c < D / 8; c++) {
                const vn kc = loadn_kv(k_base, kp + 8 * c, BF, I8);
#pragma GCC unroll 8
                for (int g = 0; g < G; g++) {
                    const vn qc = loadn(qs + g * D + 8 * c);
                    acc[jj * G + g] = c == 0 ? qc * kc : acc[jj * G + g] + qc * kc;
                }
            }
        }
        float r[8];
        storen(r, hsum8(acc));
        store_chunk_scores(r, j0, n, KPC, G, D, I8, ks, key_off, scores);
    }
}

/* columns of out each pass of pv_v8 sums: G x cols/8 accumulators, at most 12 (of 16 ymm), and
 * a divisor of D (a multiple of 16) */
static inline __attribute__((always_inline)) int pv_v8_cols(const int G, const int D) {
    int cols = 12 / G * 8;
    if (cols > D) cols = D;
    while (D % cols) cols -= 8;
    return cols;
}

static inline __attribute__((always_inline)) void pv_v8(const float *scores, const void *v_base,
                                                        const float *vs, const int64_t *key_off,
                                                        int n, const int G, const int D,
                                                        const int BF, const int I8, float *out) {
    const int cols = pv_v8_cols(G, D), W = cols / 8; /* W registers per row */
    for (int c0 = 0; c0 < D; c0 += cols) {
        vn o[12];
        for (int i = 0; i < G * W; i++) o[i] = (vn){0};
        for (int j = 0; j < n; j++) {
            const int64_t vp = key_off[j];
            if (c0 == 0)
                prefetch_row(at_kv(v_base, key_off[j + PREFETCH < n ? j + PREFETCH : n - 1], BF,
                                   I8), D, BF, I8);  /* the first pass brings the rows in */
            vn vv[12];
            for (int c = 0; c < W; c++) vv[c] = loadn_kv(v_base, vp + c0 + 8 * c, BF, I8);
            const float sv = I8 ? vs[vp / D] : 1.0f;
            for (int g = 0; g < G; g++) {
                const float p = I8 ? scores[g * n + j] * sv : scores[g * n + j];
                for (int c = 0; c < W; c++) o[g * W + c] += p * vv[c];
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < W; c++) storen(out + g * D + c0 + 8 * c, o[g * W + c]);
    }
}
#define qk_vec qk_v8
#define pv_vec pv_v8
#else
#define qk_vec qk_v16
#define pv_vec pv_v16
#endif

/* One query token of one (sequence, KV head): G rows of q against n keys whose rows start at
 * k_cache/v_cache + key_off[j] + kv_head*D (elements). With fast = 1, G <= 16 and D is a
 * multiple of 16, both compile-time constants (see attend_row_group_dispatch); BF (constant):
 * q holds bf16, and so do the caches unless I8 (constant): int8 caches whose row at element off
 * has the scale k_scale/v_scale[off / D] (off including kv_head*D). */
static inline __attribute__((always_inline)) void attend_row_group(
    const Args *a, const int64_t *key_off, int n, const void *q_row, int kv_head,
    void *out_row, float *lse_row, float *scores, float *qs, float *acc, const int G,
    const int D, const int fast, const int BF, const int I8) {
    const void *k_base = at_kv(a->k_cache, (int64_t)kv_head * D, BF, I8);
    const void *v_base = at_kv(a->v_cache, (int64_t)kv_head * D, BF, I8);
    const float *ks = I8 ? a->k_scale + kv_head : NULL; /* ks[key_off[j] / D]: key j's scale */
    const float *vs = I8 ? a->v_scale + kv_head : NULL;
    const int obf = BF && a->out_bf16; /* 0 for fp32 */
    void *out_h = at_any(out_row, (int64_t)kv_head * G * D, obf); /* the G heads of this KV head */
    if (n <= 0) {
        memset(out_h, 0, (size_t)G * D * (obf ? 2 : 4));
        if (lse_row)
            for (int g = 0; g < G; g++) lse_row[kv_head * G + g] = -INFINITY;
        return;
    }
    const void *q_h = at_any(q_row, (int64_t)kv_head * G * D, BF);
    /* scores[g][j] = scale * q[g] . k_j */
#if defined(__AVX512BF16__)
    if (fast && BF && !I8 && D % 32 == 0) {
        qk_dpbf16((const uint16_t *)q_h, a->scale, (const uint16_t *)k_base,
                  (const uint16_t *)v_base, key_off, n, G, D,
                  scores);
    } else
#endif
    {
        /* qs[g][d] = q * scale */
#pragma omp simd
        for (int i = 0; i < G * D; i++) qs[i] = load1_any(q_h, i, BF) * a->scale;
        if (fast) {
            qk_vec(qs, k_base, v_base, ks, key_off, n, G, D, BF, I8, scores);
        } else {
            for (int j = 0; j < n; j++) {
                const void *kp = at_kv(k_base, key_off[j], BF, I8);
                const float sk = I8 ? ks[key_off[j] / D] : 1.0f;
                for (int g = 0; g < G; g++) {
                    const float *qg = qs + g * D;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < D; d++) s += qg[d] * load1_kv(kp, d, BF, I8);
                    scores[g * n + j] = I8 ? s * sk : s;
                }
            }
        }
    }
    if (a->softcap > 0.0f) {
        const float cap = a->softcap, inv = 1.0f / a->softcap;
        for (int i = 0; i < G * n; i++) scores[i] = cap * tanhf(scores[i] * inv);
    }
    /* softmax per row, normalized in place */
    for (int g = 0; g < G; g++)
        softmax_row(scores + g * n, n, lse_row ? lse_row + kv_head * G + g : NULL);
    /* out[g] = sum_j p[g][j] v_j, in fp32: straight into out, or into acc and then rounded */
    float *dst = obf ? acc : (float *)out_h;
    if (fast) {
        pv_vec(scores, v_base, vs, key_off, n, G, D, BF, I8, dst);
    } else {
        memset(acc, 0, sizeof(float) * G * D);
        for (int j = 0; j < n; j++) {
            const void *vp = at_kv(v_base, key_off[j], BF, I8);
            const float sv = I8 ? vs[key_off[j] / D] : 1.0f;
            for (int g = 0; g < G; g++) {
                const float p = I8 ? scores[g * n + j] * sv : scores[g * n + j];
                float *ag = acc + g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ag[d] += p * load1_kv(vp, d, BF, I8);
            }
        }
        if (!obf) memcpy(dst, acc, sizeof(float) * G * D);
    }
    if (obf) store_row_any(out_h, acc, G * D, 1);
}

/* attend_row_group specialized for the common (G, D) pairs and every dtype combination; anything
 * else runs generic code. */
static void attend_row_group_dispatch(const Args *a, const int64_t *key_off, int n,
                                      const void *q_row, int kv_head, void *out_row,
                                      float *lse_row, float *scores, float *qs, float *acc) {
    const int G = a->num_heads / a->num_kv_heads;
    const int D = a->head_dim;
#define CALL(g, d, fast, bf, i8)                                                              \
    attend_row_group(a, key_off, n, q_row, kv_head, out_row, lse_row, scores, qs, acc, g, d,   \
                     fast, bf, i8)
#define CASE(g, d)                                                                             \
    if (G == g && D == d) {                                                                    \
        if (a->kv_i8) {                                                                        \
            if (a->bf16)                                                                       \
                CALL(g, d, 1, 1, 1);                                                           \
            else                                                                               \
                CALL(g, d, 1, 0, 1);                                                           \
        } else if (a->bf16)                                                                    \
            CALL(g, d, 1, 1, 0);                                                               \
        else                                                                                   \
            CALL(g, d, 1, 0, 0);                                                               \
        return;                                                                                \
    }
    /* G = 3: SmolLM2's 9:3 and 15:5 heads, Phi-4-mini's 24:8; 5, 6, 7: Qwen2.5's 40:8, 12:2,
     * 14:2 and 28:4; D = 96: Phi-3-mini's 32:32; D = 256: Gemma 2 and 3's 2:1 groups. Each pair
     * adds about a second to the build (four dtype variants). */
    CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64)
    CASE(8, 64)
    CASE(1, 128) CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128) CASE(6, 128) CASE(7, 128)
    CASE(8, 128)
    CASE(1, 96) CASE(2, 256)
#undef CASE
    if (a->kv_i8) {
        if (a->bf16)
            CALL(G, D, 0, 1, 1);
        else
            CALL(G, D, 0, 0, 1);
    } else if (a->bf16)
        CALL(G, D, 0, 1, 0);
    else
        CALL(G, D, 0, 0, 0);
#undef CALL
}

static void run_task(Task *t) {
    const Args *a = t->a;
    const int G = a->num_heads / a->num_kv_heads;
    const int D = a->head_dim;
    const int bs = a->block_size;
    const int64_t kv_row = (int64_t)a->num_kv_heads * D; /* elements per slot */
    const size_t n_scores = (size_t)G * (a->max_keys + 16);
    float *scratch = (float *)malloc(sizeof(float) * (n_scores + 2 * (size_t)G * D));
    int64_t *key_off = (int64_t *)malloc(sizeof(int64_t) * ((size_t)a->max_keys + 1));
    if (!scratch || !key_off) {
        free(scratch);
        free(key_off);
        t->failed = 1;
        return;
    }
    float *scores = scratch;
    float *qs = scores + n_scores;
    float *acc = qs + (size_t)G * D;
    int prev_b = -1;
    for (int64_t item = t->item_begin; item < t->item_end; item++) {
        const int b = a->seqs[item / a->num_kv_heads];
        const int kv_head = (int)(item % a->num_kv_heads);
        const int q0 = a->cu_seqlens_q[b];
        const int q_len = a->cu_seqlens_q[b + 1] - q0;
        const int seq_len = a->seq_lens[b];
        const int k0 = a->k_start ? a->k_start[b] : 0;
        if (b != prev_b) { /* element offset of each key's slot row, k0 .. seq_len-1 */
            const int32_t *table = a->block_tables + (int64_t)b * a->bt_stride;
            for (int pos = k0, j = 0; pos < seq_len; pos++, j++)
                key_off[j] = ((int64_t)table[pos / bs] * bs + pos % bs) * kv_row;
            prev_b = b;
        }
        for (int i = 0; i < q_len; i++) {
            const int pos = seq_len - q_len + i;
            const int64_t row = q0 + i;
            /* first key the row sees: k0, or its window's first */
            const int lo = a->window > 0 && pos - a->window + 1 > k0 ? pos - a->window + 1 : k0;
            attend_row_group_dispatch(a, key_off + (lo - k0), pos + 1 - lo,
                                      at_any(a->q, row * a->q_stride, a->bf16), kv_head,
                                      at_any(a->out, row * (int64_t)a->num_heads * D, a->out_bf16),
                                      a->lse ? a->lse + row * (int64_t)a->num_heads : NULL,
                                      scores, qs, acc);
        }
    }
    free(scratch);
    free(key_off);
}

/* ---- tiled attention for runs of new tokens (prefills, extends) ----
 * A tile is 16 query rows, one per vector lane: row r of a (sequence, KV head) item is new token
 * r / G with query head kv_head*G + r % G. Scores are kept transposed, one vector per key with a
 * lane per row (S^T[j] = sum_d K[j][d] * Q^T[d], K[j][d] broadcast), so the online softmax's row
 * maxima, sums and rescales are plain vector ops, and the output accumulates transposed too
 * (O^T[d] += P^T[j] * V[j][d]). An item gathers its keys and values once into contiguous
 * buffers (padded to a multiple of 16 keys) that all its tiles then read. */

#define TILE 16
#define ITEM_ROWS 128 /* query rows (tokens x G) per work item */
/* score accumulators tile_attend keeps in registers: with the q row and a broadcast key element
 * they fill a zmm file (32) with AVX-512 or a ymm file (16) with AVX2 */
#if defined(__AVX512F__)
#define TILE_KEYS 16
#else
#define TILE_KEYS 8
#endif

typedef struct {
    int seq;      /* index into Args.seqs */
    int kv_head;
    int t_begin;  /* new tokens t_begin .. t_end-1 of the sequence */
    int t_end;
} TileItem;

/* Lanes lane0 .. lane0+VL-1 of a tile (all 16 with AVX-512): qt and ot rows of 16 floats per d,
 * read and written at lane0; pos, m, l: 16 per tile. pos_min/pos_max span the whole tile. */
static inline __attribute__((always_inline)) void tile_attend_lanes(
    const float *kbuf, const float *vbuf, int num_keys, int k0, const float *qt,
    const int32_t *pos_l, int pos_min, int pos_max, const int32_t *lo_l, int lo_min, int lo_max,
    float softcap, float *ot, float *m_out, float *l_out, int lane0, int resume, const int D,
    const int DP, float qscale) {
    vn m = (vn){0} - 1e30f, l = {0};
    vin pos, lo;
    memcpy(&pos, pos_l + lane0, sizeof pos);
    memcpy(&lo, lo_l + lane0, sizeof lo);
    qt += lane0;
    ot += lane0;
    if (resume) { /* carry on from the state ot, m, l hold */
        m = loadn(m_out + lane0);
        l = loadn(l_out + lane0);
    } else {
        for (int d = 0; d < D; d++) storen(ot + 16 * d, (vn){0});
    }
    const int last = pos_max - k0 + 1 < num_keys ? pos_max - k0 + 1 : num_keys; /* keys seen */
    /* blocks of 16 keys wholly before every row's window are skipped */
    const int first = lo_min > k0 ? (lo_min - k0) & ~15 : 0;
    for (int j0 = first; j0 < last; j0 += 16) {
        vn s[16];
#if defined(TILE_DPBF16)
        if (DP) { /* bf16 keys [j][D] and query pairs: each instruction sums two exact products */
            const u32_alias *kb2 = (const u32_alias *)kbuf + (int64_t)j0 * (D / 2);
            const u32_alias *q2 = (const u32_alias *)qt;
            for (int jb = 0; jb < 16; jb += TILE_KEYS) {
                __m512 acc[TILE_KEYS];
                for (int j = 0; j < TILE_KEYS; j++) acc[j] = _mm512_setzero_ps();
                for (int dp = 0; dp < D / 2; dp++) {
                    const __m512bh q = (__m512bh)_mm512_loadu_si512(q2 + 16 * dp);
                    for (int j = 0; j < TILE_KEYS; j++)
                        acc[j] = _mm512_dpbf16_ps(
                            acc[j], q, (__m512bh)_mm512_set1_epi32(kb2[(jb + j) * (D / 2) + dp]));
                }
                for (int j = 0; j < TILE_KEYS; j++) s[jb + j] = (vn)acc[j] * qscale;
            }
        } else
#endif
        {
            const float *kb = kbuf + (int64_t)j0 * D;
            for (int jb = 0; jb < 16; jb += TILE_KEYS) { /* TILE_KEYS accumulators in registers */
                vn acc[TILE_KEYS];
                for (int j = 0; j < TILE_KEYS; j++) acc[j] = (vn){0};
                for (int d = 0; d < D; d++) {
                    const vn q = loadn(qt + 16 * d);
                    for (int j = 0; j < TILE_KEYS; j++) acc[j] += kb[(jb + j) * D + d] * q;
                }
                for (int j = 0; j < TILE_KEYS; j++) s[jb + j] = acc[j];
            }
        }
        if (softcap > 0.0f) {
            const float inv = 1.0f / softcap;
            for (int j = 0; j < 16; j++)
                for (int i = 0; i < VL; i++) s[j][i] = softcap * tanhf(s[j][i] * inv);
        }
        if (k0 + j0 + 15 > pos_min || k0 + j0 < lo_max) { /* some row sees part of it */
            for (int j = 0; j < 16; j++) {
                const vin vis = (pos >= k0 + j0 + j) & (lo <= k0 + j0 + j);
                s[j] = (vn)(((vin)s[j] & vis) | ((vin)((vn){0} - INFINITY) & ~vis));
            }
        }
        vn t[8]; /* the block's maximum as a tree: 4 dependent steps instead of 15 */
        for (int j = 0; j < 8; j++) t[j] = maxn(s[j], s[j + 8]);
        for (int w = 4; w > 0; w /= 2)
            for (int j = 0; j < w; j++) t[j] = maxn(t[j], t[j + w]);
        const vn m_new = maxn(m, t[0]);
        const vn alpha = expn_nonpos(m - m_new);
        vn sum = {0};
        for (int j = 0; j < 16; j++) {
            s[j] = expn_nonpos(s[j] - m_new);
            sum += s[j];
        }
        l = l * alpha + sum;
        m = m_new;
        const float *vb = vbuf + (int64_t)j0 * D;
        int d = 0;
        for (; d + 8 <= D; d += 8) { /* 8 independent accumulator chains keep the FMAs busy */
            vn o[8];
            for (int c = 0; c < 8; c++) o[c] = loadn(ot + 16 * (d + c)) * alpha;
            for (int j = 0; j < 16; j++)
                for (int c = 0; c < 8; c++) o[c] += s[j] * vb[j * D + d + c];
            for (int c = 0; c < 8; c++) storen(ot + 16 * (d + c), o[c]);
        }
        for (; d < D; d++) {
            vn o = loadn(ot + 16 * d) * alpha;
            for (int j = 0; j < 16; j++) o += s[j] * vb[j * D + d];
            storen(ot + 16 * d, o);
        }
    }
    storen(m_out + lane0, m);
    storen(l_out + lane0, l);
}

/* One 16-row tile against keys k0 .. k0+num_keys-1 (kbuf/vbuf rows, zero-padded to a multiple
 * of 16): ot (16 per d, transposed) <- the unnormalised output, m/l[16] <- each row's running
 * max and sum; row lane sees the keys at positions lo_l[lane] .. pos_l[lane] (lo_min, lo_max:
 * the least and greatest lo_l; key blocks before lo_min are not read; scores capped when
 * softcap > 0). With resume, the keys extend
 * the attention whose running state ot, m, l already hold (k0 a multiple of 16 past its keys):
 * the result is the same, bit for bit, as one call over both key ranges. */
static inline __attribute__((always_inline)) void tile_attend(
    const float *kbuf, const float *vbuf, int num_keys, int k0, const float *qt,
    const int32_t *pos_l, int pos_min, int pos_max, const int32_t *lo_l, int lo_min, int lo_max,
    float softcap, float *ot, float *m, float *l, int resume, const int D, const int DP,
    float qscale) {
    for (int lane0 = 0; lane0 < 16; lane0 += VL)
        tile_attend_lanes(kbuf, vbuf, num_keys, k0, qt, pos_l, pos_min, pos_max, lo_l, lo_min,
                          lo_max, softcap, ot, m, l, lane0, resume, D, DP, qscale);
}

/* dp: the tile was loaded by load_tile_pairs and its keys are bf16 rows (TILE_DPBF16 builds
 * only; qscale: the softmax scale, applied to the scores) */
static void tile_attend_dispatch(const float *kbuf, const float *vbuf, int num_keys, int k0,
                                 const float *qt, const int32_t *pos_l, int pos_min, int pos_max,
                                 const int32_t *lo_l, int lo_min, int lo_max, float softcap,
                                 float *ot, float *m, float *l, int resume, int D, int dp,
                                 float qscale) {
#define TILE_ATTEND(d, DP)                                                                     \
    tile_attend(kbuf, vbuf, num_keys, k0, qt, pos_l, pos_min, pos_max, lo_l, lo_min, lo_max,    \
                softcap, ot, m, l, resume, d, DP, qscale)
#if defined(TILE_DPBF16)
    if (dp) {
        if (D == 64)
            TILE_ATTEND(64, 1);
        else if (D == 128)
            TILE_ATTEND(128, 1);
        else
            TILE_ATTEND(D, 1);
        return;
    }
#endif
    if (D == 64)
        TILE_ATTEND(64, 0);
    else if (D == 128)
        TILE_ATTEND(128, 0);
    else
        TILE_ATTEND(D, 0);
#undef TILE_ATTEND
}

/* lower bounds of rows without a window: every key position is >= */
#define NO_LOWER (-(1 << 30))
static const int32_t NO_LOWER16[16] = {NO_LOWER, NO_LOWER, NO_LOWER, NO_LOWER, NO_LOWER,
                                       NO_LOWER, NO_LOWER, NO_LOWER, NO_LOWER, NO_LOWER,
                                       NO_LOWER, NO_LOWER, NO_LOWER, NO_LOWER, NO_LOWER,
                                       NO_LOWER};

/* One round of a transpose of r[0..N) (vectors of type V, N lanes): rows i and i + B (i & B
 * clear) swap their off-diagonal blocks of B lanes, lanes LO (__VA_ARGS__) and HI of the pair. */
#define SWAP_BLOCKS(V, N, B, HI, ...)                                                           \
    for (int i = 0; i < (N); i++) {                                                            \
        if (i & (B)) continue;                                                                 \
        const V a = r[i], b = r[i + (B)];                                                      \
        r[i] = __builtin_shufflevector(a, b, __VA_ARGS__);                                     \
        r[i + (B)] = __builtin_shufflevector(a, b, HI);                                        \
    }
/* r[0..16) in place from rows to columns: afterwards r[j][i] is the old r[i][j]. Four rounds
 * swap the off-diagonal blocks of 8, 4, 2 and 1 lanes: 64 two-source shuffles in all. */
#define HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline void transpose16(v16 *r) {
    SWAP_BLOCKS(v16, 16, 8, HI_8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
    SWAP_BLOCKS(v16, 16, 4, HI_4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
    SWAP_BLOCKS(v16, 16, 2, HI_2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
    SWAP_BLOCKS(v16, 16, 1, HI_1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
}
#if VL == 8
/* transpose16 for AVX2 builds, where a v16 lives on the stack: r[0..8) (8 lanes each) in place
 * from rows to columns, the same three rounds of swaps at blocks of 4, 2 and 1 lanes. A 16-lane
 * tile transposes as 8 x 8 quarters. */
#define HI8_4 4, 5, 6, 7, 12, 13, 14, 15
#define HI8_2 2, 3, 10, 11, 6, 7, 14, 15
#define HI8_1 1, 9, 3, 11, 5, 13, 7, 15
static inline __attribute__((always_inline)) void transpose8(vn *r) {
    SWAP_BLOCKS(vn, 8, 4, HI8_4, 0, 1, 2, 3, 8, 9, 10, 11)
    SWAP_BLOCKS(vn, 8, 2, HI8_2, 0, 1, 8, 9, 4, 5, 12, 13)
    SWAP_BLOCKS(vn, 8, 1, HI8_1, 0, 8, 2, 10, 4, 12, 6, 14)
}
#endif
#undef SWAP_BLOCKS

/* A tile's query rows (fp32, or bf16 when bf) into its transposed fp32 layout:
 * qt[16*d + lane] = rows[lane][d] * scale. */
static void load_tile(const void *const *rows, int bf, float scale, int D, float *qt) {
    if (D % 16) {
        for (int lane = 0; lane < 16; lane++)
            for (int d = 0; d < D; d++)
                qt[16 * d + lane] =
                    (bf ? load1_any(rows[lane], d, 1) : load1_any(rows[lane], d, 0)) * scale;
        return;
    }
#if VL == 8
    for (int c = 0; c < D; c += 8)
        for (int h = 0; h < 16; h += 8) { /* lanes h .. h+7, elements c .. c+7 */
            vn r[8];
            if (bf)
                for (int i = 0; i < 8; i++) r[i] = loadn_kv(rows[h + i], c, 1, 0) * scale;
            else
                for (int i = 0; i < 8; i++) r[i] = loadn_kv(rows[h + i], c, 0, 0) * scale;
            transpose8(r);
            for (int j = 0; j < 8; j++) storen(qt + 16 * (c + j) + h, r[j]);
        }
#else
    for (int c = 0; c < D; c += 16) {
        v16 r[16];
        if (bf)
            for (int lane = 0; lane < 16; lane++) r[lane] = load16_any(rows[lane], c, 1) * scale;
        else
            for (int lane = 0; lane < 16; lane++) r[lane] = load16_any(rows[lane], c, 0) * scale;
        transpose16(r);
        for (int j = 0; j < 16; j++) store16(qt + 16 * (c + j), r[j]);
    }
#endif
}

#if defined(TILE_DPBF16)
/* A tile's bf16 query rows as pairs: qt[16*p + lane] (32 bits) = rows[lane][2p], [2p+1]
 * (unscaled). D a multiple of 32. */
static void load_tile_pairs(const void *const *rows, int D, float *qt) {
    for (int c = 0; c < D / 2; c += 16) {
        v16 r[16];
        for (int lane = 0; lane < 16; lane++) memcpy(&r[lane], (const uint32_t *)rows[lane] + c, 64);
        transpose16(r);
        for (int j = 0; j < 16; j++) memcpy(qt + 16 * (c + j), &r[j], 64);
    }
}

/* Whether a tile of this call runs on bf16 pairs: bf16 q and cache, D a multiple of 32. */
static inline int tile_pairs(int bf, int kv_i8, int D) { return bf && !kv_i8 && D % 32 == 0; }
#else
static inline int tile_pairs(int bf, int kv_i8, int D) {
    (void)bf, (void)kv_i8, (void)D;
    return 0;
}
#endif

/* Key row j of a tile's key buffer: the cache row at element off kept as bf16 (dp: tiles on bf16
 * pairs), else as fp32 (load_kv_row). */
static inline void load_tile_key(float *kbuf, int64_t j, int dp, const void *k_cache,
                                 const float *k_scale, int64_t off, int D, int bf, int kv_i8) {
    if (dp)
        memcpy((uint16_t *)kbuf + j * D, (const uint16_t *)k_cache + off, 2 * (size_t)D);
    else
        load_kv_row(kbuf + j * D, k_cache, k_scale, off, D, bf, kv_i8);
}

/* Zero the key and value rows n .. (n rounded up to 16) - 1 of a tile's buffers. */
static inline void pad_tile_keys(float *kbuf, float *vbuf, int n, int dp, int D) {
    const size_t rows = (size_t)(((n + 15) & ~15) - n);
    if (dp)
        memset((uint16_t *)kbuf + (int64_t)n * D, 0, 2 * (size_t)D * rows);
    else
        memset(kbuf + (int64_t)n * D, 0, sizeof(float) * D * rows);
    memset(vbuf + (int64_t)n * D, 0, sizeof(float) * D * rows);
}

/* A tile's query rows in the layout tile_attend reads: bf16 pairs (dp) or scaled fp32. */
static inline void load_tile_any(const void *const *rows, int bf, int dp, float scale, int D,
                                 float *qt) {
#if defined(TILE_DPBF16)
    if (dp) {
        load_tile_pairs(rows, D, qt);
        return;
    }
#endif
    (void)dp;
    load_tile(rows, bf, scale, D, qt);
}

/* The transposed tile output back to rows: out[lane*D + d] = ot[16*d + lane]. */
static void unload_tile(const float *ot, int D, float *out) {
    if (D % 16) {
        for (int lane = 0; lane < 16; lane++)
            for (int d = 0; d < D; d++) out[lane * D + d] = ot[16 * d + lane];
        return;
    }
#if VL == 8
    for (int c = 0; c < D; c += 8)
        for (int h = 0; h < 16; h += 8) {
            vn r[8];
            for (int j = 0; j < 8; j++) r[j] = loadn(ot + 16 * (c + j) + h);
            transpose8(r);
            for (int i = 0; i < 8; i++) storen(out + (h + i) * D + c, r[i]);
        }
#else
    for (int c = 0; c < D; c += 16) {
        v16 r[16];
        for (int j = 0; j < 16; j++) r[j] = load16(ot + 16 * (c + j));
        transpose16(r);
        for (int lane = 0; lane < 16; lane++) store16(out + lane * D + c, r[lane]);
    }
#endif
}

/* One item: gather its keys, then every tile of its rows. Scratch: kbuf and vbuf hold
 * (max_keys + 16) * D floats each, qt, ot and orow 16 * D each. */
static void run_tile_item(const Args *a, const TileItem *it, float *kbuf, float *vbuf, float *qt,
                          float *ot, float *orow) {
    const int G = a->num_heads / a->num_kv_heads;
    const int D = a->head_dim;
    const int bs = a->block_size;
    const int64_t kv_row = (int64_t)a->num_kv_heads * D;
    const int bf = a->bf16;
    const int b = a->seqs[it->seq];
    const int q0 = a->cu_seqlens_q[b];
    const int q_len = a->cu_seqlens_q[b + 1] - q0;
    const int seq_len = a->seq_lens[b];
    const int first_pos = seq_len - q_len; /* position of new token 0 */
    /* the item's first key: k_start, or its first row's window's first key */
    const int ks = a->k_start ? a->k_start[b] : 0;
    const int wlo = first_pos + it->t_begin - a->window + 1;
    const int k0 = a->window > 0 && wlo > ks ? wlo : ks;
    /* keys k0 .. (position of the item's last token), padded with zeros to a multiple of 16 */
    const int num_keys = first_pos + it->t_end - k0 > 0 ? first_pos + it->t_end - k0 : 0;
    const int32_t *table = a->block_tables + (int64_t)b * a->bt_stride;
    const int dp = tile_pairs(bf, a->kv_i8, D); /* keys kept as bf16 rows */
    for (int j = 0; j < num_keys; j++) {
        const int p = k0 + j;
        const int64_t off = ((int64_t)table[p / bs] * bs + p % bs) * kv_row + (int64_t)it->kv_head * D;
        load_tile_key(kbuf, j, dp, a->k_cache, a->k_scale, off, D, bf, a->kv_i8);
        load_kv_row(vbuf + (int64_t)j * D, a->v_cache, a->v_scale, off, D, bf, a->kv_i8);
    }
    pad_tile_keys(kbuf, vbuf, num_keys, dp, D);

    const int rows = (it->t_end - it->t_begin) * G;
    for (int r0 = 0; r0 < rows; r0 += TILE) {
        int32_t pos_l[16], lo_l[16];
        const void *qrows[16];
        int pos_min = 1 << 30, pos_max = -1;
        for (int lane = 0; lane < 16; lane++) { /* lanes past the last row repeat it */
            const int r = r0 + lane < rows ? r0 + lane : rows - 1;
            const int t = it->t_begin + r / G, g = r % G;
            qrows[lane] = at_any(a->q, (int64_t)(q0 + t) * a->q_stride +
                                           (int64_t)(it->kv_head * G + g) * D, bf);
            pos_l[lane] = first_pos + t;
            lo_l[lane] = a->window > 0 ? pos_l[lane] - a->window + 1 : NO_LOWER;
            if (pos_l[lane] < pos_min) pos_min = pos_l[lane];
            if (pos_l[lane] > pos_max) pos_max = pos_l[lane];
        }
        /* lanes are in position order: the first row has the least lower bound */
        const int lo_min = lo_l[0], lo_max = lo_l[15];
        load_tile_any(qrows, bf, dp, a->scale, D, qt);
        float m[16], l[16];
        tile_attend_dispatch(kbuf, vbuf, num_keys, k0, qt, pos_l, pos_min, pos_max, lo_l, lo_min,
                             lo_max, a->softcap, ot, m, l, 0, D, dp, a->scale);
        unload_tile(ot, D, orow);
        for (int lane = 0; lane < 16 && r0 + lane < rows; lane++) {
            const int r = r0 + lane;
            const int t = it->t_begin + r / G, h = it->kv_head * G + r % G;
            const int64_t row = q0 + t;
            const int64_t o = (row * a->num_heads + h) * D;
            const float inv = l[lane] > 0.0f ? 1.0f / l[lane] : 0.0f;
            const float *src = orow + (int64_t)lane * D;
            if (a->out_bf16)
                for (int d = 0; d < D; d++) ((uint16_t *)a->out)[o + d] = f32_to_bf16(src[d] * inv);
            else
                for (int d = 0; d < D; d++) ((float *)a->out)[o + d] = src[d] * inv;
            if (a->lse) a->lse[row * a->num_heads + h] = l[lane] > 0.0f ? m[lane] + logf(l[lane]) : -INFINITY;
        }
    }
}

/* The tiled variant of paged_attention_f32 (see there). Returns 0 on success, nonzero when an
 * allocation failed. */
static int attend_tiled(Args a, int num_threads) {
    const int32_t *seqs = a.seqs, *cu_seqlens_q = a.cu_seqlens_q, *seq_lens = a.seq_lens;
    const int32_t *k_start = a.k_start;
    const int num_seqs = a.num_seqs, num_kv_heads = a.num_kv_heads, head_dim = a.head_dim;
    const int G = a.num_heads / num_kv_heads;
    const int chunk = ITEM_ROWS / G > 0 ? ITEM_ROWS / G : 1; /* tokens per item */
    int64_t num_items = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int b = seqs[s];
        const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        const int keys = seq_lens[b] - (k_start ? k_start[b] : 0);
        if (keys > a.max_keys) a.max_keys = keys;
        num_items += (int64_t)((q_len + chunk - 1) / chunk) * num_kv_heads;
    }
    if (num_items == 0) return 0;
    TileItem *items = (TileItem *)malloc(sizeof(TileItem) * num_items);
    if (!items) return 1;
    {
        int64_t n = 0;
        for (int s = 0; s < num_seqs; s++) {
            const int b = seqs[s];
            const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
            for (int t = 0; t < q_len; t += chunk)
                for (int h = 0; h < num_kv_heads; h++)
                    items[n++] = (TileItem){s, h, t, t + chunk < q_len ? t + chunk : q_len};
        }
    }
    if (num_threads < 1) num_threads = 1;
    if ((int64_t)num_threads > num_items) num_threads = (int)num_items;
    /* per thread: kbuf, vbuf ((max_keys + 16) * D each), qt, ot, orow (16 * D each) */
    const size_t kv_floats = (size_t)(a.max_keys + 16) * head_dim;
    const size_t per_thread = 2 * kv_floats + 3 * 16 * (size_t)head_dim;
    float *scratch = (float *)malloc(sizeof(float) * per_thread * num_threads);
    if (!scratch) {
        free(items);
        return 1;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < num_items; i++) {
#ifdef _OPENMP
        float *kbuf = scratch + per_thread * omp_get_thread_num();
#else
        float *kbuf = scratch;
#endif
        float *vbuf = kbuf + kv_floats, *qt = vbuf + kv_floats, *ot = qt + 16 * (size_t)head_dim;
        run_tile_item(&a, &items[i], kbuf, vbuf, qt, ot, ot + 16 * (size_t)head_dim);
    }
    free(scratch);
    free(items);
    return 0;
}

/* Shared prefixes (cascades) attended by their rows and merged into the rows' results in place.
 * Prefix c < C has the P_c keys at cache slots slots[slot_off[c] .. slot_off[c+1]) (all visible)
 * and the q rows rows[row_off[c] .. row_off[c+1]). For each such row r and head h: attention of
 * q[r, h] over those keys, then out[r, h] <- the log-sum-exp weighted mix of that result and
 * out[r, h] (whose log-sum-exp is lse[r, h]), i.e. attention over the union of both key sets,
 * and lse[r, h] <- the log-sum-exp of the union. No row may belong to two prefixes of one call
 * (nested prefixes take one call per depth). Work items are (prefix, KV head, up to ITEM_ROWS
 * (row, head) pairs): an item reads its prefix's K/V rows straight from the cache, PREFIX_CHUNK
 * keys at a time into a small fp32 buffer (dequantized there for int8), and runs every 16-lane
 * tile of its rows over each chunk, so the cache is read once per item and nothing is gathered.
 * Returns 0 on success, nonzero when an allocation failed. */
#define PREFIX_CHUNK 64 /* keys per chunk: a multiple of 16 */
#define ITEM_TILES (ITEM_ROWS / TILE)

typedef struct {
    int prefix;
    int kv_head;
    int64_t p0, p1; /* (row, head) pairs p0 .. p1-1 of the prefix's rows */
} PrefixItem;

static void run_prefix_item(const void *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const float *k_scale, const float *v_scale,
                            int kv_i8, const int64_t *slots, const int64_t *slot_off,
                            const int64_t *rows, const int64_t *row_off, const PrefixItem *it,
                            float *out, float *lse, int num_heads, int num_kv_heads, int D,
                            float scale, int bf, float *scratch) {
    const int G = num_heads / num_kv_heads;
    const int64_t kv_row = (int64_t)num_kv_heads * D;
    const int c = it->prefix, h = it->kv_head;
    const int prefix_len = (int)(slot_off[c + 1] - slot_off[c]);
    const int64_t *cslots = slots + slot_off[c];
    const int64_t *crows = rows + row_off[c];
    const int num_tiles = (int)((it->p1 - it->p0 + TILE - 1) / TILE);
    /* scratch: kbuf, vbuf [PREFIX_CHUNK][D]; per tile qt, ot [16 * D], m, l [16]; orow [16][D] */
    float *kbuf = scratch, *vbuf = kbuf + PREFIX_CHUNK * (size_t)D;
    float *qts = vbuf + PREFIX_CHUNK * (size_t)D, *ots = qts + ITEM_TILES * 16 * (size_t)D;
    float *ms = ots + ITEM_TILES * 16 * (size_t)D, *ls = ms + ITEM_TILES * 16;
    float *orow = ls + ITEM_TILES * 16;
    const int dp = tile_pairs(bf, kv_i8, D); /* keys kept as bf16 rows */
    int32_t pos[16]; /* every key visible; the padding of the last chunk masked */
    for (int lane = 0; lane < 16; lane++) pos[lane] = prefix_len - 1;
    for (int t = 0; t < num_tiles; t++) {
        const void *qrows[16];
        const int64_t r0 = it->p0 + (int64_t)t * TILE;
        for (int lane = 0; lane < 16; lane++) { /* lanes past the last pair repeat it */
            const int64_t pr = r0 + lane < it->p1 ? r0 + lane : it->p1 - 1;
            qrows[lane] = at_any(q, crows[pr / G] * q_stride + ((int64_t)h * G + pr % G) * D, bf);
        }
        load_tile_any(qrows, bf, dp, scale, D, qts + t * 16 * (size_t)D);
    }
    for (int k0 = 0; k0 < prefix_len; k0 += PREFIX_CHUNK) {
        const int n = prefix_len - k0 < PREFIX_CHUNK ? prefix_len - k0 : PREFIX_CHUNK;
        for (int j = 0; j < n; j++) {
            const int64_t off = cslots[k0 + j] * kv_row + (int64_t)h * D;
            load_tile_key(kbuf, j, dp, k_cache, k_scale, off, D, bf, kv_i8);
            load_kv_row(vbuf + (int64_t)j * D, v_cache, v_scale, off, D, bf, kv_i8);
        }
        pad_tile_keys(kbuf, vbuf, n, dp, D);
        for (int t = 0; t < num_tiles; t++)
            tile_attend_dispatch(kbuf, vbuf, n, k0, qts + t * 16 * (size_t)D, pos,
                                 prefix_len - 1, prefix_len - 1, NO_LOWER16, NO_LOWER, NO_LOWER,
                                 0.0f, ots + t * 16 * (size_t)D,
                                 ms + t * 16, ls + t * 16, k0 > 0, D, dp, scale);
    }
    for (int t = 0; t < num_tiles; t++) {
        const int64_t r0 = it->p0 + (int64_t)t * TILE;
        const float *m = ms + t * 16, *l = ls + t * 16;
        unload_tile(ots + t * 16 * (size_t)D, D, orow);
        for (int lane = 0; lane < 16 && r0 + lane < it->p1; lane++) {
            const int64_t pr = r0 + lane;
            const int64_t row = crows[pr / G];
            const int hq = h * G + (int)(pr % G);
            float *ls_at = lse + row * num_heads + hq;
            const float lsv = *ls_at;
            const float lp = m[lane] + logf(l[lane]);
            const float mx = lsv > lp ? lsv : lp;
            const float ws = expf(lsv - mx), wp = expf(lp - mx);
            const float inv = 1.0f / (ws + wp);
            const float a = ws * inv, b = wp * inv / l[lane];
            float *o = out + (row * num_heads + hq) * D;
            const float *src = orow + (int64_t)lane * D;
            for (int d = 0; d < D; d++) o[d] = a * o[d] + b * src[d];
            *ls_at = mx + logf(ws + wp);
        }
    }
}

static int prefix_attention_merge(const void *q, int64_t q_stride, const void *k_cache,
                                  const void *v_cache, const float *k_scale,
                                  const float *v_scale, int kv_i8, const int64_t *slots,
                                  const int64_t *slot_off, const int64_t *rows,
                                  const int64_t *row_off, int num_prefixes, float *out,
                                  float *lse, int num_heads, int num_kv_heads, int head_dim,
                                  float scale, int num_threads, int bf) {
    if (num_prefixes <= 0) return 0;
    const int G = num_heads / num_kv_heads;
    const int D = head_dim;
    int64_t num_items = 0;
    for (int c = 0; c < num_prefixes; c++) {
        const int64_t pairs = (row_off[c + 1] - row_off[c]) * G;
        if (slot_off[c + 1] > slot_off[c])
            num_items += (pairs + ITEM_ROWS - 1) / ITEM_ROWS * num_kv_heads;
    }
    if (num_items == 0) return 0;
    PrefixItem *items = (PrefixItem *)malloc(sizeof(PrefixItem) * num_items);
    if (num_threads < 1) num_threads = 1;
    if ((int64_t)num_threads > num_items) num_threads = (int)num_items;
    const size_t per_thread =
        (2 * PREFIX_CHUNK + 2 * ITEM_TILES * 16 + 16) * (size_t)D + 2 * ITEM_TILES * 16;
    float *scratch = (float *)malloc(sizeof(float) * per_thread * num_threads);
    if (!items || !scratch) {
        free(items);
        free(scratch);
        return 1;
    }
    {
        int64_t n = 0;
        for (int c = 0; c < num_prefixes; c++) {
            if (slot_off[c + 1] == slot_off[c]) continue;
            const int64_t pairs = (row_off[c + 1] - row_off[c]) * G;
            for (int h = 0; h < num_kv_heads; h++)
                for (int64_t p0 = 0; p0 < pairs; p0 += ITEM_ROWS)
                    items[n++] = (PrefixItem){c, h, p0, p0 + ITEM_ROWS < pairs ? p0 + ITEM_ROWS : pairs};
        }
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < num_items; i++) {
#ifdef _OPENMP
        float *mine = scratch + per_thread * omp_get_thread_num();
#else
        float *mine = scratch;
#endif
        run_prefix_item(q, q_stride, k_cache, v_cache, k_scale, v_scale, kv_i8, slots, slot_off,
                        rows, row_off, &items[i], out, lse, num_heads, num_kv_heads, D, scale,
                        bf, mine);
    }
    free(items);
    free(scratch);
    return 0;
}

/* The per-token variant of paged_attention_f32. Returns 0 on success, nonzero when a thread's
 * scratch allocation failed. */
static int attend_per_token(Args a, int num_threads) {
    const int32_t *seqs = a.seqs, *cu_seqlens_q = a.cu_seqlens_q, *seq_lens = a.seq_lens;
    const int32_t *k_start = a.k_start;
    const int num_seqs = a.num_seqs, num_kv_heads = a.num_kv_heads;
    /* cost of each sequence ~ q_len * keys; split items into contiguous ranges of equal cost */
    double total = 0.0;
    for (int s = 0; s < num_seqs; s++) {
        const int b = seqs[s];
        const int keys = seq_lens[b] - (k_start ? k_start[b] : 0);
        if (keys > a.max_keys) a.max_keys = keys;
        total += (double)(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) * (keys + 8);
    }
    const int64_t num_items = (int64_t)num_seqs * num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 64) num_threads = 64;
    if ((int64_t)num_threads > num_items) num_threads = (int)num_items;
    Task tasks[64];
    {
        int t = 0;
        double acc = 0.0;
        tasks[0].item_begin = 0;
        for (int s = 0; s < num_seqs && t < num_threads - 1; s++) {
            const int b = seqs[s];
            const int keys = seq_lens[b] - (k_start ? k_start[b] : 0);
            const double c = (double)(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) * (keys + 8);
            /* whole KV heads of one sequence can go to different threads */
            for (int h = 0; h < num_kv_heads && t < num_threads - 1; h++) {
                acc += c / num_kv_heads;
                if (acc >= total * (t + 1) / num_threads) {
                    tasks[t].item_end = (int64_t)s * num_kv_heads + h + 1;
                    t++;
                    tasks[t].item_begin = tasks[t - 1].item_end;
                }
            }
        }
        num_threads = t + 1;
        tasks[t].item_end = num_items;
    }
    for (int t = 0; t < num_threads; t++) {
        tasks[t].a = &a;
        tasks[t].failed = 0;
    }
    /* torch's own OpenMP runtime (libgomp.so.1, already loaded) runs the threads: its pool is
     * warm, and no second set of threads competes with it for the cores */
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
#endif
    for (int t = 0; t < num_threads; t++) run_task(&tasks[t]);
    int rc = 0;
    for (int t = 0; t < num_threads; t++) rc |= tasks[t].failed;
    return rc;
}

/* One row of D values (x fp32, or bf16 when bf) quantized into int8 dst and its scale, by
 * kernels/reference.py's rule: scale = amax / 127 and q = round-half-to-even(clamp(x / scale,
 * -127, 127)), both IEEE fp32 divisions (no reciprocal, nothing to contract into an FMA; rintf
 * rounds half to even in the default mode); q = 0 where !(scale > 0). */
static void quantize_row_i8(const void *x, int D, int bf, int8_t *dst, float *scale_out) {
    float amax = 0.0f;
    for (int d = 0; d < D; d++) {
        const float ax = fabsf(load1_any(x, d, bf));
        amax = ax > amax || ax != ax ? ax : amax; /* a NaN sticks, as torch's amax */
    }
    const float sc = amax / 127.0f;
    *scale_out = sc;
    if (!(sc > 0.0f)) {
        memset(dst, 0, (size_t)D);
        return;
    }
    for (int d = 0; d < D; d++) {
        float y = load1_any(x, d, bf) / sc;
        y = y > 127.0f ? 127.0f : y < -127.0f ? -127.0f : y;
        dst[d] = (int8_t)rintf(y);
    }
}
