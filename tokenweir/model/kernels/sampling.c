/* Sampling helpers on the CPU. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec16.h"

/* Index of the largest value in each of num_rows rows of `cols` bf16 logits (first on ties, as
 * torch.argmax). Greedy sampling on bf16 logits: torch's argmax is slow in bf16 and widening
 * the logits to float32 first costs a full copy. */
void argmax_rows_bf16(const uint16_t *x, int64_t *out, int num_rows, int cols) {
    const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma omp parallel for schedule(static)
    for (int r = 0; r < num_rows; r++) {
        const uint16_t *row = x + (size_t)r * cols;
        float best = bf16_to_f32(row[0]);
        int64_t at = 0;
        int c = 0;
        if (cols >= 16) { /* per-lane maxima and where they are, then the lanes compared */
            vf16 lane_best = widen_bf16x16(row);
            vi16 lane_at = lane;
            for (c = 16; c + 16 <= cols; c += 16) {
                const vf16 v = widen_bf16x16(row + c);
                const vi16 greater = v > lane_best;
                lane_best = vselect(greater, v, lane_best);
                lane_at = (greater & (lane + c)) | (~greater & lane_at);
            }
            best = lane_best[0];
            at = lane_at[0];
            for (int l = 1; l < 16; l++)
                if (lane_best[l] > best || (lane_best[l] == best && lane_at[l] < at)) {
                    best = lane_best[l];
                    at = lane_at[l];
                }
        }
        for (; c < cols; c++) {
            const float v = bf16_to_f32(row[c]);
            if (v > best) { best = v; at = c; }
        }
        out[r] = at;
    }
}
