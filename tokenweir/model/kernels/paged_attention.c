/* Paged attention for the CPU, one call per layer for every request of the step: decodes (one
 * query token) and prefill chunks (several, causal) alike, K/V read straight from the paged
 * cache through each request's block table, fp32 accumulation.
 *
 * Cache layout, per block and KV head (see attention.py): keys transposed in component pairs,
 * [head_dim / 2][block_size][2], values in key pairs, [block_size / 2][head_dim][2]. For every pair
 * of components a tile of TILE keys is one contiguous run, and for every pair of keys the values'
 * components are: exactly the operands of the bf16 dot-product instruction (vdpbf16ps, 16 lanes
 * each += a[2i] * b[2i] + a[2i+1] * b[2i+1] in fp32), which the scores (lanes = keys) and the
 * value sums (lanes = components) use straight from the cache where the CPU has AVX512-BF16.
 * Elsewhere, and for fp32, the tile is widened once into floats shared by every query row of the
 * work item and both loops are broadcast FMAs. Either way no horizontal sums (which made an
 * earlier row-by-row dot-product kernel latency bound at ~20 GB/s) and online softmax (running
 * max and sum per query row), so one pass over the keys.
 *
 * A work item is (request, kv head, up to QROWS query tokens); its query rows are those tokens
 * times the query heads sharing the kv head (GQA), row r = token * group + member.
 *
 * Int8 rows (int8_rows[c] set): the request's K/V lie in the same regions as int8 with a float32
 * scale per group of int8_group channels of a token (attention.py): a block holds
 * ibs = int8_block_size tokens, key component pair i of block offset o at byte i * 2 ibs + 2 o,
 * value component d of offset o at byte o / 2 * 2D + 2d + o % 2, the scale of group g at float
 * g * ibs + o after the ibs * D value bytes of the K and of the V region. Their
 * tiles end at block ends (ibs is rarely a multiple of TILE), so that every tile is one run of
 * bytes per component pair, and are widened times their scales into the float tiles.
 *
 *   q, out        rows of the flattened batch: token t's head h starts at t * row_stride + h * D
 *   q_starts      int32 [n]: first row of each request's query tokens
 *   q_lens        int32 [n]: its query tokens this step (the last q_len of its context)
 *   seq_lens      int32 [n]: context length including them (their K/V already in the cache)
 *   block_tables  int32 [n, max_blocks]
 *   k/v cache     [num_blocks, num_kv_heads, block_size * D] in the layout above
 *   int8_rows     int32 [n] or NULL (no int8 row)
 * dtype: 0 = float32, 1 = bfloat16. D must be a multiple of 16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec16.h"

#define TILE 16 /* keys per tile: one 16-lane float vector */
#define QROWS 32
#define PREFETCH_AHEAD (2 * TILE) /* keys */

#if defined(__clang__)
#define SHUFFLE16(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE16(v, ...) __builtin_shuffle(v, (vi16){__VA_ARGS__})
#endif

/* Horizontal max and sum of the 16 lanes, by halving (4 shuffles instead of 15 extracts). */
static inline float vmax_lanes(vf16 v) {
    vf16 t = SHUFFLE16(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = vselect(v > t, v, t);
    t = SHUFFLE16(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = vselect(v > t, v, t);
    t = SHUFFLE16(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = vselect(v > t, v, t);
    t = SHUFFLE16(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    v = vselect(v > t, v, t);
    return v[0];
}

static inline float vsum_lanes(vf16 v) {
    v += SHUFFLE16(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUFFLE16(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUFFLE16(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUFFLE16(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
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

/* n values starting at element `offset` of `base`, widened to float. */
static inline __attribute__((always_inline)) void load_floats(const void *base, size_t offset, int n, int dtype,
                                                            float *restrict dst) {
    if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, sizeof(float) * (size_t)n);
    }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* bf16 dot products (vdpbf16ps: 16 lanes, each += a[2i] * b[2i] + a[2i+1] * b[2i+1] in fp32):
 * the scores of a bf16 cache take half the instructions of widening plus FMAs. */
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *q_starts, *q_lens, *seq_lens;
    void *out;
    int num_heads, num_kv_heads, block_size, max_blocks, q_row_stride, out_row_stride, dtype;
    float scale;
    const int32_t *int8_rows; /* NULL: no int8 row */
    int int8_block_size, int8_group; /* tokens per int8 block; channels per scale */
} Job;

/* Buffers of one thread, 64-byte aligned for the vector loads. */
typedef struct {
    float *qf;       /* [QROWS * G, D] scaled queries (float scores) */
    uint32_t *qp;    /* [QROWS * G, D / 2] raw bf16 query pairs (bf16 dot-product scores) */
    vf16 *acc;       /* [QROWS * G, D / 16] unnormalised outputs */
    float *mx, *den; /* [QROWS * G] running max and sum of exp */
    vf16 *kt;        /* [D]: lane o of kt[d] = component d of the tile's key o */
    uint32_t *kp;    /* [D / 2, TILE]: the tile's bf16 key pairs, when staged */
    vf16 *vt;        /* [TILE, D / 16]: the tile's value rows */
    uint32_t *vp;    /* [TILE / 2, D]: the tile's bf16 value pairs, when staged */
} Scratch;

/* Where a tile's keys and values are read by the dot-product path: bf16 pairs, component pair i
 * of key o at keys[i * key_stride + o], and (key 2m, key 2m + 1) of component d at
 * values[m * value_stride + d]. keys NULL: the float path (w->kt, w->vt). */
typedef struct {
    const uint32_t *keys, *values;
    int key_stride, value_stride;
} TilePairs;

/* Element offset of the (block, kv head) region holding key t; keys and values alike. */
static inline size_t head_offset(const Job *j, const int32_t *table, int kvh, int t, int D) {
    return ((size_t)table[t / j->block_size] * j->num_kv_heads + kvh) * (size_t)j->block_size * D;
}

/* Widen values t0 .. t0 + nt - 1 (nt <= TILE, possibly spanning blocks) into w->vt, zero past nt.
 * Key t's value component d lies at head + (t % bs) / 2 * 2D + 2d + t % 2 (pairs of keys). */
static inline __attribute__((always_inline)) void load_values(const Job *j, const int32_t *table, int kvh, int t0,
                                                            int nt, const int D, const Scratch *w) {
    const int bs = j->block_size, NV = D / 16;
    float *vt = (float *)w->vt;
    if (nt == TILE && bs % TILE == 0 && j->dtype == 1) { /* a full bf16 tile inside one block */
        const uint32_t *v = (const uint32_t *)j->v_cache + head_offset(j, table, kvh, t0, D) / 2 + (t0 % bs) / 2 * D;
        for (int m = 0; m < TILE / 2; m++)
            for (int k = 0; k < NV; k++) { /* 16 pairs: low half key 2m, high half key 2m + 1 */
                vi16 pairs;
                memcpy(&pairs, v + (size_t)m * D + 16 * k, sizeof(pairs));
                w->vt[(2 * m) * NV + k] = (vf16)(pairs << 16);
                w->vt[(2 * m + 1) * NV + k] = (vf16)(pairs & (int32_t)0xFFFF0000);
            }
        return;
    }
    for (int o = 0; o < TILE; o++) {
        float *row = vt + (size_t)o * D;
        if (o >= nt) {
            memset(row, 0, sizeof(float) * (size_t)D);
            continue;
        }
        const int t = t0 + o, off = t % bs;
        const size_t base = head_offset(j, table, kvh, t, D) + (size_t)(off / 2) * 2 * D + off % 2;
        for (int d = 0; d < D; d++) load_floats(j->v_cache, base + 2 * (size_t)d, 1, j->dtype, row + d);
    }
}

/* Widen keys t0 .. t0 + nt - 1 into w->kt (float scores), zero lanes past nt. Key t's
 * components d, d + 1 (d even) lie at head + d * bs + 2 * (t % bs). */
static inline __attribute__((always_inline)) void load_keys(const Job *j, const int32_t *table, int kvh, int t0,
                                                          int nt, const int D, const Scratch *w) {
    const int bs = j->block_size;
    float *kt = (float *)w->kt;
    if (nt == TILE && bs % TILE == 0 && j->dtype == 1) { /* a full bf16 tile inside one block */
        const uint16_t *k = (const uint16_t *)j->k_cache + head_offset(j, table, kvh, t0, D) + 2 * (t0 % bs);
        for (int d = 0; d < D; d += 2) { /* TILE 32-bit pairs: low half component d, high d + 1 */
            vi16 pairs;
            memcpy(&pairs, k + (size_t)d * bs, sizeof(pairs));
            w->kt[d] = (vf16)(pairs << 16);
            w->kt[d + 1] = (vf16)(pairs & (int32_t)0xFFFF0000);
        }
        return;
    }
    for (int o = 0; o < TILE; o++) {
        if (o >= nt) {
            for (int d = 0; d < D; d++) kt[d * TILE + o] = 0.f;
            continue;
        }
        const int t = t0 + o;
        const size_t base = head_offset(j, table, kvh, t, D) + 2 * (size_t)(t % bs);
        for (int d = 0; d < D; d += 2) {
            float pair[2];
            load_floats(j->k_cache, base + (size_t)d * bs, 2, j->dtype, pair);
            kt[d * TILE + o] = pair[0];
            kt[(d + 1) * TILE + o] = pair[1];
        }
    }
}

/* The bf16 key and value pairs of keys t0 .. t0 + nt - 1: straight from the cache for a full
 * tile inside one block, else staged into w->kp / w->vp with zeros past nt. */
static inline TilePairs tile_pairs(const Job *j, const int32_t *table, int kvh, int t0, int nt, const int D,
                                   const Scratch *w) {
    const int bs = j->block_size;
    const uint32_t *kc = (const uint32_t *)j->k_cache, *vc = (const uint32_t *)j->v_cache;
    if (nt == TILE && bs % TILE == 0) {
        const size_t head = head_offset(j, table, kvh, t0, D) / 2;
        const TilePairs direct = {kc + head + t0 % bs, vc + head + (size_t)(t0 % bs) / 2 * D, bs, D};
        return direct;
    }
    uint16_t *vp = (uint16_t *)w->vp;
    for (int o = 0; o < TILE; o++) {
        const int t = t0 + o, off = t % bs;
        const size_t head = o < nt ? head_offset(j, table, kvh, t, D) / 2 : 0;
        for (int i = 0; i < D / 2; i++) w->kp[i * TILE + o] = o < nt ? kc[head + (size_t)i * bs + off] : 0u;
        const uint16_t *v = (const uint16_t *)(vc + head + (size_t)(off / 2) * D) + off % 2;
        for (int d = 0; d < D; d++) vp[((size_t)(o / 2) * D + d) * 2 + o % 2] = o < nt ? v[2 * d] : 0;
    }
    const TilePairs staged = {w->kp, w->vp, TILE, D};
    return staged;
}

/* Ask for the K/V of keys t_begin .. t_end - 1 ahead of use: whole (block, kv head) regions,
 * each once, when its block starts in the range. A request's blocks lie anywhere in the pool,
 * and without this the kernel waited on memory for about half its time. */
static inline void prefetch_keys(const Job *j, const int32_t *table, int kvh, int t_begin, int t_end, int D,
                                 int bs) {
    /* bs: keys per block of the row's format. A region is block_size * D elements either way. */
    const size_t elem = j->dtype == 1 ? 2 : 4, bytes = (size_t)j->block_size * D * elem;
    for (int t = (t_begin + bs - 1) / bs * bs; t < t_end; t += bs) {
        const size_t head = ((size_t)table[t / bs] * j->num_kv_heads + kvh) * bytes;
        for (size_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch((const char *)j->k_cache + head + b);
            __builtin_prefetch((const char *)j->v_cache + head + b);
        }
    }
}

typedef int16_t vs16 __attribute__((vector_size(32)));
typedef uint32_t vu32 __attribute__((vector_size(64)));

/* 16 int16 lanes read as pairs of int8 (little endian: the first byte is the low one), each
 * sign-extended and widened to float. */
static inline __attribute__((always_inline)) void widen_int8_pairs(const int8_t *src, vf16 *first, vf16 *second) {
    vs16 h;
    memcpy(&h, src, sizeof(h));
    const vi16 w = __builtin_convertvector(h, vi16);
    *first = __builtin_convertvector((vi16)((vu32)w << 24) >> 24, vf16);
    *second = __builtin_convertvector(w >> 8, vf16);
}

/* Widen an int8 row's keys and values t0 .. t0 + nt - 1, all in one block, times their scales
 * into w->kt and w->vt (rows < nt; lanes past nt come out 0: their scale is 0). */
static inline __attribute__((always_inline)) void load_int8_tile(const Job *j, const int32_t *table, int kvh, int t0,
                                                               int nt, const int D, const Scratch *w) {
    const int ibs = j->int8_block_size, off = t0 % ibs, NV = D / 16, GS = j->int8_group, NG = D / GS;
    const size_t region = ((size_t)table[t0 / ibs] * j->num_kv_heads + kvh) * (size_t)j->block_size * D *
                          (j->dtype == 1 ? 2 : 4);
    const int8_t *k = (const int8_t *)j->k_cache + region, *v = (const int8_t *)j->v_cache + region;
    /* Each group's scales of the tile's keys (lanes = keys). A full tile's run of 16 lies inside
     * the group's ibs scales (tiles end at block ends); a partial one is gathered, zeros past nt.
     * (memcpy: no alignment assumed of the cache's bytes.) */
    vf16 ks[D / 16], vs[D / 16]; /* NG <= D / 16: a group is a multiple of 16 channels */
    for (int g = 0; g < NG; g++) {
        const size_t at = (size_t)ibs * D + 4 * ((size_t)g * ibs + off);
        if (nt == TILE) {
            memcpy(&ks[g], k + at, sizeof(vf16));
            memcpy(&vs[g], v + at, sizeof(vf16));
        } else {
            float kf[TILE] = {0}, vf[TILE] = {0};
            memcpy(kf, k + at, sizeof(float) * (size_t)nt);
            memcpy(vf, v + at, sizeof(float) * (size_t)nt);
            memcpy(&ks[g], kf, sizeof(vf16));
            memcpy(&vs[g], vf, sizeof(vf16));
        }
    }
    if (ibs >= 8) {
        /* One 32-byte load per component pair: TILE keys from offset `off`. Past the tile's last
         * key it reads at most 30 bytes more, which past the last pair's row fall in the
         * 4 x groups x ibs (>= 32) bytes of scales: inside the region. */
        for (int g = 0; g < NG; g++)
            for (int i = g * GS / 2; i < (g + 1) * GS / 2; i++) {
                vf16 even, odd;
                widen_int8_pairs(k + (size_t)i * 2 * ibs + 2 * (size_t)off, &even, &odd);
                w->kt[2 * i] = even * ks[g];
                w->kt[2 * i + 1] = odd * ks[g];
            }
    } else { /* tiny blocks: key by key */
        float *kt = (float *)w->kt;
        for (int o = 0; o < TILE; o++)
            for (int d = 0; d < D; d++)
                kt[d * TILE + o] =
                    o < nt ? k[(size_t)(d / 2) * 2 * ibs + 2 * (size_t)(off + o) + d % 2] * ks[d / GS][o] : 0.f;
    }
    /* Values by key pair (off is even, and so is ibs: a pair never straddles blocks); a chunk of
     * 16 components lies in one group. */
    for (int m = 0; 2 * m < nt; m++) {
        const int8_t *pair = v + (size_t)(off / 2 + m) * 2 * D;
        for (int c = 0; c < NV; c++) {
            vf16 first, second;
            widen_int8_pairs(pair + 32 * c, &first, &second);
            const vf16 scale = vs[16 * c / GS];
            w->vt[(2 * m) * NV + c] = first * scale[2 * m];
            w->vt[(2 * m + 1) * NV + c] = second * scale[2 * m + 1];
        }
    }
}

/* One tile of keys for query rows r0 .. r0 + RB - 1, RB <= 4 a constant so that every loop
 * carries independent chains in registers: the scores (two chains per row, over even and odd
 * components or pairs) share each key load, and the value loop updates all RB rows'
 * accumulators per key. With `pairs` set (bf16 cache, AVX512-BF16), scores and values use bf16
 * dot products; the probabilities are then rounded to bf16 for the value products, as torch's
 * own flash kernel does, and their sum is taken of the rounded values. */
static inline __attribute__((always_inline)) void attend_rows(const Scratch *w, int r0, const int RB, int pos0, int G,
                                                            int t0, int nt, const int D, TilePairs pairs,
                                                            float scale) {
    const int NV = D / 16;
    const vf16 zero = {0};
    const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vf16 sc[4];
#if HAVE_BF16_DOT
    if (pairs.keys) {
        const uint32_t *qp[4];
        for (int u = 0; u < RB; u++) qp[u] = w->qp + (size_t)(r0 + u) * (D / 2);
        __m512 even[4], odd[4];
        for (int u = 0; u < RB; u++) even[u] = odd[u] = _mm512_setzero_ps();
        for (int i = 0; i < D / 2; i += 2) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(pairs.keys + (size_t)i * pairs.key_stride);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(pairs.keys + (size_t)(i + 1) * pairs.key_stride);
            for (int u = 0; u < RB; u++) {
                even[u] = _mm512_dpbf16_ps(even[u], (__m512bh)_mm512_set1_epi32((int)qp[u][i]), k0);
                odd[u] = _mm512_dpbf16_ps(odd[u], (__m512bh)_mm512_set1_epi32((int)qp[u][i + 1]), k1);
            }
        }
        for (int u = 0; u < RB; u++) sc[u] = (vf16)(even[u] + odd[u]) * scale;
    } else
#endif
    {
        (void)pairs;
        (void)scale;
        const float *qr[4];
        for (int u = 0; u < RB; u++) qr[u] = w->qf + (size_t)(r0 + u) * D;
        vf16 even[4], odd[4];
        for (int u = 0; u < RB; u++) even[u] = odd[u] = zero;
        for (int d = 0; d < D; d += 2) {
            const vf16 k0 = w->kt[d], k1 = w->kt[d + 1];
            for (int u = 0; u < RB; u++) {
                even[u] += qr[u][d] * k0;
                odd[u] += qr[u][d + 1] * k1;
            }
        }
        for (int u = 0; u < RB; u++) sc[u] = even[u] + odd[u];
    }
    vf16 p[4], a[4][NV];
    int seen = 0; /* keys of the tile any of the rows sees */
#if HAVE_BF16_DOT
    uint32_t p_pairs[4][TILE / 2]; /* bf16 (p[2m], p[2m + 1]) */
#endif
    for (int u = 0; u < RB; u++) {
        const int r = r0 + u, pos = pos0 + r / G;
        const int valid = pos - t0 + 1 < nt ? pos - t0 + 1 : nt;
        seen = valid > seen ? valid : seen;
        const vi16 keep = lane < valid;
        const vf16 s = vselect(keep, sc[u], zero - 1e30f);
        const float old = w->mx[r], tile_max = vmax_lanes(s);
        const float m = tile_max > old ? tile_max : old;
        p[u] = vselect(keep, vexp_nonpositive(s - m), zero);
#if HAVE_BF16_DOT
        if (pairs.keys) {
            const __m256bh rounded = _mm512_cvtneps_pbh((__m512)p[u]);
            memcpy(p_pairs[u], &rounded, sizeof(rounded));
            p[u] = (vf16)_mm512_cvtpbh_ps(rounded);
        }
#endif
        const float corr = expf(old - m);
        w->mx[r] = m;
        w->den[r] = w->den[r] * corr + vsum_lanes(p[u]);
        for (int k = 0; k < NV; k++) a[u][k] = w->acc[(size_t)r * NV + k] * corr;
    }
#if HAVE_BF16_DOT
    if (pairs.keys) {
        for (int m = 0; 2 * m < seen; m++) {
            const uint32_t *v = pairs.values + (size_t)m * pairs.value_stride;
            for (int u = 0; u < RB; u++) {
                const __m512bh pm = (__m512bh)_mm512_set1_epi32((int)p_pairs[u][m]);
                for (int k = 0; k < NV; k++)
                    a[u][k] = (vf16)_mm512_dpbf16_ps((__m512)a[u][k], pm, (__m512bh)_mm512_loadu_si512(v + 16 * k));
            }
        }
    } else
#endif
    {
        for (int o = 0; o < seen; o++) {
            const vf16 *vr = w->vt + (size_t)o * NV;
            for (int u = 0; u < RB; u++) {
                const float po = p[u][o];
                for (int k = 0; k < NV; k++) a[u][k] += po * vr[k];
            }
        }
    }
    for (int u = 0; u < RB; u++)
        for (int k = 0; k < NV; k++) w->acc[(size_t)(r0 + u) * NV + k] = a[u][k];
}

static inline __attribute__((always_inline)) void attend_item(const Job *j, int c, int kvh, int i0, const int D,
                                                            const Scratch *w) {
    const int NV = D / 16, G = j->num_heads / j->num_kv_heads;
    const int start = j->q_starts[c], qlen = j->q_lens[c], slen = j->seq_lens[c];
    const int nq = qlen - i0 < QROWS ? qlen - i0 : QROWS;
    const int pos0 = slen - qlen + i0; /* position of the item's first query token */
    const int rows = nq * G;
    const int32_t *table = j->block_tables + (size_t)c * j->max_blocks;
    const int int8 = j->int8_rows != NULL && j->int8_rows[c];
    const int bs = int8 ? j->int8_block_size : j->block_size; /* keys per block of the row */
    const int bf16_dot = HAVE_BF16_DOT && j->dtype == 1 && !int8;
    const vf16 zero = {0};

    for (int i = 0; i < nq; i++)
        for (int g = 0; g < G; g++) {
            const size_t src = (size_t)(start + i0 + i) * j->q_row_stride + (size_t)(kvh * G + g) * D;
            const int r = i * G + g;
            if (bf16_dot) { /* raw pairs; the scale goes on the scores */
                memcpy(w->qp + (size_t)r * (D / 2), (const uint16_t *)j->q + src, sizeof(uint16_t) * (size_t)D);
            } else {
                float *dst = w->qf + (size_t)r * D;
                load_floats(j->q, src, D, j->dtype, dst);
                for (int d = 0; d < D; d++) dst[d] *= j->scale;
            }
        }
    for (int r = 0; r < rows; r++) { w->mx[r] = -1e30f; w->den[r] = 0.f; }
    for (int k = 0; k < rows * NV; k++) w->acc[k] = zero;

    const int num_keys = pos0 + nq; /* the last token sees keys 0 .. pos0 + nq - 1 */
    prefetch_keys(j, table, kvh, 0, num_keys < PREFETCH_AHEAD ? num_keys : PREFETCH_AHEAD, D, bs);
    for (int t0 = 0, span; t0 < num_keys; t0 += span) {
        /* An int8 row's tiles stop at its block ends. */
        span = int8 && bs - t0 % bs < TILE ? bs - t0 % bs : TILE;
        const int nt = num_keys - t0 < span ? num_keys - t0 : span;
        if (t0 + PREFETCH_AHEAD < num_keys)
            prefetch_keys(j, table, kvh, t0 + PREFETCH_AHEAD,
                          num_keys < t0 + PREFETCH_AHEAD + span ? num_keys : t0 + PREFETCH_AHEAD + span, D, bs);
        TilePairs pairs = {NULL, NULL, 0, 0};
        if (int8) {
            load_int8_tile(j, table, kvh, t0, nt, D, w);
        } else if (bf16_dot) {
            pairs = tile_pairs(j, table, kvh, t0, nt, D, w);
        } else {
            load_keys(j, table, kvh, t0, nt, D, w);
            load_values(j, table, kvh, t0, nt, D, w);
        }
        /* Rows are in position order: those before position t0 see none of this tile. */
        int r0 = (t0 > pos0 ? t0 - pos0 : 0) * G;
        for (; r0 + 4 <= rows; r0 += 4) attend_rows(w, r0, 4, pos0, G, t0, nt, D, pairs, j->scale);
        switch (rows - r0) {
            case 3: attend_rows(w, r0, 3, pos0, G, t0, nt, D, pairs, j->scale); break;
            case 2: attend_rows(w, r0, 2, pos0, G, t0, nt, D, pairs, j->scale); break;
            case 1: attend_rows(w, r0, 1, pos0, G, t0, nt, D, pairs, j->scale); break;
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

static void *aligned_buffer(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

int paged_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                    const int32_t *q_starts, const int32_t *q_lens, const int32_t *seq_lens, void *out,
                    int num_requests, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                    int q_row_stride, int out_row_stride, float scale, int dtype, const int32_t *int8_rows,
                    int int8_block_size, int int8_group) {
    const int G = num_heads / num_kv_heads, D = head_dim;
    if (D % 16 != 0 || (int8_rows != NULL && (int8_group < 16 || int8_group % 16 != 0 || D % int8_group != 0)))
        return -1;
    /* Work items enumerated through a prefix sum over requests. */
    int *first_item = malloc(sizeof(int) * (size_t)(num_requests + 1));
    first_item[0] = 0;
    for (int c = 0; c < num_requests; c++)
        first_item[c + 1] = first_item[c] + num_kv_heads * ((q_lens[c] + QROWS - 1) / QROWS);
    const int items = first_item[num_requests];
    const Job job = {q, k_cache, v_cache, block_tables, q_starts, q_lens, seq_lens, out, num_heads, num_kv_heads,
                     block_size, max_blocks, q_row_stride, out_row_stride, dtype, scale, int8_rows,
                     int8_block_size, int8_group};
    /* OpenMP resolves to the libgomp torch already loaded (same soname), so this loop runs on
     * torch's own worker threads: a second thread pool would fight torch's spinning workers
     * for the cores. */
#pragma omp parallel
    {
        const size_t rows = (size_t)QROWS * G;
        Scratch w = {aligned_buffer(sizeof(float) * rows * D), aligned_buffer(sizeof(uint16_t) * rows * D),
                     aligned_buffer(sizeof(float) * rows * D), aligned_buffer(sizeof(float) * rows),
                     aligned_buffer(sizeof(float) * rows), aligned_buffer(sizeof(float) * TILE * D),
                     aligned_buffer(sizeof(uint16_t) * TILE * D), aligned_buffer(sizeof(float) * TILE * D),
                     aligned_buffer(sizeof(uint16_t) * TILE * D)};
        /* Items differ in cost (context length, causal position): hand them out dynamically. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            int lo = 0, hi = num_requests - 1; /* the request c with first_item[c] <= item < first_item[c+1] */
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (first_item[mid] <= item) lo = mid; else hi = mid - 1;
            }
            const int local = item - first_item[lo];
            const int kvh = local % num_kv_heads, i0 = (local / num_kv_heads) * QROWS;
            if (D == 64) attend_item(&job, lo, kvh, i0, 64, &w);
            else if (D == 128) attend_item(&job, lo, kvh, i0, 128, &w);
            else attend_item(&job, lo, kvh, i0, D, &w);
        }
        free(w.qf); free(w.qp); free(w.acc); free(w.mx); free(w.den); free(w.kt); free(w.kp); free(w.vt); free(w.vp);
    }
    free(first_item);
    return 0;
}

/* Store this step's K/V rows at their slots: k, v rows [T] of num_kv_heads * D (row strides
 * given), slot_mapping int64 [T]; a slot < 0 (an int8 row's token) is skipped. */
/* One token's K and V rows for one kv head into their slot `off` of a (block, head) region:
 * components d, d + 1 of the key side by side, bs pairs apart; component d of the value beside
 * that of its pair key. Typed on the element so that the strided stores stay plain moves. */
#define STORE_SLOT(T)                                                                                   \
    do {                                                                                                \
        const T *ks_ = (const T *)ks, *vs_ = (const T *)vs;                                             \
        T *kc_ = (T *)k_cache + head + 2 * (size_t)off, *vc_ = (T *)v_cache + head + (size_t)(off / 2) * 2 * D + off % 2; \
        for (int d = 0; d < D; d += 2) {                                                                \
            kc_[(size_t)d * bs] = ks_[d];                                                               \
            kc_[(size_t)d * bs + 1] = ks_[d + 1];                                                       \
        }                                                                                               \
        for (int d = 0; d < D; d++) vc_[2 * (size_t)d] = vs_[d];                                        \
    } while (0)

void write_kv_cache(const void *k, const void *v, const int64_t *slot_mapping, void *k_cache, void *v_cache,
                    int num_tokens, int k_row_stride, int v_row_stride, int num_kv_heads, int head_dim,
                    int block_size, int elem_size) {
    const int D = head_dim, bs = block_size;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t], block = slot / bs, off = slot % bs;
        if (slot < 0) continue;
        for (int h = 0; h < num_kv_heads; h++) {
            const size_t head = ((size_t)block * num_kv_heads + h) * (size_t)bs * D;
            const char *ks = (const char *)k + ((size_t)t * k_row_stride + (size_t)h * D) * elem_size;
            const char *vs = (const char *)v + ((size_t)t * v_row_stride + (size_t)h * D) * elem_size;
            if (elem_size == 2) STORE_SLOT(uint16_t);
            else STORE_SLOT(float);
        }
    }
}

/* Symmetric int8 of one row of D values: returns scale = max|x| / 127 and stores q = x / scale
 * rounded to nearest (ties to even), in [-127, 127]; an all-zero row gets scale 0 and zeros, a
 * row with a NaN or inf a NaN scale and zeros. Both
 * quotients are the IEEE ones, as torch computes them. */
static inline float quantize_row(const float *x, int D, int8_t *q) {
    float amax = 0.f;
    int finite = 1;
    for (int d = 0; d < D; d++) {
        amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        /* By the bits: -ffast-math lets the compiler assume no NaN or inf exists. */
        uint32_t bits;
        memcpy(&bits, x + d, sizeof(bits));
        finite &= (bits & 0x7F800000u) != 0x7F800000u;
    }
    if (!finite) { /* a NaN or inf (the model overflowed): the token reads back as NaN, as in bf16 */
        const uint32_t nan_bits = 0x7FC00000u;
        float nan;
        memcpy(&nan, &nan_bits, sizeof(nan));
        for (int d = 0; d < D; d++) q[d] = 0;
        return nan;
    }
    /* In double: -ffast-math turns amax / 127.f into a product with a rounded 1 / 127, off by an
     * ulp now and then; the double product rounds to the exact float quotient (a / 127 never
     * lies within 2^-32 of a float midpoint). */
    const float scale = (float)((double)amax * (1.0 / 127.0));
    if (!(scale > 0.f)) {
        for (int d = 0; d < D; d++) q[d] = 0;
        return 0.f;
    }
    for (int d = 0; d < D; d++) {
        /* The divisor opaque to the compiler, element by element, so that it divides: under
         * -ffast-math it would multiply by a (vector-approximated) reciprocal instead, and round
         * some quotients the other way (exact ties above all, frequent for bf16 inputs). */
        float divisor = scale;
        __asm__("" : "+m"(divisor));
        float r = __builtin_rintf(x[d] / divisor);
        r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
        q[d] = (int8_t)r;
    }
    return scale;
}

/* Store int8 rows' K/V: as write_kv_cache, but each group of `group` channels of a token's head
 * quantised (quantize_row) into its slot of a block of int8_block_size tokens (layout at the top;
 * slot = block * ibs + offset), its scale after the values. Slots < 0 (model-dtype rows' tokens)
 * are skipped. */
static inline void store_int8(int8_t *region, const float *x, int D, int ibs, int off, int group, int is_key) {
    int8_t q[group];
    for (int g = 0; g < D / group; g++) {
        const float scale = quantize_row(x + g * group, group, q);
        for (int i = 0; i < group; i++) {
            const int d = g * group + i;
            region[is_key ? (size_t)(d / 2) * 2 * ibs + 2 * (size_t)off + d % 2
                          : (size_t)(off / 2) * 2 * D + 2 * (size_t)d + off % 2] = q[i];
        }
        memcpy(region + (size_t)ibs * D + 4 * ((size_t)g * ibs + off), &scale, sizeof(scale));
    }
}

void write_kv_cache_int8(const void *k, const void *v, const int64_t *slot_mapping, void *k_cache, void *v_cache,
                         int num_tokens, int k_row_stride, int v_row_stride, int num_kv_heads, int head_dim,
                         int block_size, int int8_block_size, int int8_group, int elem_size) {
    const int D = head_dim, ibs = int8_block_size, dtype = elem_size == 2;
    if (int8_group < 1 || D % int8_group != 0) return; /* the wrapper always passes a divisor */
    const size_t region = (size_t)block_size * D * elem_size;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t], block = slot / ibs, off = slot % ibs;
        if (slot < 0) continue;
        float x[D];
        for (int h = 0; h < num_kv_heads; h++) {
            const size_t head = ((size_t)block * num_kv_heads + h) * region;
            load_floats(k, (size_t)t * k_row_stride + (size_t)h * D, D, dtype, x);
            store_int8((int8_t *)k_cache + head, x, D, ibs, (int)off, int8_group, 1);
            load_floats(v, (size_t)t * v_row_stride + (size_t)h * D, D, dtype, x);
            store_int8((int8_t *)v_cache + head, x, D, ibs, (int)off, int8_group, 0);
        }
    }
}
