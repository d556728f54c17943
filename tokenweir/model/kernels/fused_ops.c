/* Fused elementwise ops for bfloat16 decoder layers on the CPU.
 *
 * Why: in bf16 each of torch's elementwise ops makes a full pass over its tensors and most run
 * far below memory speed here (an RMSNorm is 7 ops, RoPE 4, SwiGLU 2), so at 30 layers they
 * cost ~15% of a prefill step and, with the op dispatch, several ms of every decode step. Each
 * kernel below does one pass and rounds to bf16 at exactly the points where the torch ops do
 * (each torch op computes in float and stores bf16), so the results equal the torch path's.
 *
 * All tensors are contiguous bf16 rows except where a row stride is given; loops over rows run
 * on torch's OpenMP pool (see paged_attention.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* residual (if given) += x, rounded; out = weight * bf16(r * rsqrt(mean(r^2) + eps)) where r is
 * the (new) residual, or x when there is none. As transformers' LlamaRMSNorm. */
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                   int num_rows, int hidden, float eps) {
#pragma omp parallel
    {
        float *row = malloc(sizeof(float) * (size_t)hidden);
#pragma omp for schedule(static)
        for (int t = 0; t < num_rows; t++) {
            const uint16_t *xt = x + (size_t)t * hidden;
            uint16_t *rt = residual ? residual + (size_t)t * hidden : NULL;
            float sum_sq = 0.f;
            for (int i = 0; i < hidden; i++) {
                float v = bf16_to_f32(xt[i]);
                if (rt) {
                    v = round_bf16(v + bf16_to_f32(rt[i]));
                    rt[i] = f32_to_bf16(v);
                }
                row[i] = v;
                sum_sq += v * v;
            }
            const float inv = 1.f / sqrtf(sum_sq / (float)hidden + eps);
            uint16_t *ot = out + (size_t)t * hidden;
            for (int i = 0; i < hidden; i++)
                ot[i] = f32_to_bf16(round_bf16(row[i] * inv) * bf16_to_f32(weight[i]));
        }
        free(row);
    }
}

/* gate_up [T, 2I] -> out [T, I] = bf16(silu(gate)) * up, rounded. */
void silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int num_rows, int inter) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_rows; t++) {
        const uint16_t *g = gate_up + (size_t)t * 2 * inter, *u = g + inter;
        uint16_t *o = out + (size_t)t * inter;
        for (int i = 0; i < inter; i++) {
            const float gv = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(gv / (1.f + expf(-gv))) * bf16_to_f32(u[i]));
        }
    }
}

/* Neox-style rotate-half RoPE, in place, on the first num_heads heads of each row of x
 * (row stride in elements; heads of head_dim adjacent). cos / sin_signed: [max_pos, head_dim]
 * tables with the rotate-half sign folded into sin. Per element, as the torch path:
 * bf16(bf16(x * cos) + bf16(rotated * sin)). */
void rope_bf16(uint16_t *x, const int64_t *positions, const uint16_t *cos_table, const uint16_t *sin_table,
               int num_rows, int row_stride, int num_heads, int head_dim) {
    const int half = head_dim / 2;
#pragma omp parallel
    {
        float *orig = malloc(sizeof(float) * (size_t)head_dim);
#pragma omp for schedule(static)
        for (int t = 0; t < num_rows; t++) {
            const uint16_t *c = cos_table + (size_t)positions[t] * head_dim;
            const uint16_t *s = sin_table + (size_t)positions[t] * head_dim;
            for (int h = 0; h < num_heads; h++) {
                uint16_t *v = x + (size_t)t * row_stride + (size_t)h * head_dim;
                for (int i = 0; i < head_dim; i++) orig[i] = bf16_to_f32(v[i]);
                for (int i = 0; i < head_dim; i++) {
                    const float rotated = orig[i < half ? i + half : i - half];
                    v[i] = f32_to_bf16(round_bf16(orig[i] * bf16_to_f32(c[i])) +
                                       round_bf16(rotated * bf16_to_f32(s[i])));
                }
            }
        }
        free(orig);
    }
}
