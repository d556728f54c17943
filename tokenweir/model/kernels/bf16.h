/* bfloat16 <-> float conversions shared by the kernels (bf16 is the top half of a float). */
#pragma once
#include <stdint.h>
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

/* x rounded to the nearest bfloat16, as a float: what a torch op in bf16 stores. */
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
