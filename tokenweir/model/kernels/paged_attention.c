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

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

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
