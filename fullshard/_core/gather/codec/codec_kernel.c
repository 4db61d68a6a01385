/* The quantized all-gather's codec as plain C loops (see [Note: Codec kernel] in codec_kernel.py).

   Every conversion gives the bits of torch's own: fp32 -> bf16 and fp32 -> float8_e4m3fn round
   to nearest even (float8 saturating at 448 after the clamp), float8 -> fp32 is exact and does
   not depend on denormals being kept. The portable loops are written for gcc to vectorize
   (branch-free selects on integer bits); float8's two conversions also have AVX-512 versions,
   chosen at load time where the CPU has it, about twice (encode) and 1.3 times (decode) as fast
   as gcc's vectorization of the portable ones. No torch header: this compiles in about a second. */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512 1
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

enum { CODE_INT8 = 0, CODE_FLOAT8 = 1 };

static inline uint32_t bits_of(float value) {
  uint32_t bits;
  memcpy(&bits, &value, 4);
  return bits;
}

static inline float float_of(uint32_t bits) {
  float value;
  memcpy(&value, &bits, 4);
  return value;
}

/* fp32 bits rounded to bf16 (nearest even), back in an fp32's bits; a NaN becomes the quiet NaN. */
static inline uint32_t round_to_bf16(uint32_t bits) {
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : rounded;
}

/* float8_e4m3fn's byte of an fp32 in [-448, 448] or NaN: torch's rounding (nearest even,
   subnormals by adding 2**14 so that the fp32 addition rounds at float8's last place). */
static inline uint8_t float8_of(float value) {
  uint32_t bits = bits_of(value);
  uint32_t sign = bits & 0x80000000u;
  uint32_t magnitude = bits ^ sign;
  uint32_t denormal_bias = 141u << 23;
  uint32_t subnormal = bits_of(float_of(magnitude) + float_of(denormal_bias)) - denormal_bias;
  uint32_t normal = (magnitude + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((magnitude >> 20) & 1u)) >> 20;
  uint32_t code = magnitude < (121u << 23) ? subnormal : normal;
  code = magnitude >= (1087u << 20) ? 0x7Fu : code;
  return (uint8_t)(code | (sign >> 24));
}

/* The fp32 value of a float8_e4m3fn byte, exactly: normal codes by rebiasing the exponent in the
   bits, subnormal ones (exponent 0) as their integer mantissa times 2**-9, 0x7F and 0xFF NaN. */
static inline float value_of_float8(uint8_t code) {
  uint32_t magnitude = code & 0x7Fu;
  uint32_t normal = (magnitude << 20) + (120u << 23);
  uint32_t subnormal = bits_of((float)(magnitude & 7u) * 0x1p-9f);
  uint32_t is_normal = 0u - (uint32_t)(magnitude > 7u), is_nan = 0u - (uint32_t)(magnitude == 0x7Fu);
  uint32_t bits = (normal & is_normal) | (subnormal & ~is_normal);  /* masks: gcc vectorizes these, not ?: */
  bits = (0x7FC00000u & is_nan) | (bits & ~is_nan);
  return float_of(bits | ((uint32_t)(code & 0x80u) << 24));
}

/* The values of one piece of the source, as the fp32 bits of the compute dtype's values. */
CLONES static void load_values(const void *source, int source_bf16, int round_bf16, int64_t n, uint32_t *out) {
  if (source_bf16) {
    const uint16_t *from = (const uint16_t *)source;
    for (int64_t i = 0; i < n; i++) out[i] = (uint32_t)from[i] << 16;
  } else if (round_bf16) {
    const uint32_t *from = (const uint32_t *)source;
    for (int64_t i = 0; i < n; i++) out[i] = round_to_bf16(from[i]);
  } else {
    memcpy(out, source, (size_t)n * 4);
  }
}

#ifdef HAVE_AVX512
/* float8 decode with AVX-512: the value of each magnitude from a table of 128 in eight registers (four
   two-register permutes and three blends: 25% faster than the exact arithmetic above, which
   gcc vectorizes into many more instructions), then the sign, the scale and bf16's rounding. */
static float float8_magnitudes[128];
static int avx512_ok;

__attribute__((constructor)) static void prepare_decode(void) {
  for (int magnitude = 0; magnitude < 128; magnitude++) float8_magnitudes[magnitude] = value_of_float8(magnitude);
  __builtin_cpu_init();
  avx512_ok = __builtin_cpu_supports("avx512f");
}

__attribute__((target("avx512f"))) static int64_t decode_float8_avx512(const uint8_t *codes, int64_t n, float scale,
                                                                       int out_bf16, void *out) {
  const float *table = float8_magnitudes;
  __m512 t0 = _mm512_loadu_ps(table), t1 = _mm512_loadu_ps(table + 16), t2 = _mm512_loadu_ps(table + 32);
  __m512 t3 = _mm512_loadu_ps(table + 48), t4 = _mm512_loadu_ps(table + 64), t5 = _mm512_loadu_ps(table + 80);
  __m512 t6 = _mm512_loadu_ps(table + 96), t7 = _mm512_loadu_ps(table + 112), scales = _mm512_set1_ps(scale);
  __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64), sign_bit = _mm512_set1_epi32(0x80);
  __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i infinity = _mm512_set1_epi32(0x7F800000), quiet_nan = _mm512_set1_epi32(0x7FC00000);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
    __mmask16 upper32 = _mm512_test_epi32_mask(c, bit5), upper64 = _mm512_test_epi32_mask(c, bit6);
    __m512 low = _mm512_mask_blend_ps(upper32, _mm512_permutex2var_ps(t0, c, t1), _mm512_permutex2var_ps(t2, c, t3));
    __m512 high = _mm512_mask_blend_ps(upper32, _mm512_permutex2var_ps(t4, c, t5), _mm512_permutex2var_ps(t6, c, t7));
    __m512i value = _mm512_castps_si512(_mm512_mask_blend_ps(upper64, low, high));
    value = _mm512_or_si512(value, _mm512_slli_epi32(_mm512_and_si512(c, sign_bit), 24));
    __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(value), scales);
    if (!out_bf16) {
      _mm512_storeu_ps((float *)out + i, scaled);
      continue;
    }
    __m512i bits = _mm512_castps_si512(scaled);
    __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, half), _mm512_and_si512(_mm512_srli_epi32(bits, 16), one));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), infinity);
    rounded = _mm512_srli_epi32(_mm512_mask_mov_epi32(rounded, nan, quiet_nan), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(rounded));
  }
  return i;
}

/* float8 codes of n scaled values with AVX-512: float8_of's steps on 16 lanes (gcc's own
   vectorization of it is about half as fast); returns how many it coded. */
__attribute__((target("avx512f"))) static int64_t encode_float8_avx512(const uint32_t *values, int64_t n,
                                                                       float inverse, uint8_t *codes) {
  __m512 inverses = _mm512_set1_ps(inverse), low = _mm512_set1_ps(-448.0f), high = _mm512_set1_ps(448.0f);
  __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u), denormal_bias = _mm512_set1_epi32(141 << 23);
  __m512i rebias = _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu)), one = _mm512_set1_epi32(1);
  __m512i smallest_normal = _mm512_set1_epi32(121 << 23), too_large = _mm512_set1_epi32(1087 << 20);
  __m512i nan_code = _mm512_set1_epi32(0x7F);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps((const float *)values + i), inverses);
    scaled = _mm512_min_ps(high, _mm512_max_ps(low, scaled));  /* max/min pass a NaN second operand */
    __m512i bits = _mm512_castps_si512(scaled);
    __m512i sign = _mm512_and_si512(bits, sign_bit), magnitude = _mm512_xor_si512(bits, sign);
    __m512 shifted = _mm512_add_ps(_mm512_castsi512_ps(magnitude), _mm512_castsi512_ps(denormal_bias));
    __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(shifted), denormal_bias);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, 20), one);
    __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(magnitude, rebias), odd), 20);
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(magnitude, smallest_normal), normal, subnormal);
    code = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(magnitude, too_large), code, nan_code);
    code = _mm512_or_si512(code, _mm512_srli_epi32(sign, 24));
    _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(code));
  }
  return i;
}
#endif

/* One block: its scale (absmax / code max, 1 for an all-zero block) and its n codes. */
CLONES static float code_block(const uint32_t *values, int64_t n, int code, uint8_t *codes) {
  uint32_t absmax_bits = 0;  /* |x| as bits orders like |x|, and a NaN above every number */
  for (int64_t i = 0; i < n; i++) {
    uint32_t magnitude = values[i] & 0x7FFFFFFFu;
    absmax_bits = magnitude > absmax_bits ? magnitude : absmax_bits;
  }
  float absmax = float_of(absmax_bits > 0x7F800000u ? 0x7FC00000u : absmax_bits);
  float code_max = code == CODE_FLOAT8 ? 448.0f : 127.0f;
  float scale = absmax_bits == 0 ? 1.0f : absmax / code_max;
  float inverse = 1.0f / scale;
  if (code == CODE_FLOAT8) {
    int64_t i = 0;
#ifdef HAVE_AVX512
    if (avx512_ok) i = encode_float8_avx512(values, n, inverse, codes);
#endif
    for (; i < n; i++) {
      float scaled = float_of(values[i]) * inverse;
      scaled = scaled < -448.0f ? -448.0f : scaled;  /* a NaN passes both, as torch's clamp */
      scaled = scaled > 448.0f ? 448.0f : scaled;
      codes[i] = float8_of(scaled);
    }
  } else {
    for (int64_t i = 0; i < n; i++) codes[i] = (uint8_t)(int8_t)(int32_t)__builtin_rintf(float_of(values[i]) * inverse);
  }
  return scale;
}

/* Encodes the coded values, laid back to back from the source's segments (rows of
   `segments`: source offset, coded position, length; sorted, contiguous from 0 to
   coded_numel), into `codes` (whole blocks, the padding zero) and `scales` (fp32, a block each).
   `scratch` holds a block of values for each of the `num_threads` threads. */
void fullshard_encode(const void *source, int source_bf16, int round_bf16, const int64_t *segments,
                      int64_t num_segments, int64_t coded_numel, int64_t block_size, int code, uint8_t *codes,
                      uint8_t *scales, uint32_t *scratch, int num_threads) {
  int64_t num_blocks = (coded_numel + block_size - 1) / block_size;
  int64_t element_size = source_bf16 ? 2 : 4;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    uint32_t *values = scratch + (int64_t)omp_get_thread_num() * block_size;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < num_blocks; block++) {
      int64_t start = block * block_size;
      int64_t stop = start + block_size < coded_numel ? start + block_size : coded_numel;
      int64_t low = 0, high = num_segments - 1;  /* the last segment that starts at or before the block */
      while (low < high) {
        int64_t middle = (low + high + 1) / 2;
        if (segments[3 * middle + 1] <= start) low = middle; else high = middle - 1;
      }
      for (int64_t at = start, segment = low; at < stop; segment++) {
        const int64_t *row = segments + 3 * segment;
        int64_t end = row[1] + row[2] < stop ? row[1] + row[2] : stop;
        const char *from = (const char *)source + (row[0] + at - row[1]) * element_size;
        load_values(from, source_bf16, round_bf16, end - at, values + (at - start));
        at = end;
      }
      float scale = code_block(values, stop - start, code, codes + start);
      memset(codes + stop, 0, (size_t)(start + block_size - stop));
      memcpy(scales + 4 * block, &scale, 4);
    }
  }
}


/* n codes of one block, times its scale, into fp32 or bf16 outputs. */
CLONES static void decode_piece(const uint8_t *codes, int64_t n, float scale, int code, int out_bf16, void *out) {
#ifdef HAVE_AVX512
  if (code == CODE_FLOAT8 && avx512_ok) {
    int64_t done = decode_float8_avx512(codes, n, scale, out_bf16, out);
    codes += done, n -= done, out = (char *)out + done * (out_bf16 ? 2 : 4);
  }
#endif
  if (code == CODE_FLOAT8 && out_bf16) {
    uint16_t *to = (uint16_t *)out;
    for (int64_t i = 0; i < n; i++) to[i] = (uint16_t)(round_to_bf16(bits_of(value_of_float8(codes[i]) * scale)) >> 16);
  } else if (code == CODE_FLOAT8) {
    float *to = (float *)out;
    for (int64_t i = 0; i < n; i++) to[i] = value_of_float8(codes[i]) * scale;
  } else if (out_bf16) {
    uint16_t *to = (uint16_t *)out;
    for (int64_t i = 0; i < n; i++) to[i] = (uint16_t)(round_to_bf16(bits_of((float)(int8_t)codes[i] * scale)) >> 16);
  } else {
    float *to = (float *)out;
    for (int64_t i = 0; i < n; i++) to[i] = (float)(int8_t)codes[i] * scale;
  }
}

/* Decodes the gathered rows (`row_bytes` apart) into the outputs (data pointers `outputs`), one
   row of `segments` per piece: gathered row, byte position in it, byte offset of that row's
   scales (-1: an exact piece, copied as it is), output index, element offset in the output,
   length in elements. */
void fullshard_decode(const uint8_t *gathered, int64_t row_bytes, const int64_t *segments, int64_t num_segments,
                      const int64_t *outputs, int out_bf16, int64_t block_size, int code, int num_threads) {
  int64_t element_size = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
  for (int64_t segment = 0; segment < num_segments; segment++) {
    const int64_t *row = segments + 6 * segment;
    const uint8_t *chunk = gathered + row[0] * row_bytes;
    char *out = (char *)(intptr_t)outputs[row[3]] + row[4] * element_size;
    if (row[2] < 0) {  /* a parameter sent exact: its bytes as they are */
      memcpy(out, chunk + row[1], (size_t)(row[5] * element_size));
      continue;
    }
    for (int64_t at = row[1], stop = row[1] + row[5]; at < stop;) {
      int64_t block = at / block_size;
      int64_t end = (block + 1) * block_size < stop ? (block + 1) * block_size : stop;
      float scale;
      memcpy(&scale, chunk + row[2] + 4 * block, 4);
      decode_piece(chunk + at, end - at, scale, code, out_bf16, out + (at - row[1]) * element_size);
      at = end;
    }
  }
}
