/* 16-lane float and int vectors through GCC/Clang vector extensions: AVX-512 registers under
 * -march=native on this machine, narrower ones elsewhere, without intrinsics. */
#pragma once
#include <stdint.h>
#include <string.h>

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

static inline vf16 vselect(vi16 mask, vf16 a, vf16 b) {
    return (vf16)(((vi16)a & mask) | ((vi16)b & ~mask));
}

typedef uint16_t vu16 __attribute__((vector_size(32)));

/* 16 consecutive bf16 values, widened to float. */
static inline vf16 widen_bf16x16(const uint16_t *src) {
    vu16 h;
    memcpy(&h, src, sizeof(h));
    return (vf16)(__builtin_convertvector(h, vi16) << 16);
}

