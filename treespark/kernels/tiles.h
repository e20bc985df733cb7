/* What gemv.c's and chunks.c's AMX tile forms share: the tile configuration's layout, and
 * a float32 vector split exactly into three bfloat16 parts (x = hi + mid + lo, each the
 * top 16 bits of what the ones before leave: 8 + 8 + 8 significant bits hold a float's 24),
 * with a bfloat16-valued float's upper half as the 16 bits a tile reads. */
#ifndef TS_TILES_H
#define TS_TILES_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* v's three exact bfloat16 parts, as the floats they are */
static inline void split3v(__m512 v, __m512 parts[3]) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    parts[0] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
    const __m512 r = _mm512_sub_ps(v, parts[0]);
    parts[1] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), top));
    parts[2] = _mm512_sub_ps(r, parts[1]);
}

static inline __m256i bf16_bits(__m512 v) {   /* a bfloat16-valued float's upper half */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}
#endif
#endif
