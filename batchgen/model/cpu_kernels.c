/* CPU kernels, built and loaded at run time by cpu_kernels.py (cc -O3 -march=native -fopenmp)
 * and called through ctypes. fp32 (_f32) and bf16-storage (_bf16) variants:
 *   paged_attention_*    attention reading K/V in place from the block-paged cache (no gather),
 *                        per token (decodes) or in 16-row tiles (prefills, extends)
 *   store_kv_*           the step's new K/V into their cache slots
 *   rms_norm_*, rope_*, silu_mul_*   one-pass layer ops
 *   prefix_attention_merge_*  shared prefixes attended by their rows and merged, in one call
 * int8 KV cache (_i8; q, k, v fp32 or bf16, one fp32 scale per (slot, KV head)):
 *   store_kv_i8          quantize the step's new K/V into their slots (bit for bit
 *                        kernels/reference.py's quantize_kv_ref)
 *   paged_attention_i8, prefix_attention_merge_i8   attention over the int8 cache
 *   moe_experts_*        a mixture-of-experts layer's experts over the pairs routed to them
 * bf16 only, on AVX512-BF16 builds:
 *   gemm_bf16_dpbf16     the linear layers' GEMM on weights packed for vdpbf16ps
 * fp32 linear layers (AVX2 and AVX-512 builds):
 *   gemm_f32             the linear layers' GEMM on weights packed in blocks of 16 outputs
 * fp32 only:
 *   uniform_noise_f32    the sampler's hashed uniforms (bit for bit the PyTorch formula)
 *   race_draw_f32        the sampler's temperature-only draw, fused (noise, weights, race)
 *
 * paged_attention_f32's layouts (all fp32 / int32, row-major):
 *   q        [T, Hq, D]   row t at q + t*q_stride, head h at + h*D (heads contiguous)
 *   k_cache  [num_blocks, block_size, Hkv, D] (v_cache the same); slot s = block*block_size + off
 *   block_tables [B, bt_stride]: block ids of sequence b, in position order
 *   cu_seqlens_q [B+1]: new tokens of sequence b are q rows cu[b]..cu[b+1]-1
 *   seq_lens [B]: keys of sequence b after this step (cached + new, all already in the cache)
 *   k_start  [B] or NULL: first key position sequence b attends to (a cascade's shared prefix
 *            is handled elsewhere and skipped here); 0 when NULL
 *   seqs     [m]: the sequences to compute (others are left untouched)
 *   out      [T, Hq, D] contiguous; lse [T, Hq] contiguous or NULL
 *
 * New token i of sequence b (q row cu[b]+i) sits at position p = seq_lens[b] - q_len + i and
 * attends to keys k_start[b] .. p; with a sliding window W > 0 (window), to keys
 * max(k_start[b], p - W + 1) .. p only (the keys before are never read). Query head h uses KV
 * head h / (Hq/Hkv). When a row sees no key at all, out is 0 and lse is -inf. With softcap > 0,
 * each score s = scale * q.k becomes softcap * tanh(s / softcap) before the softmax.
 *
 * bf16 storage (paged_attention_bf16, prefix_attention_merge_bf16): q, k_cache and v_cache hold
 * bf16 (uint16 bit patterns), lse stays fp32, out is bf16 or fp32 (out_bf16). K/V are converted
 * to fp32 in registers (or while a tile's keys are gathered); softmax and every sum run in fp32,
 * and the output is rounded once (round to nearest even). With AVX512-BF16 (__AVX512BF16__) the
 * q.k dot products of bf16 q and K use vdpbf16ps (fp32 sums of exact bf16 products).
 * The dtype is a compile-time constant (BF) of the always-inline inner functions, a run-time flag
 * (Args.bf16) of the outer ones: one source for both, the fp32 code paths unchanged.
 *
 * int8 caches (paged_attention_i8): k_cache/v_cache [num_blocks, block_size, Hkv, D] int8,
 * k_scale/v_scale [num_blocks, block_size, Hkv] fp32; row (slot s, head h) is the integers times
 * scale[s*Hkv + h]. Per token, the integers are widened to fp32 in registers and the scale is
 * applied once per (key, head): to the fp32 dot product with q, and to the softmax weight of
 * the value row. Tiled and prefix paths dequantize (q * scale in fp32) while gathering.
 *
 * Work items are (sequence, KV head) pairs; the G = Hq/Hkv query heads of a KV head are
 * processed together so each key and value row is read once per query token.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* One translation unit: the shared helpers, the attention internals, the layer and sampler
 * kernels (with their entry points), then the attention entry points below. */
#include "cpu_kernels_simd.h"
#include "cpu_kernels_attention.c"
#include "cpu_kernels_layers.c"
#include "cpu_kernels_moe.c"
#include "cpu_kernels_gemm.c"

/* ---- attention entry points (called through ctypes by cpu_kernels.py) ---- */

/* Attention of the sequences ``seqs`` (layouts and semantics in the header comment), per token
 * (tiled = 0: decodes, short extends) or in 16-row tiles (tiled = 1: prefills, longer extends).
 * Returns 0 on success, nonzero when an allocation failed. */
int paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                        const float *v_cache, const int32_t *block_tables, int64_t bt_stride,
                        const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                        const int32_t *k_start, const int32_t *seqs, int num_seqs, float *out,
                        float *lse, int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, int window, float softcap, int tiled, int num_threads) {
    if (num_seqs <= 0) return 0;
    const Args a = {q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_start, seqs,
                    out, lse, q_stride, bt_stride, num_seqs, num_heads, num_kv_heads, head_dim,
                    block_size, 0, scale, 0, 0, 0, NULL, NULL, window, softcap};
    return tiled ? attend_tiled(a, num_threads) : attend_per_token(a, num_threads);
}

/* paged_attention_f32 with q, k_cache and v_cache in bf16; out in bf16 (out_bf16 = 1) or fp32
 * (for a prefix_attention_merge_bf16 to follow), lse fp32. */
int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                         const int32_t *k_start, const int32_t *seqs, int num_seqs, void *out,
                         int out_bf16, float *lse, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, int window, float softcap, int tiled,
                         int num_threads) {
    if (num_seqs <= 0) return 0;
    const Args a = {q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_start, seqs,
                    out, lse, q_stride, bt_stride, num_seqs, num_heads, num_kv_heads, head_dim,
                    block_size, 0, scale, 1, out_bf16 != 0, 0, NULL, NULL, window, softcap};
    return tiled ? attend_tiled(a, num_threads) : attend_per_token(a, num_threads);
}

/* paged_attention_f32 over int8 caches k_cache, v_cache [num_blocks, block_size, Hkv, D] with
 * scales k_scale, v_scale [num_blocks, block_size, Hkv] (fp32): key/value row (slot s, head h)
 * is the integers times scale[s*Hkv + h]. q fp32 or (q_bf16) bf16; out fp32, or bf16 when
 * q_bf16 and out_bf16; lse fp32. Per token, the integers are widened in registers and each
 * scale applied once to a dot product (K) or a softmax weight (V); tiled, rows are dequantized
 * (q * scale in fp32) as the keys are gathered. */
int paged_attention_i8(const void *q, int64_t q_stride, int q_bf16, const int8_t *k_cache,
                       const int8_t *v_cache, const float *k_scale, const float *v_scale,
                       const int32_t *block_tables, int64_t bt_stride,
                       const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                       const int32_t *k_start, const int32_t *seqs, int num_seqs, void *out,
                       int out_bf16, float *lse, int num_heads, int num_kv_heads, int head_dim,
                       int block_size, float scale, int window, float softcap, int tiled,
                       int num_threads) {
    if (num_seqs <= 0) return 0;
    const Args a = {q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_start, seqs,
                    out, lse, q_stride, bt_stride, num_seqs, num_heads, num_kv_heads, head_dim,
                    block_size, 0, scale, q_bf16 != 0, q_bf16 && out_bf16, 1, k_scale, v_scale,
                    window, softcap};
    return tiled ? attend_tiled(a, num_threads) : attend_per_token(a, num_threads);
}

int prefix_attention_merge_f32(const float *q, int64_t q_stride, const float *k_cache,
                               const float *v_cache, const int64_t *slots,
                               const int64_t *slot_off, const int64_t *rows,
                               const int64_t *row_off, int num_prefixes, float *out, float *lse,
                               int num_heads, int num_kv_heads, int head_dim, float scale,
                               int num_threads) {
    return prefix_attention_merge(q, q_stride, k_cache, v_cache, NULL, NULL, 0, slots, slot_off,
                                  rows, row_off, num_prefixes, out, lse, num_heads, num_kv_heads,
                                  head_dim, scale, num_threads, 0);
}

/* prefix_attention_merge_f32 with q, k_cache and v_cache in bf16; out and lse stay fp32 (the
 * merge reads and rewrites them: the caller rounds out once, after the last merge). */
int prefix_attention_merge_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *slots,
                                const int64_t *slot_off, const int64_t *rows,
                                const int64_t *row_off, int num_prefixes, float *out, float *lse,
                                int num_heads, int num_kv_heads, int head_dim, float scale,
                                int num_threads) {
    return prefix_attention_merge(q, q_stride, k_cache, v_cache, NULL, NULL, 0, slots, slot_off,
                                  rows, row_off, num_prefixes, out, lse, num_heads, num_kv_heads,
                                  head_dim, scale, num_threads, 1);
}

/* prefix_attention_merge_f32 over int8 caches with per (slot, KV head) scales k_scale, v_scale
 * ([num_blocks, block_size, Hkv] fp32), dequantized as they are gathered; q fp32 or (q_bf16)
 * bf16; out and lse fp32. */
int prefix_attention_merge_i8(const void *q, int64_t q_stride, int q_bf16, const int8_t *k_cache,
                              const int8_t *v_cache, const float *k_scale, const float *v_scale,
                              const int64_t *slots, const int64_t *slot_off, const int64_t *rows,
                              const int64_t *row_off, int num_prefixes, float *out, float *lse,
                              int num_heads, int num_kv_heads, int head_dim, float scale,
                              int num_threads) {
    return prefix_attention_merge(q, q_stride, k_cache, v_cache, k_scale, v_scale, 1, slots,
                                  slot_off, rows, row_off, num_prefixes, out, lse, num_heads,
                                  num_kv_heads, head_dim, scale, num_threads, q_bf16 != 0);
}

/* Write the step's new keys and values into the cache: row t of k (at k + t*k_stride, Hkv*D
 * contiguous floats) goes to slot slots[t] of k_cache; the same for v. Slots < 0 are skipped. */
void store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  float *k_cache, float *v_cache, const int64_t *slots, int64_t num_tokens,
                  int64_t row_floats) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_floats, k + t * k_stride, sizeof(float) * row_floats);
        memcpy(v_cache + slot * row_floats, v + t * v_stride, sizeof(float) * row_floats);
    }
}

/* store_kv_f32 for bf16 rows and caches (row_elems bf16 values per row). */
void store_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                   uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots,
                   int64_t num_tokens, int64_t row_elems) {
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_elems, k + t * k_stride, sizeof(uint16_t) * row_elems);
        memcpy(v_cache + slot * row_elems, v + t * v_stride, sizeof(uint16_t) * row_elems);
    }
}

/* store_kv_f32 into int8 caches: row t of k (Hkv heads of D fp32, or bf16 when x_bf16, at
 * k + t*k_stride) quantized per head into slot slots[t] of k_cache [num_blocks, block_size,
 * Hkv, D] and its scales into k_scale [num_blocks, block_size, Hkv]; the same for v. Slots < 0
 * are skipped. */
void store_kv_i8(const void *k, int64_t k_stride, const void *v, int64_t v_stride, int x_bf16,
                 int8_t *k_cache, int8_t *v_cache, float *k_scale, float *v_scale,
                 const int64_t *slots, int64_t num_tokens, int num_kv_heads, int head_dim) {
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t src = (int64_t)h * head_dim, dst = slot * row + src;
            const int64_t si = slot * num_kv_heads + h;
            quantize_row_i8(at_any(k, t * k_stride + src, x_bf16), head_dim, x_bf16,
                            k_cache + dst, k_scale + si);
            quantize_row_i8(at_any(v, t * v_stride + src, x_bf16), head_dim, x_bf16,
                            v_cache + dst, v_scale + si);
        }
    }
}
