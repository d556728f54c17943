/* Paged decode attention for the CPU: one query token per sequence, K/V read straight from the
 * paged cache through each sequence's block table (no gather copy), fp32 accumulation.
 *
 * Why not torch: gathering K/V into a padded tensor and calling SDPA reads and writes the whole
 * context twice and runs a flash kernel tuned for long query blocks; decode is memory bound, so
 * reading each cached K/V row exactly once is what matters.
 *
 * Layouts (all contiguous):
 *   q, out        [num_seqs, num_heads, head_dim]
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  int32 [num_seqs, max_blocks]
 *   seq_lens      int32 [num_seqs]
 * dtype: 0 = float32, 1 = bfloat16. GQA: query head h reads KV head h / (num_heads / num_kv_heads).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* d values starting at element `offset` of `base`, widened to float. */
static inline __attribute__((always_inline)) void load_slot(const void *base, size_t offset, const int d,
                                                          int dtype, float *dst) {
    if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        const float *src = (const float *)base + offset;
        for (int i = 0; i < d; i++) dst[i] = src[i];
    }
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, dtype;
    float scale;
} Job;

/* One (sequence, kv head) item. Inlined with a constant head size D so that every loop over D
 * is fully unrolled and vectorized. */
static inline __attribute__((always_inline)) void attend_item(const Job *j, int item, const int D,
                                                            float *qf, float *acc, float *scores) {
    const int group = j->num_heads / j->num_kv_heads;
    const int s = item / j->num_kv_heads, kvh = item % j->num_kv_heads;
    const int len = j->seq_lens[s], bs = j->block_size;
    const int32_t *table = j->block_tables + (size_t)s * j->max_blocks;
    const size_t row_stride = (size_t)j->num_kv_heads * D; /* between consecutive slots */
    for (int g = 0; g < group; g++) {
        load_slot(j->q, ((size_t)s * j->num_heads + (size_t)kvh * group + g) * D, D, j->dtype, qf + g * D);
        for (int i = 0; i < D; i++) qf[g * D + i] *= j->scale;
    }
    /* Scores: one pass over K, block by block (slots of a block are adjacent in memory). */
    for (int t0 = 0; t0 < len; t0 += bs) {
        const size_t base = (size_t)table[t0 / bs] * bs * row_stride + (size_t)kvh * D;
        const int n = len - t0 < bs ? len - t0 : bs;
        for (int o = 0; o < n; o++) {
            float row[D];
            load_slot(j->k_cache, base + o * row_stride, D, j->dtype, row);
            for (int g = 0; g < group; g++) {
                const float *qg = qf + g * D;
                float dot = 0.f;
                for (int i = 0; i < D; i++) dot += qg[i] * row[i];
                scores[(size_t)g * len + t0 + o] = dot;
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float *sg = scores + (size_t)g * len, mx = -INFINITY, sum = 0.f;
        for (int t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        for (int t = 0; t < len; t++) { sg[t] = expf(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int t = 0; t < len; t++) sg[t] *= inv;
    }
    /* Weighted sum of V: one pass. */
    memset(acc, 0, sizeof(float) * (size_t)group * D);
    for (int t0 = 0; t0 < len; t0 += bs) {
        const size_t base = (size_t)table[t0 / bs] * bs * row_stride + (size_t)kvh * D;
        const int n = len - t0 < bs ? len - t0 : bs;
        for (int o = 0; o < n; o++) {
            float row[D];
            load_slot(j->v_cache, base + o * row_stride, D, j->dtype, row);
            for (int g = 0; g < group; g++) {
                const float p = scores[(size_t)g * len + t0 + o];
                float *ag = acc + g * D;
                for (int i = 0; i < D; i++) ag[i] += p * row[i];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const size_t o = ((size_t)s * j->num_heads + (size_t)kvh * group + g) * D;
        if (j->dtype == 1) {
            uint16_t *dst = (uint16_t *)j->out + o;
            for (int i = 0; i < D; i++) dst[i] = f32_to_bf16(acc[g * D + i]);
        } else {
            memcpy((float *)j->out + o, acc + g * D, sizeof(float) * (size_t)D);
        }
    }
}

int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, void *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int dtype) {
    const int items = num_seqs * num_kv_heads, d = head_dim, group = num_heads / num_kv_heads;
    int max_len = 1;
    for (int s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    const Job job = {q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads,
                     num_kv_heads, head_dim, block_size, max_blocks, dtype, scale};
    /* OpenMP resolves to the libgomp torch already loaded (same soname), so this loop runs on
     * torch's own worker threads: a second thread pool would fight torch's spinning workers
     * for the cores. */
#pragma omp parallel
    {
        float *qf = malloc(sizeof(float) * (size_t)group * d);
        float *acc = malloc(sizeof(float) * (size_t)group * d);
        float *scores = malloc(sizeof(float) * (size_t)group * max_len);
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            /* Common head sizes get their own unrolled copy; others use the generic one. */
            if (d == 64) attend_item(&job, item, 64, qf, acc, scores);
            else if (d == 128) attend_item(&job, item, 128, qf, acc, scores);
            else attend_item(&job, item, d, qf, acc, scores);
        }
        free(qf); free(acc); free(scores);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Paged prefill attention: chunks of several query tokens per sequence, causal, over the
 * sequence's whole context in the paged cache (earlier chunks and cached prefixes included).
 *
 * Why not torch's flash kernel: with 9 heads of 64 dims it reaches ~40 GFLOP/s here, and a
 * chunk that continues a context needs its K/V gathered out of the paged cache plus an explicit
 * mask. This kernel reads K/V through the block table and works tile by tile: a work item is
 * (chunk, kv head, QROWS query tokens); for each tile of TILE keys it widens the K rows into a
 * transposed fp32 tile once and reuses it for all QROWS x group query rows, so the score loop
 * is a broadcast-FMA over TILE keys (no horizontal sums) and the value loop a broadcast-FMA over
 * head_dim. Online softmax (running max and sum per query row) keeps one pass over the keys.
 *
 *   q, out        rows of a flattened batch; token t's head h starts at t * row_stride + h * D
 *   chunk_starts  int32 [num_chunks]: first row of each chunk
 *   chunk_lens    int32 [num_chunks]: query tokens in the chunk (its last ones in the context)
 *   seq_lens      int32 [num_chunks]: context length including the chunk
 *   block_tables  int32 [num_chunks, max_blocks]
 * ------------------------------------------------------------------------------------------- */
#define TILE 16 /* keys per tile: one 16-lane float vector */
#define QROWS 32

/* GCC/Clang vector extensions: AVX-512 registers under -march=native on this machine, narrower
 * ones elsewhere, without intrinsics. */
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

static inline vf16 vselect(vi16 mask, vf16 a, vf16 b) {
    return (vf16)(((vi16)a & mask) | ((vi16)b & ~mask));
}

/* e^x for x <= 0, to ~1e-7 relative: t = x log2 e split into round(t) + f, f in [-0.5, 0.5];
 * 2^f by its Taylor series (degree 7), 2^round(t) added into the exponent bits. */
static inline vf16 vexp_nonpositive(vf16 x) {
    const vf16 zero = {0};
    x = vselect(x < -87.f, zero - 87.f, x); /* keeps 2^n a normal float */
    const vf16 t = x * 1.44269504088896341f;
    /* t <= 0, so truncating t - 0.5 rounds t to nearest (a conversion, which -ffast-math
     * cannot reassociate away as it would the 1.5 * 2^23 trick). */
    const vi16 n = __builtin_convertvector(t - 0.5f, vi16);
    const vf16 f = t - __builtin_convertvector(n, vf16);
    vf16 p = zero + 1.5252733804059840e-5f;
    p = p * f + 1.5403530393381609e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.f;
    return (vf16)((vi16)p + (n << 23));
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *chunk_starts, *chunk_lens, *seq_lens;
    void *out;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_row_stride, out_row_stride, dtype;
    float scale;
} PrefillJob;

/* Buffers of one thread, 64-byte aligned for the vector loads. */
typedef struct {
    float *qf;  /* [QROWS * G, D] scaled queries */
    vf16 *acc;  /* [QROWS * G, D / 16] unnormalised outputs */
    float *mx, *den; /* [QROWS * G] running max and sum of exp */
    vf16 *kt;   /* [D]: kt[d] lane o = key o's component d (the tile, transposed) */
    vf16 *vt;   /* [TILE, D / 16]: value rows */
} PrefillScratch;

static inline __attribute__((always_inline)) void prefill_item(const PrefillJob *j, int c, int kvh, int i0,
                                                             const int D, const PrefillScratch *w) {
    const int NV = D / 16, G = j->num_heads / j->num_kv_heads;
    const int start = j->chunk_starts[c], qlen = j->chunk_lens[c], slen = j->seq_lens[c];
    const int nq = qlen - i0 < QROWS ? qlen - i0 : QROWS;
    const int pos0 = slen - qlen + i0; /* position of the item's first query token */
    const int rows = nq * G;           /* query row r = token i * G + group member g */
    const int32_t *table = j->block_tables + (size_t)c * j->max_blocks;
    const size_t slot_stride = (size_t)j->num_kv_heads * D;
    const int bs = j->block_size;
    const vf16 zero = {0};
    const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    float *kt = (float *)w->kt;

    for (int i = 0; i < nq; i++)
        for (int g = 0; g < G; g++) {
            float *dst = w->qf + (size_t)(i * G + g) * D;
            load_slot(j->q, (size_t)(start + i0 + i) * j->q_row_stride + (size_t)(kvh * G + g) * D, D,
                      j->dtype, dst);
            for (int d = 0; d < D; d++) dst[d] *= j->scale;
        }
    for (int r = 0; r < rows; r++) { w->mx[r] = -1e30f; w->den[r] = 0.f; }
    for (int k = 0; k < rows * NV; k++) w->acc[k] = zero;

    const int num_keys = pos0 + nq; /* the last token sees keys 0 .. pos0 + nq - 1 */
    for (int t0 = 0; t0 < num_keys; t0 += TILE) {
        const int nt = num_keys - t0 < TILE ? num_keys - t0 : TILE;
        for (int o = 0; o < TILE; o++) {
            float row[D];
            if (o < nt) {
                const int t = t0 + o;
                const size_t base = ((size_t)table[t / bs] * bs + t % bs) * slot_stride + (size_t)kvh * D;
                load_slot(j->k_cache, base, D, j->dtype, row);
                load_slot(j->v_cache, base, D, j->dtype, (float *)(w->vt + (size_t)o * NV));
            } else {
                for (int d = 0; d < D; d++) row[d] = 0.f;
                for (int k = 0; k < NV; k++) w->vt[(size_t)o * NV + k] = zero;
            }
            for (int d = 0; d < D; d++) kt[d * TILE + o] = row[d];
        }
        /* Rows are in position order: those before position t0 see none of this tile. Scores
         * are computed four rows at a time: four independent FMA chains hide the FMA latency
         * (one chain of D dependent FMAs is latency bound) and share each load of kt. */
        for (int r0 = (t0 > pos0 ? t0 - pos0 : 0) * G; r0 < rows; r0 += 4) {
            const int nr = rows - r0 < 4 ? rows - r0 : 4;
            const float *q0 = w->qf + (size_t)r0 * D;
            const float *q1 = nr > 1 ? q0 + D : q0, *q2 = nr > 2 ? q0 + 2 * D : q0, *q3 = nr > 3 ? q0 + 3 * D : q0;
            vf16 sc[4] = {zero, zero, zero, zero};
            for (int d = 0; d < D; d++) {
                const vf16 k = w->kt[d];
                sc[0] += q0[d] * k;
                sc[1] += q1[d] * k;
                sc[2] += q2[d] * k;
                sc[3] += q3[d] * k;
            }
            for (int u = 0; u < nr; u++) {
                const int r = r0 + u, pos = pos0 + r / G;
                const int valid = pos - t0 + 1 < nt ? pos - t0 + 1 : nt;
                const vi16 keep = lane < valid;
                const vf16 s = vselect(keep, sc[u], zero - 1e30f);
                float m = w->mx[r];
                for (int o = 0; o < TILE; o++) m = s[o] > m ? s[o] : m;
                const vf16 p = vselect(keep, vexp_nonpositive(s - m), zero);
                float sum = 0.f;
                for (int o = 0; o < TILE; o++) sum += p[o];
                const float corr = expf(w->mx[r] - m);
                w->mx[r] = m;
                w->den[r] = w->den[r] * corr + sum;
                vf16 a[NV];
                for (int k = 0; k < NV; k++) a[k] = w->acc[(size_t)r * NV + k] * corr;
                for (int o = 0; o < valid; o++) {
                    const float po = p[o];
                    const vf16 *vr = w->vt + (size_t)o * NV;
                    for (int k = 0; k < NV; k++) a[k] += po * vr[k];
                }
                for (int k = 0; k < NV; k++) w->acc[(size_t)r * NV + k] = a[k];
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int i = r / G, g = r % G;
        const size_t o = (size_t)(start + i0 + i) * j->out_row_stride + (size_t)(kvh * G + g) * D;
        const float inv = 1.f / w->den[r];
        const float *a = (const float *)(w->acc + (size_t)r * NV);
        if (j->dtype == 1) {
            uint16_t *dst = (uint16_t *)j->out + o;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(a[d] * inv);
        } else {
            float *dst = (float *)j->out + o;
            for (int d = 0; d < D; d++) dst[d] = a[d] * inv;
        }
    }
}

static void *aligned_buffer(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* head_dim must be a multiple of 16 (the caller falls back to torch otherwise). */
int paged_prefill_attention(const void *q, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, const int32_t *chunk_starts,
                            const int32_t *chunk_lens, const int32_t *seq_lens, void *out,
                            int num_chunks, int num_heads, int num_kv_heads, int head_dim, int block_size,
                            int max_blocks, int q_row_stride, int out_row_stride, float scale, int dtype) {
    const int G = num_heads / num_kv_heads, D = head_dim;
    if (D % 16 != 0) return -1;
    /* Work items: (chunk, kv head, tile of QROWS tokens), enumerated through a prefix sum. */
    int *first_item = malloc(sizeof(int) * (size_t)(num_chunks + 1));
    first_item[0] = 0;
    for (int c = 0; c < num_chunks; c++)
        first_item[c + 1] = first_item[c] + num_kv_heads * ((chunk_lens[c] + QROWS - 1) / QROWS);
    const int items = first_item[num_chunks];
    const PrefillJob job = {q, k_cache, v_cache, block_tables, chunk_starts, chunk_lens, seq_lens, out,
                            num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_row_stride,
                            out_row_stride, dtype, scale};
#pragma omp parallel
    {
        const size_t rows = (size_t)QROWS * G;
        PrefillScratch w = {aligned_buffer(sizeof(float) * rows * D), aligned_buffer(sizeof(float) * rows * D),
                            aligned_buffer(sizeof(float) * rows), aligned_buffer(sizeof(float) * rows),
                            aligned_buffer(sizeof(float) * TILE * D), aligned_buffer(sizeof(float) * TILE * D)};
        /* Later tiles of a chunk see more keys: hand items out dynamically. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            int c = 0;
            while (first_item[c + 1] <= item) c++;
            const int local = item - first_item[c];
            const int kvh = local % num_kv_heads, i0 = (local / num_kv_heads) * QROWS;
            if (D == 64) prefill_item(&job, c, kvh, i0, 64, &w);
            else if (D == 128) prefill_item(&job, c, kvh, i0, 128, &w);
            else prefill_item(&job, c, kvh, i0, D, &w);
        }
        free(w.qf); free(w.acc); free(w.mx); free(w.den); free(w.kt); free(w.vt);
    }
    free(first_item);
    return 0;
}
