// specfleet native CPU kernels, compiled on first use by kernels/cpu_native.py and loaded with ctypes.
//
// Why they exist: on CPU, a decode step is memory-bound, and MKL's sgemm handles a few rows badly
// (5 rows cost about 3x one row, although they read the same weights once), while SDPA over a
// gathered copy of the paged KV cache reads every cached token three times. These kernels read each
// weight and each cached key/value once per step:
//   - sf_linear_f32: y = x @ W (+ bias) (+ residual) for a weight packed into 32-column panels, so
//     each thread streams its panels front to back; up to 8 rows share every weight load.
//   - sf_linear_i8: the same over int8 weights with one scale per output column (a quantized draft
//     model reads a quarter of the bytes); x and the accumulation stay float32.
//   - sf_linear_q4 / sf_linear_q8g: grouped weight-only quantization (GGUF Q4_0/Q4_1/Q4_K/Q5_*/Q6_K/Q8_0,
//     AWQ, GPTQ, all repacked to one layout): 4-, 5-, 6-bit or int8 codes in the same panels, a scale and a
//     min per (group of input rows, output column), dequantized in registers; x stays float32.
//   - sf_linear_qdot: the same weights with x quantized to int8 per 32 values first, then integer dot
//     products (vpdpbusd) and one scale per block, as llama.cpp's CPU path (see dot_linear).
//   - sf_paged_attention_f32: causal attention of short queries (decode, speculative verification)
//     over the paged cache in place, one (sequence, kv head) per task, online softmax per block.
//   - sf_rms_norm_f32, sf_silu_mul_f32: the small elementwise ops of a layer, one pass each.
//   - sf_softcap_f32: Gemma 2's final logit soft-cap, cap * tanh(x / cap), in place over a step's logits.
//
// Plain C ABI over raw pointers: the Python side checks shapes, dtypes and contiguity before each
// call. OpenMP resolves to the libgomp that torch has already loaded (same soname), so these kernels
// and torch's own ops share one thread pool.
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// ---- 16-lane vectors -----------------------------------------------------------------------------
// The kernels are written for 16 float lanes (a 32-column panel is two of them). With AVX-512 a lane
// vector is one register (GCC's vector extensions). Without it GCC lowers 64-byte vector types through
// the stack: the float GEMV ran at 3.5 GB/s on an AVX2 EPYC, against 40 GB/s for the same loop on
// 32-byte vectors (both with the weights in cache). There a lane vector is a Pair of native 32-byte
// halves with the same operators, and the integer dot products use AVX2's maddubs/madd (or AVX-VNNI).
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef uint8_t u8x64u __attribute__((vector_size(64), aligned(1)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }
inline u8x64 load_bytes(const uint8_t* p) { return *reinterpret_cast<const u8x64u*>(p); }
inline v16 splat(float f) { return v16{} + f; }
inline i16 splat_i(int32_t v) { return i16{} + v; }
inline float lane(v16 v, int i) { return v[i]; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
inline v16 vmin(v16 a, v16 b) { return a < b ? a : b; }
inline v16 vselect_lt(v16 a, v16 b, v16 x, v16 y) { return a < b ? x : y; }  // per lane: a < b ? x : y
inline i16 to_int(v16 v) { return __builtin_convertvector(v, i16); }
inline v16 to_float(i16 v) { return __builtin_convertvector(v, v16); }
inline v16 bits_to_float(i16 v) { return (v16)v; }
// 16 int8 -> 16 floats. GCC scalarises __builtin_convertvector for this widening, hence intrinsics.
inline v16 load(const int8_t* p) {
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 IEEE halfs (as their bits) -> 16 floats.
inline v16 load(const uint16_t* p) {
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline float hsum(v16 v) {
  v += __builtin_shuffle(v, i16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, i16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, i16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, i16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}
// 16 bytes -> 16 floats of their low nibbles (lo) and of their high nibbles (hi).
inline void load_nibbles(const uint8_t* p, v16& lo, v16& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
  lo = (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
  hi = (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}
// The integer dot products of dot_tile. Lane l of a 16-lane int32 vector sums the products of bytes
// 4l..4l+3 of the weight codes w (unsigned) and the activations x (int8, never -128: quantize_row).
//   4-bit codes: dot4 adds w . x into a Sum4, which sum4 turns into int32 lanes once per 32-block;
//   8-bit codes (stored + 128): dot8 adds w . x into int32 lanes, which then hold code . x + 128 * sum(x)
//   where kDot8Offset (the caller subtracts it), else code . x.
// vpdpbusd (VNNI) adds without saturating. maddubs (AVX512BW, AVX2) sums byte pairs into int16 with
// saturation: 4-bit pairs (15 * 127 * 2 = 3810) sum to 30480 over the 8 steps of a block, below 32767, so
// Sum4 stays int16 for the block and is widened once; 8-bit codes are split (w = 2 (w >> 1) + (w & 1)).
inline i16 dot_scalar(i16 acc, u8x64 w, i16 x) {
  const u8x64 xb = (u8x64)x;
  for (int l = 0; l < 16; ++l) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += static_cast<int32_t>(w[4 * l + i]) * static_cast<int8_t>(xb[4 * l + i]);
    acc[l] += s;
  }
  return acc;
}
constexpr bool kDot8Offset = true;
#if defined(__AVX512VNNI__)
using Sum4 = i16;
inline Sum4 dot4(Sum4 acc, u8x64 w, i16 x) { return (i16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x); }
inline i16 sum4(Sum4 acc) { return acc; }
inline i16 dot8(i16 acc, u8x64 w, i16 x) { return dot4(acc, w, x); }
#elif defined(__AVX512BW__)
typedef int16_t Sum4 __attribute__((vector_size(64)));
inline Sum4 dot4(Sum4 acc, u8x64 w, i16 x) { return acc + (Sum4)_mm512_maddubs_epi16((__m512i)w, (__m512i)x); }
inline i16 sum4(Sum4 acc) { return (i16)_mm512_madd_epi16((__m512i)acc, _mm512_set1_epi16(1)); }
inline i16 dot8(i16 acc, u8x64 w, i16 x) {
  const __m512i half = (__m512i)(w >> 1), odd = (__m512i)(w & 1);
  return acc + (i16)_mm512_madd_epi16(_mm512_maddubs_epi16(half, (__m512i)x), _mm512_set1_epi16(2)) +
         (i16)_mm512_madd_epi16(_mm512_maddubs_epi16(odd, (__m512i)x), _mm512_set1_epi16(1));
}
#else
using Sum4 = i16;
inline Sum4 dot4(Sum4 acc, u8x64 w, i16 x) { return dot_scalar(acc, w, x); }
inline i16 sum4(Sum4 acc) { return acc; }
inline i16 dot8(i16 acc, u8x64 w, i16 x) { return dot_scalar(acc, w, x); }
#endif
#else
template <class V>
struct Pair {
  V lo, hi;
};
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8x8 __attribute__((vector_size(32)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));
typedef uint8_t u8x32u __attribute__((vector_size(32), aligned(1)));
using v16 = Pair<f8>;
using i16 = Pair<i8x8>;
using u8x64 = Pair<u8x32>;

// Element-wise operators, half by half; a scalar operand is broadcast (as the lanes' type).
template <class S>
constexpr bool kScalar = std::is_arithmetic_v<S>;
template <class V>
using Lane = std::remove_reference_t<decltype(std::declval<V>()[0])>;
#define SF_PAIR_OP(op)                                                                            \
  template <class V>                                                                              \
  inline Pair<V> operator op(Pair<V> a, Pair<V> b) {                                              \
    return {a.lo op b.lo, a.hi op b.hi};                                                          \
  }                                                                                               \
  template <class V, class S, std::enable_if_t<kScalar<S>, int> = 0>                              \
  inline Pair<V> operator op(Pair<V> a, S s) {                                                    \
    return {a.lo op static_cast<Lane<V>>(s), a.hi op static_cast<Lane<V>>(s)};                    \
  }                                                                                               \
  template <class V, class S, std::enable_if_t<kScalar<S>, int> = 0>                              \
  inline Pair<V> operator op(S s, Pair<V> a) {                                                    \
    return {static_cast<Lane<V>>(s) op a.lo, static_cast<Lane<V>>(s) op a.hi};                    \
  }                                                                                               \
  template <class V, class T>                                                                     \
  inline Pair<V>& operator op##=(Pair<V>& a, T b) {                                               \
    return a = a op b;                                                                            \
  }
SF_PAIR_OP(+)
SF_PAIR_OP(-)
SF_PAIR_OP(*)
SF_PAIR_OP(/)
SF_PAIR_OP(&)
SF_PAIR_OP(>>)
SF_PAIR_OP(<<)
#undef SF_PAIR_OP
template <class V>
inline Pair<V> operator-(Pair<V> a) {
  return {-a.lo, -a.hi};
}

inline v16 load(const float* p) {
  return {*reinterpret_cast<const f8u*>(p), *reinterpret_cast<const f8u*>(p + 8)};
}
inline void store(float* p, v16 v) {
  *reinterpret_cast<f8u*>(p) = v.lo;
  *reinterpret_cast<f8u*>(p + 8) = v.hi;
}
inline u8x64 load_bytes(const uint8_t* p) {
  return {*reinterpret_cast<const u8x32u*>(p), *reinterpret_cast<const u8x32u*>(p + 32)};
}
inline v16 splat(float f) { return {f8{} + f, f8{} + f}; }
inline i16 splat_i(int32_t v) { return {i8x8{} + v, i8x8{} + v}; }
inline float lane(v16 v, int i) { return i < 8 ? v.lo[i] : v.hi[i - 8]; }
inline v16 vmax(v16 a, v16 b) { return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi}; }
inline v16 vmin(v16 a, v16 b) { return {a.lo < b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi}; }
inline v16 vselect_lt(v16 a, v16 b, v16 x, v16 y) {
  return {a.lo < b.lo ? x.lo : y.lo, a.hi < b.hi ? x.hi : y.hi};
}
inline i16 to_int(v16 v) { return {__builtin_convertvector(v.lo, i8x8), __builtin_convertvector(v.hi, i8x8)}; }
inline v16 to_float(i16 v) { return {__builtin_convertvector(v.lo, f8), __builtin_convertvector(v.hi, f8)}; }
inline v16 bits_to_float(i16 v) { return {(f8)v.lo, (f8)v.hi}; }
inline float hsum(v16 v) {
  f8 s = v.lo + v.hi;
  s += __builtin_shuffle(s, i8x8{4, 5, 6, 7, 0, 1, 2, 3});
  s += __builtin_shuffle(s, i8x8{2, 3, 0, 1, 6, 7, 4, 5});
  s += __builtin_shuffle(s, i8x8{1, 0, 3, 2, 5, 4, 7, 6});
  return s[0];
}
#if defined(__AVX2__)
inline f8 widen8(__m128i bytes8, bool is_signed) {  // the low 8 bytes -> 8 floats
  return (f8)_mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}
inline v16 load(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {widen8(b, true), widen8(_mm_srli_si128(b, 8), true)};
}
inline void load_nibbles(const uint8_t* p, v16& lo, v16& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), mask = _mm_set1_epi8(0x0F);
  const __m128i l = _mm_and_si128(b, mask), h = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  lo = {widen8(l, false), widen8(_mm_srli_si128(l, 8), false)};
  hi = {widen8(h, false), widen8(_mm_srli_si128(h, 8), false)};
}
// As the AVX-512 dot4/dot8 (see there), one 32-byte half at a time. Without AVX-VNNI, dot8 takes the
// sign trick (llama.cpp's AVX2 path): maddubs(|code|, x * sign(code)) = code . x, exact for every code
// (|-128| is 128 as a byte) since x is never -128, so no offset is left to subtract.
#if defined(__AVXVNNI__)
constexpr bool kDot8Offset = true;
using Sum4 = i16;
inline i8x8 dpbusd_half(i8x8 acc, u8x32 w, i8x8 x) {
  return (i8x8)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
}
inline Sum4 dot4(Sum4 acc, u8x64 w, i16 x) { return {dpbusd_half(acc.lo, w.lo, x.lo), dpbusd_half(acc.hi, w.hi, x.hi)}; }
inline i16 sum4(Sum4 acc) { return acc; }
inline i16 dot8(i16 acc, u8x64 w, i16 x) { return dot4(acc, w, x); }
#else
constexpr bool kDot8Offset = false;
typedef int16_t s16x16 __attribute__((vector_size(32)));
using Sum4 = Pair<s16x16>;
inline Sum4 dot4(Sum4 acc, u8x64 w, i16 x) {
  return {acc.lo + (s16x16)_mm256_maddubs_epi16((__m256i)w.lo, (__m256i)x.lo),
          acc.hi + (s16x16)_mm256_maddubs_epi16((__m256i)w.hi, (__m256i)x.hi)};
}
inline i8x8 widen_pairs(s16x16 v) { return (i8x8)_mm256_madd_epi16((__m256i)v, _mm256_set1_epi16(1)); }
inline i16 sum4(Sum4 acc) { return {widen_pairs(acc.lo), widen_pairs(acc.hi)}; }
inline i8x8 dot8_half(i8x8 acc, u8x32 w, i8x8 x) {
  const __m256i code = _mm256_xor_si256((__m256i)w, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(code), _mm256_sign_epi8((__m256i)x, code));
  return acc + (i8x8)_mm256_madd_epi16(prod, _mm256_set1_epi16(1));
}
inline i16 dot8(i16 acc, u8x64 w, i16 x) { return {dot8_half(acc.lo, w.lo, x.lo), dot8_half(acc.hi, w.hi, x.hi)}; }
#endif
#else  // portable: element by element
inline v16 load(const int8_t* p) {
  v16 out;
  for (int i = 0; i < 8; ++i) out.lo[i] = p[i], out.hi[i] = p[i + 8];
  return out;
}
inline void load_nibbles(const uint8_t* p, v16& lo, v16& hi) {
  for (int i = 0; i < 8; ++i) {
    lo.lo[i] = static_cast<float>(p[i] & 0x0F), lo.hi[i] = static_cast<float>(p[i + 8] & 0x0F);
    hi.lo[i] = static_cast<float>(p[i] >> 4), hi.hi[i] = static_cast<float>(p[i + 8] >> 4);
  }
}
constexpr bool kDot8Offset = true;
using Sum4 = i16;
inline i8x8 dot_half(i8x8 acc, u8x32 w, i8x8 x) {
  const u8x32 xb = (u8x32)x;
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += static_cast<int32_t>(w[4 * l + i]) * static_cast<int8_t>(xb[4 * l + i]);
    acc[l] += s;
  }
  return acc;
}
inline Sum4 dot4(Sum4 acc, u8x64 w, i16 x) { return {dot_half(acc.lo, w.lo, x.lo), dot_half(acc.hi, w.hi, x.hi)}; }
inline i16 sum4(Sum4 acc) { return acc; }
inline i16 dot8(i16 acc, u8x64 w, i16 x) { return dot4(acc, w, x); }
#endif
#if defined(__F16C__)
inline v16 load(const uint16_t* p) {
  return {(f8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          (f8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
#else
inline float half_to_float(uint16_t h) {
  const uint32_t sign = h & 0x8000u, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    f = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -f : f;
}
inline v16 load(const uint16_t* p) {
  v16 out;
  for (int i = 0; i < 8; ++i) out.lo[i] = half_to_float(p[i]), out.hi[i] = half_to_float(p[i + 8]);
  return out;
}
#endif
#endif

// ---- 5-bit codes: a nibble in the 4-bit panels plus a fifth bit from a separate plane -------------------
// The plane holds one bit per code in the order of the nibble bytes the code completes: per unit of nibble
// bytes (16 on the float path, 64 on the dot path), a little-endian mask of their low nibbles' fifth bits,
// then one of their high nibbles' (kernels/cpu_native.py: fifth_bit_plane). 4 bytes per 32 codes.
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  __builtin_memcpy(&v, p, 2);
  return v;
}
inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  __builtin_memcpy(&v, p, 8);
  return v;
}
// 16 mask bits -> 16 floats, 16.0f where the bit is set: the float path adds it to the nibble's value.
inline v16 fifth_bit_floats(uint16_t m) {
#if defined(__AVX512F__)
  return (v16)_mm512_maskz_mov_ps(m, _mm512_set1_ps(16.0f));
#else
  const i16 lanes = {i8x8{0, 1, 2, 3, 4, 5, 6, 7}, i8x8{8, 9, 10, 11, 12, 13, 14, 15}};
  return to_float(((splat_i(m) >> lanes) & 1) << 4);
#endif
}
// v + A where the mask bit is set (A = 16: a fifth bit, 32: a sixth): one masked add on AVX-512.
template <int A>
inline v16 add_where(v16 v, uint16_t m) {
#if defined(__AVX512F__)
  return (v16)_mm512_mask_add_ps((__m512)v, m, (__m512)v, _mm512_set1_ps(static_cast<float>(A)));
#else
  const v16 b = fifth_bit_floats(m);
  return A == 16 ? v + b : v + (b + b);
#endif
}
#if !defined(__AVX512F__) && defined(__AVX2__)
inline u8x32 fifth_bit_bytes32(uint32_t m) {  // byte i = 16 where bit i is set
  const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                       3, 3, 3, 3, 3, 3, 3);  // in-lane shuffle: each lane holds all 4 bytes
  const __m256i sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)), idx), sel);
  return (u8x32)_mm256_and_si256(_mm256_cmpeq_epi8(b, sel), _mm256_set1_epi8(16));
}
#endif
// 64 mask bits -> 64 bytes, 16 where the bit is set: the dot path adds it to the nibble.
inline u8x64 fifth_bit_bytes(uint64_t m) {
#if defined(__AVX512BW__)
  return (u8x64)_mm512_maskz_mov_epi8(m, _mm512_set1_epi8(16));
#elif defined(__AVX512F__)
  u8x64 out;
  for (int i = 0; i < 64; ++i) out[i] = static_cast<uint8_t>(((m >> i) & 1) << 4);
  return out;
#elif defined(__AVX2__)
  return {fifth_bit_bytes32(static_cast<uint32_t>(m)), fifth_bit_bytes32(static_cast<uint32_t>(m >> 32))};
#else
  u8x64 out;
  for (int i = 0; i < 32; ++i)
    out.lo[i] = static_cast<uint8_t>(((m >> i) & 1) << 4), out.hi[i] = static_cast<uint8_t>(((m >> (32 + i)) & 1) << 4);
  return out;
#endif
}

// exp(x) for 16 lanes: Cody-Waite range reduction and the Cephes expf polynomial (about 1 ulp).
// Inputs below -87 give ~1e-38 instead of 0, which is harmless as a softmax weight.
inline v16 vexp(v16 x) {
  x = vmin(vmax(x, splat(-87.0f)), splat(88.0f));
  const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  v16 n = (x * splat(1.44269504088896341f) + magic) - magic;
  v16 r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v16 z = r * r;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * z + r + splat(1.0f);
  return p * bits_to_float((to_int(n) + 127) << 23);
}

// tanh for 16 lanes as Cephes' tanhf computes it: an odd polynomial below |z| = 0.625, where 1 - 2 / (exp(2z) + 1)
// would lose its low bits to the subtraction, and that expression (via vexp, saturating to +-1) above it.
inline v16 vtanh(v16 z) {
  const v16 z2 = z * z;
  v16 p = splat(-5.70498872745e-3f);
  p = p * z2 + splat(2.06390887954e-2f);
  p = p * z2 + splat(-5.37397155531e-2f);
  p = p * z2 + splat(1.33314422036e-1f);
  p = p * z2 + splat(-3.33332819422e-1f);
  const v16 small = p * z2 * z + z;
  const v16 large = splat(1.0f) - splat(2.0f) / (vexp(z + z) + splat(1.0f));
  return vselect_lt(vmax(z, -z), splat(0.625f), small, large);
}

// cap * tanh(x / cap) for 16 lanes: Gemma 2's soft-capping of attention scores and final logits.
inline v16 vsoftcap(v16 x, float cap) { return splat(cap) * vtanh(x / splat(cap)); }

// x[0, n) = cap * tanh(x / cap) in place, 16 lanes at a time; the tail of n % 16 goes through a padded copy
// so that every element takes the same arithmetic.
inline void softcap_inplace(float* x, int64_t n, float cap) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store(x + i, vsoftcap(load(x + i), cap));
  if (i < n) {
    float tail[16] = {};
    std::copy(x + i, x + n, tail);
    store(tail, vsoftcap(load(tail), cap));
    std::copy(tail, tail + (n - i), x + i);
  }
}

constexpr int kPanel = 32;  // columns per packed panel: two 16-float vectors
#ifdef __AVX512F__
constexpr int kRows = 8;  // 16 accumulators + 2 weight vectors fit in 32 zmm registers
#else
constexpr int kRows = 4;
#endif

template <int R>
inline void store_tile(const v16* a0, const v16* a1, const float* scale, const float* bias, const float* res,
                       int64_t ldr, float* y, int64_t ldy, int cols);

// R rows of x against one panel: y[r, 0:cols] = (x[r] @ panel) (* scale) (+ bias) (+ residual).
template <int R, typename W>
inline void linear_tile(const float* x, int64_t ldx, int64_t K, const W* w, const float* scale,
                        const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy, int cols) {
  v16 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = splat(0.0f);
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const v16 w0 = load(w + k * kPanel), w1 = load(w + k * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      a0[r] += xv * w0;
      a1[r] += xv * w1;
    }
  }
  store_tile<R>(a0, a1, scale, bias, res, ldr, y, ldy, cols);
}

// y[r, 0:cols] = acc[r] (* scale) (+ bias) (+ residual): the end of every tile.
template <int R>
inline void store_tile(const v16* a0, const v16* a1, const float* scale, const float* bias, const float* res,
                       int64_t ldr, float* y, int64_t ldy, int cols) {
  for (int r = 0; r < R; ++r) {
    v16 b0 = a0[r], b1 = a1[r];
    if (scale) {
      b0 *= load(scale);
      b1 *= load(scale + 16);
    }
    if (bias) {
      b0 += load(bias);
      b1 += load(bias + 16);
    }
    float* yr = y + r * ldy;
    if (cols == kPanel) {
      if (res) {
        b0 += load(res + r * ldr);
        b1 += load(res + r * ldr + 16);
      }
      store(yr, b0);
      store(yr + 16, b1);
    } else {
      float tmp[kPanel];
      store(tmp, b0);
      store(tmp + 16, b1);
      for (int c = 0; c < cols; ++c) yr[c] = res ? tmp[c] + res[r * ldr + c] : tmp[c];
    }
  }
}

template <typename W, int R = kRows>
inline void linear_rows(int rows, const float* x, int64_t ldx, int64_t K, const W* w, const float* scale,
                        const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy, int cols) {
  if constexpr (R > 0) {
    if (rows == R) return linear_tile<R>(x, ldx, K, w, scale, bias, res, ldr, y, ldy, cols);
    return linear_rows<W, R - 1>(rows, x, ldx, K, w, scale, bias, res, ldr, y, ldy, cols);
  }
}

// Panels [ceil(N / 32)][K][32]; scale and bias are padded to the panels. Threads split the panels.
template <typename W>
void linear(const float* x, int64_t M, int64_t K, int64_t ldx, const W* panels, const float* scale, int64_t N,
            const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy, int threads) {
  const int64_t np = (N + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t p = 0; p < np; ++p) {
    const W* w = panels + p * K * kPanel;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    const float* s = scale ? scale + p * kPanel : nullptr;
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      linear_rows<W>(rows, x + m0 * ldx, ldx, K, w, s, b, res ? res + m0 * ldr + p * kPanel : nullptr, ldr,
                     y + m0 * ldy + p * kPanel, ldy, cols);
    }
  }
}


// ---- Per-group scales and mins of the grouped-quantized kernels ---------------------------------------
// Flat: per panel [K / G][32] float32 or IEEE halfs. TwoLevel (GGUF's K-quants, sf_two_level): per panel an
// int8 factor per group [K / G][32] and a half per 256-value super-block [K / 256][32], multiplied as they are
// read: float(d) * float(sc) is the same float32 product the reference dequantizer forms, so nothing rounds,
// and a 4-bit weight streams 4.625 bits per value instead of 6.
template <typename T>
struct Flat {
  const T* p;
  explicit operator bool() const { return p != nullptr; }
  Flat panel(int64_t i, int64_t groups) const { return {p ? p + i * groups * kPanel : nullptr}; }
  v16 at(int64_t g, int h) const { return load(p + g * kPanel + 16 * h); }
};

struct TwoLevel {
  const int8_t* sub;
  const uint16_t* super;
  int64_t per;  // groups per super-block
  explicit operator bool() const { return sub != nullptr; }
  TwoLevel panel(int64_t i, int64_t groups) const {
    return sub ? TwoLevel{sub + i * groups * kPanel, super + i * (groups / per) * kPanel, per} : *this;
  }
  v16 at(int64_t g, int h) const { return load(sub + g * kPanel + 16 * h) * load(super + g / per * kPanel + 16 * h); }
};

constexpr int64_t kSuperBlock = 256;  // values per K-quant super-block

// What the scale pointer of a scale_kind 2 weight points to (kernels/cpu_quant.py: _TwoLevel). m may be sc
// itself (Q6_K's offset -32 d sc is dmin * sc with dmin = -32 d).
struct sf_two_level {
  const int8_t* sc;  // [panels][K / G][32]
  const uint16_t* d;  // [panels][K / 256][32]
  const int8_t* m;  // [panels][K / G][32], or null
  const uint16_t* dmin;  // [panels][K / 256][32], or null
};

// Calls f(scales, mins) with the readers of scale_kind: 0 float32, 1 IEEE halfs (GGUF's own fp16 d and m), 2
// two-level (`scale` points to an sf_two_level; `mins` is non-null when the weight has offsets).
template <typename F>
void with_scales(const void* scale, const void* mins, int kind, int64_t G, F&& f) {
  if (kind == 2) {
    const auto* t = static_cast<const sf_two_level*>(scale);
    const int64_t per = kSuperBlock / G;
    return f(TwoLevel{t->sc, t->d, per}, TwoLevel{mins ? t->m : nullptr, t->dmin, per});
  }
  if (kind == 1)
    return f(Flat<uint16_t>{static_cast<const uint16_t*>(scale)}, Flat<uint16_t>{static_cast<const uint16_t*>(mins)});
  f(Flat<float>{static_cast<const float*>(scale)}, Flat<float>{static_cast<const float*>(mins)});
}

// R rows of x against one grouped-quantized panel. Q4: codes are [K / 2][32] bytes, byte (k / 2, c)
// holding column c of row k in its low nibble and of row k + 1 in its high nibble; otherwise int8
// [K][32]. HB high planes (with Q4): the nibbles are the low 4 bits of 5-bit (HB 1) or 6-bit (HB 2) codes;
// `high` holds their fifth bits, 8 bytes per 32 nibble bytes (masks of bytes 0-15's low nibbles, their high
// nibbles, then bytes 16-31's), and `high + plane` their sixth bits in the same layout.
// scales and mins per group (Flat or TwoLevel): W[k, c] = code * scale[k / G, c] (+ mins[k / G, c]).
template <int R, bool Q4, int HB, typename S>
inline void qlinear_tile(const float* x, int64_t ldx, int64_t K, const void* codes, const uint8_t* high,
                         int64_t plane, S scale, S mins, int64_t G, const float* bias, const float* res, int64_t ldr,
                         float* y, int64_t ldy, int cols) {
  v16 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = splat(0.0f);
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    const v16 s0 = scale.at(g0 / G, 0), s1 = scale.at(g0 / G, 1);
    const v16 m0 = mins ? mins.at(g0 / G, 0) : splat(0.0f), m1 = mins ? mins.at(g0 / G, 1) : splat(0.0f);
    if constexpr (Q4) {
      const uint8_t* c = static_cast<const uint8_t*>(codes) + g0 / 2 * kPanel;
      for (int64_t k = g0; k < g0 + G; k += 2, c += kPanel) {
        v16 w0, w1, v0, v1;  // w: row k, v: row k + 1; 0: columns 0-15, 1: columns 16-31
        load_nibbles(c, w0, v0);
        load_nibbles(c + 16, w1, v1);
        if constexpr (HB >= 1) {
          const uint8_t* h = high + k * 4;  // 8 plane bytes per row pair
          w0 = add_where<16>(w0, load_u16(h)), v0 = add_where<16>(v0, load_u16(h + 2));
          w1 = add_where<16>(w1, load_u16(h + 4)), v1 = add_where<16>(v1, load_u16(h + 6));
        }
        if constexpr (HB == 2) {  // the sixth bits: 32 where set
          const uint8_t* h = high + plane + k * 4;
          w0 = add_where<32>(w0, load_u16(h)), v0 = add_where<32>(v0, load_u16(h + 2));
          w1 = add_where<32>(w1, load_u16(h + 4)), v1 = add_where<32>(v1, load_u16(h + 6));
        }
        w0 = w0 * s0 + m0, w1 = w1 * s1 + m1, v0 = v0 * s0 + m0, v1 = v1 * s1 + m1;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float xa = x[r * ldx + k], xb = x[r * ldx + k + 1];
          a0[r] += xa * w0 + xb * v0;
          a1[r] += xa * w1 + xb * v1;
        }
      }
    } else {
      const int8_t* c = static_cast<const int8_t*>(codes) + g0 * kPanel;
#pragma GCC unroll 2
      for (int64_t k = g0; k < g0 + G; ++k, c += kPanel) {
        const v16 w0 = load(c) * s0 + m0, w1 = load(c + 16) * s1 + m1;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float xv = x[r * ldx + k];
          a0[r] += xv * w0;
          a1[r] += xv * w1;
        }
      }
    }
  }
  store_tile<R>(a0, a1, nullptr, bias, res, ldr, y, ldy, cols);
}

template <bool Q4, int HB, typename S, int R = kRows>
inline void qlinear_rows(int rows, const float* x, int64_t ldx, int64_t K, const void* codes, const uint8_t* high,
                         int64_t plane, S scale, S mins, int64_t G, const float* bias, const float* res, int64_t ldr,
                         float* y, int64_t ldy, int cols) {
  if constexpr (R > 0) {
    if (rows == R)
      return qlinear_tile<R, Q4, HB, S>(x, ldx, K, codes, high, plane, scale, mins, G, bias, res, ldr, y, ldy, cols);
    return qlinear_rows<Q4, HB, S, R - 1>(rows, x, ldx, K, codes, high, plane, scale, mins, G, bias, res, ldr, y,
                                          ldy, cols);
  }
}

// high: the planes of the high bits of 5- or 6-bit codes (HB of them, each K * 4 bytes per panel, the
// sixth-bit plane after the fifth-bit one), null for HB 0.
template <bool Q4, int HB, typename S>
void qlinear(const float* x, int64_t M, int64_t K, int64_t ldx, const void* codes, const uint8_t* high, S scale,
             S mins, int64_t G, int64_t N, const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy,
             int threads) {
  const int64_t np = (N + kPanel - 1) / kPanel, groups = K / G;
  const int64_t panel_bytes = Q4 ? K / 2 * kPanel : K * kPanel;
  const int64_t plane = np * K * 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t p = 0; p < np; ++p) {
    const void* c = static_cast<const uint8_t*>(codes) + p * panel_bytes;
    const uint8_t* h = HB ? high + p * K * 4 : nullptr;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    const S s = scale.panel(p, groups), mn = mins.panel(p, groups);
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
      qlinear_rows<Q4, HB, S>(rows, x + m0 * ldx, ldx, K, c, h, plane, s, mn, G, b,
                              res ? res + m0 * ldr + p * kPanel : nullptr, ldr, y + m0 * ldy + p * kPanel, ldy, cols);
    }
  }
}


// ---- int8 activations x 4-bit / 8-bit codes: integer dot products, as llama.cpp's CPU path does ----
//
// The float path above spends one FMA per 16 weights to dequantize and one more per row to accumulate;
// at one row (c=1 decode) that work, not the weight bytes, bounds the step. Here each matmul first
// quantizes every row of x in blocks of 32 to int8 with one float scale (max-abs / 127, like GGUF's
// Q8_0 / Q8_1), then multiplies 4-bit or 8-bit codes by those int8 values four at a time with one
// `vpdpbusd` (u8 x s8 -> int32, AVX512-VNNI) per 16 columns, and applies the weight's scale and the
// activation's scale once per 32-block: W*x = s * dx * sum(code * xq) + m * sum(x).
//
// Layout ("dot panels"), per 32-column panel:
//   4-bit: per 8 input rows k0..k0+7, 128 bytes = [half h: columns 16h..16h+15][column c][i in 0..3], the
//          byte holding row k0+i's code in its low nibble and row k0+4+i's in its high nibble. One 64-byte
//          load is then 16 columns x 4 rows per nibble half: exactly vpdpbusd's 16 lanes x 4 bytes.
//   5-bit: the 4-bit layout's nibbles hold the low 4 bits; a plane holds the fifth bits, per 8 input rows 32
//          bytes: the 64-bit masks of bytes 0-63's low nibbles, their high nibbles, bytes 64-127's low, high.
//   6-bit: as 5-bit, and a second plane in the same layout holds the sixth bits.
//   8-bit: per 4 input rows, 128 bytes = [h][c][i] = code(k0+i, 16h+c) + 128 (vpdpbusd's weight operand
//          is unsigned; the 128 * sum(xq) it adds is subtracted per block).
// Scales and mins: [K/G][32] per panel as for the float path; G a multiple of 32, or 16 for nibble codes
// (GGUF Q6_K's int8 scale per 16 values): then a block's two halves (its rows 0-15 and 16-31, the first and
// last two 8-row steps) keep integer sums of their own, each scaled by its group's factors, and their mins
// apply to the float sums of x's halves, as llama.cpp's Q6_K dot product sums per 16 values.
constexpr int kQBlock = 32;  // activation quantization block, as GGUF's Q8_0/Q8_1
constexpr int kDotRows = 4;  // per row 2 int32 + 2 float accumulators; 4 rows + weights fit in 32 zmm

inline i16 splat4(const int8_t* p) {  // 4 int8 -> the same 32-bit word in all 16 lanes
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return splat_i(v);
}

// Row m of x -> xq [K] int8, and per 32-block: its scale xd, the float sum xs of x and the sum xqs of xq.
// Halves: xs per 16 values instead (two per block), for weights in groups of 16.
void quantize_row(const float* x, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xqs, bool halves) {
  for (int64_t b = 0; b < K / kQBlock; ++b) {
    const float* xb = x + b * kQBlock;
    const v16 v0 = load(xb), v1 = load(xb + 16);
    const v16 amax = vmax(vmax(v0, -v0), vmax(v1, -v1));
    float mx = 0.0f;
    for (int i = 0; i < 16; ++i) mx = std::max(mx, lane(amax, i));
    const float d = mx / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t qsum = 0;
    for (int i = 0; i < kQBlock; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(xb[i] * id));
      xq[b * kQBlock + i] = static_cast<int8_t>(q);
      qsum += q;
    }
    xd[b] = d;
    if (halves)
      xs[2 * b] = hsum(v0), xs[2 * b + 1] = hsum(v1);
    else
      xs[b] = hsum(v0 + v1);
    xqs[b] = qsum;
  }
}

struct QuantizedRows {
  const int8_t* xq;  // [M][K]
  const float* xd;   // [M][K / 32] scales
  const float* xs;   // [M][K / 32] float sums of x (for the mins), [M][K / 16] for groups of 16
  const int32_t* xqs;  // [M][K / 32] sums of xq (for the 8-bit codes' +128)
};

// maddubs (AVX512BW, AVX2) sums into int16 lanes: 5-bit pairs reach 31 * 127 * 2 = 7874, so a block's 8
// steps (62992) would overflow; 5- and 6-bit codes widen after each 8 rows (2 steps: 15748, and 32004 for
// 6-bit pairs of 63 * 127 * 2) instead of once per block.
constexpr bool kSum4Narrow = !std::is_same_v<Sum4, i16>;

// Integer sums of R rows against the 8-row steps j0..j1-1 of one 32-block of nibble codes: `c` the block's
// codes, `h` its fifth-bit plane (and h + plane its sixth bits), `xq` the rows' int8 values from the block's
// start; i0 gets columns 0-15, i1 columns 16-31.
template <int R, int HB>
inline void nibble_sums(const int8_t* xq, int64_t K, const uint8_t* c, const uint8_t* h, int64_t plane, int j0,
                        int j1, i16* i0, i16* i1) {
  Sum4 p0[R], p1[R];
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = Sum4{}, i0[r] = i1[r] = i16{};
#pragma GCC unroll 4
  for (int j = j0; j < j1; ++j) {
    const u8x64 raw0 = load_bytes(c + j * 128), raw1 = load_bytes(c + j * 128 + 64);
    u8x64 lo0 = raw0 & 0x0F, hi0 = raw0 >> 4, lo1 = raw1 & 0x0F, hi1 = raw1 >> 4;
    if constexpr (HB >= 1) {
      const uint8_t* f = h + j * 32;
      lo0 += fifth_bit_bytes(load_u64(f)), hi0 += fifth_bit_bytes(load_u64(f + 8));
      lo1 += fifth_bit_bytes(load_u64(f + 16)), hi1 += fifth_bit_bytes(load_u64(f + 24));
    }
    if constexpr (HB == 2) {  // the sixth bits: 32 where set
      const uint8_t* f = h + plane + j * 32;
      const u8x64 b0 = fifth_bit_bytes(load_u64(f)), c0 = fifth_bit_bytes(load_u64(f + 8));
      const u8x64 b1 = fifth_bit_bytes(load_u64(f + 16)), c1 = fifth_bit_bytes(load_u64(f + 24));
      lo0 += b0 + b0, hi0 += c0 + c0, lo1 += b1 + b1, hi1 += c1 + c1;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * K + j * 8;
      const i16 xa = splat4(xr), xb = splat4(xr + 4);
      p0[r] = dot4(dot4(p0[r], lo0, xa), hi0, xb);
      p1[r] = dot4(dot4(p1[r], lo1, xa), hi1, xb);
    }
    if constexpr (HB >= 1 && kSum4Narrow) {
      for (int r = 0; r < R; ++r) i0[r] += sum4(p0[r]), i1[r] += sum4(p1[r]), p0[r] = p1[r] = Sum4{};
    }
  }
  for (int r = 0; r < R; ++r) i0[r] += sum4(p0[r]), i1[r] += sum4(p1[r]);
}

// The same for one 32-block of 8-bit codes (8 steps of 4 rows), net of the +128 the codes are stored with.
template <int R>
inline void byte_sums(QuantizedRows x, int64_t K, int64_t nb, int64_t b, const uint8_t* c, i16* i0, i16* i1) {
  for (int r = 0; r < R; ++r) i0[r] = i1[r] = i16{};
#pragma GCC unroll 8
  for (int j = 0; j < kQBlock / 4; ++j, c += 128) {
    const u8x64 w0 = load_bytes(c), w1 = load_bytes(c + 64);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const i16 xa = splat4(x.xq + r * K + b * kQBlock + j * 4);
      i0[r] = dot8(i0[r], w0, xa);
      i1[r] = dot8(i1[r], w1, xa);
    }
  }
  if constexpr (kDot8Offset) {
    for (int r = 0; r < R; ++r) {
      const int32_t off = 128 * x.xqs[r * nb + b];
      i0[r] -= off;
      i1[r] -= off;
    }
  }
}

// Parts: groups per 32-block, 1 (G a multiple of 32) or 2 (G 16, nibble codes only: each half of the block
// is summed and scaled on its own).
template <int R, bool Q4, int HB, int Parts, typename S>
inline void dot_tile(QuantizedRows x, int64_t K, const uint8_t* codes, const uint8_t* high, int64_t plane, S scale,
                     S mins, int64_t G, const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy,
                     int cols) {
  static_assert(Parts == 1 || (Parts == 2 && Q4), "groups of 16 take nibble codes");
  constexpr int kSteps = Q4 ? kQBlock / 8 : kQBlock / 4;  // 128-byte steps per block
  const int64_t nb = K / kQBlock, per_group = Parts == 1 ? G / kQBlock : 1;
  v16 a0[R], a1[R], s0{}, s1{}, m0{}, m1{};
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = splat(0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    for (int part = 0; part < Parts; ++part) {
      if (Parts == 2 || b % per_group == 0) {
        const int64_t g = Parts == 2 ? 2 * b + part : b / per_group;
        s0 = scale.at(g, 0), s1 = scale.at(g, 1);
        if (mins) m0 = mins.at(g, 0), m1 = mins.at(g, 1);
      }
      i16 i0[R], i1[R];
      if constexpr (Q4)
        nibble_sums<R, HB>(x.xq + b * kQBlock, K, codes + b * kSteps * 128, HB ? high + b * kSteps * 32 : nullptr,
                           plane, part * kSteps / Parts, (part + 1) * kSteps / Parts, i0, i1);
      else
        byte_sums<R>(x, K, nb, b, codes + b * kSteps * 128, i0, i1);
      for (int r = 0; r < R; ++r) {
        const float d = x.xd[r * nb + b];
        a0[r] += to_float(i0[r]) * (s0 * d);
        a1[r] += to_float(i1[r]) * (s1 * d);
        if (mins) {
          const float sx = x.xs[(r * nb + b) * Parts + part];
          a0[r] += m0 * sx;
          a1[r] += m1 * sx;
        }
      }
    }
  }
  store_tile<R>(a0, a1, nullptr, bias, res, ldr, y, ldy, cols);
}

template <bool Q4, int HB, int Parts, typename S, int R = kDotRows>
inline void dot_rows(int rows, QuantizedRows x, int64_t K, const uint8_t* codes, const uint8_t* high, int64_t plane,
                     S scale, S mins, int64_t G, const float* bias, const float* res, int64_t ldr, float* y,
                     int64_t ldy, int cols) {
  if constexpr (R > 0) {
    if (rows == R)
      return dot_tile<R, Q4, HB, Parts, S>(x, K, codes, high, plane, scale, mins, G, bias, res, ldr, y, ldy, cols);
    return dot_rows<Q4, HB, Parts, S, R - 1>(rows, x, K, codes, high, plane, scale, mins, G, bias, res, ldr, y, ldy,
                                             cols);
  }
}

template <bool Q4, int HB, int Parts, typename S>
void dot_linear(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes, const uint8_t* high,
                S scale, S mins, int64_t G, int64_t N, const float* bias, const float* res, int64_t ldr, float* y,
                int64_t ldy, int threads) {
  // Scratch for the quantized rows, reused across calls (the engine calls from one thread at a time).
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  thread_local std::vector<int32_t> xqs;
  const int64_t nb = K / kQBlock;
  xq.resize(M * K);
  xd.resize(M * nb);
  xs.resize(M * nb * Parts);
  xqs.resize(M * nb);
  // Plain pointers into the scratch: inside the parallel region each thread would see its own (empty)
  // thread_local vectors.
  int8_t* q = xq.data();
  float *d = xd.data(), *sum = xs.data();
  int32_t* qsum = xqs.data();
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * ldx, K, q + m * K, d + m * nb, sum + m * nb * Parts, qsum + m * nb, Parts == 2);
  const int64_t np = (N + kPanel - 1) / kPanel, groups = K / G;
  const int64_t panel_bytes = Q4 ? K / 2 * kPanel : K * kPanel;
  const int64_t plane = np * K * 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t p = 0; p < np; ++p) {
    const uint8_t* c = codes + p * panel_bytes;
    const uint8_t* h = HB ? high + p * K * 4 : nullptr;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    const S s = scale.panel(p, groups), mn = mins.panel(p, groups);
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kDotRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kDotRows, M - m0));
      const QuantizedRows xr{q + m0 * K, d + m0 * nb, sum + m0 * nb * Parts, qsum + m0 * nb};
      dot_rows<Q4, HB, Parts, S>(rows, xr, K, c, h, plane, s, mn, G, b, res ? res + m0 * ldr + p * kPanel : nullptr,
                                 ldr, y + m0 * ldy + p * kPanel, ldy, cols);
    }
  }
}

// Dispatch on the code width (4, 5, 6: nibbles and 0-2 planes of high bits; 8: int8 codes) for the float
// path (qlinear) or the int8-activation path (dot_linear).
template <bool Dot, typename S>
void grouped(const float* x, int64_t M, int64_t K, int64_t ldx, int bits, const void* codes, const uint8_t* high,
             S s, S m, int64_t G, int64_t N, const float* bias, const float* res, int64_t ldr, float* y,
             int64_t ldy, int threads) {
  const auto* c = static_cast<const uint8_t*>(codes);
  if constexpr (Dot) {
    if (G == 16) {  // Q6_K's groups (and parts widened to its 6-bit codes): two per 32-block
      if (bits == 6) return dot_linear<true, 2, 2>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
      if (bits == 5) return dot_linear<true, 1, 2>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
      return dot_linear<true, 0, 2>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
    }
    if (bits == 6) return dot_linear<true, 2, 1>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
    if (bits == 5) return dot_linear<true, 1, 1>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
    if (bits == 4) return dot_linear<true, 0, 1>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
    dot_linear<false, 0, 1>(x, M, K, ldx, c, nullptr, s, m, G, N, bias, res, ldr, y, ldy, threads);
  } else {
    if (bits == 6) return qlinear<true, 2>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
    if (bits == 5) return qlinear<true, 1>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
    if (bits == 4) return qlinear<true, 0>(x, M, K, ldx, c, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
    qlinear<false, 0>(x, M, K, ldx, c, nullptr, s, m, G, N, bias, res, ldr, y, ldy, threads);
  }
}

// sf_paged_attention_f32 below, and the sliding-window and soft-capped attention of Gemma's layers in
// sf_decode_layers: with window > 0 the query at position p sees keys p - window < j <= p only, and the
// blocks wholly before its sequence's first visible key are never read (a sliding pool's table holds the
// null block there, engine/block_manager.py); with softcap > 0 each scaled score s becomes
// softcap * tanh(s / softcap) before the softmax (Gemma 2), as attention/sliding_window.py computes it.
void paged_attention(const float* q, int64_t ldq, const float* k_cache, const float* v_cache,
                     const int32_t* block_tables, int64_t bt_stride, const int32_t* seqs, int64_t nseqs,
                     const int32_t* query_start, const int32_t* seq_lens, int64_t H, int64_t KVH, int64_t D,
                     int64_t BS, float scale, int64_t window, float softcap, float* out, int threads) {
  const int64_t G = H / KVH, DV = D / 16;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> qbuf, acc, mx, den, s(BS + 16);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nseqs * KVH; ++item) {
      const int64_t b = seqs[item / KVH], h = item % KVH;
      const int64_t q0 = query_start[b], qlen = query_start[b + 1] - q0, slen = seq_lens[b];
      const int64_t R = G * qlen;  // row r: query token r / G, head h * G + r % G
      qbuf.resize(R * D);
      acc.assign(R * D, 0.0f);
      mx.assign(R, -INFINITY);
      den.assign(R, 0.0f);
      for (int64_t r = 0; r < R; ++r) {
        const float* src = q + (q0 + r / G) * ldq + (h * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * scale;
      }
      const int32_t* table = block_tables + b * bt_stride;
      const int64_t first = window > 0 ? std::max<int64_t>(0, slen - qlen + 1 - window) : 0;
      for (int64_t j = first / BS; j * BS < slen; ++j) {
        const int64_t block = table[j], ntok = std::min(BS, slen - j * BS);
        const float* kb = k_cache + (block * BS * KVH + h) * D;
        const float* vb = v_cache + (block * BS * KVH + h) * D;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t pos = slen - qlen + r / G;  // this row's position: it sees keys 0 ..= pos
          const int64_t vis = std::min(ntok, pos - j * BS + 1);
          const int64_t from = window > 0 ? std::max<int64_t>(0, pos - window + 1 - j * BS) : 0;
          if (vis <= from) continue;
          const float* qr = qbuf.data() + r * D;
          for (int64_t t = from; t < vis; ++t) {
            const float* kt = kb + t * KVH * D;
            v16 a = load(qr) * load(kt);
            for (int64_t c = 1; c < DV; ++c) a += load(qr + 16 * c) * load(kt + 16 * c);
            s[t] = hsum(a);
          }
          // the block's scores capped 16 at a time: a scalar std::tanh per score took ~0.9 of the ~20 CPU ms
          // of a c32 decode step's layers (hidden 512, 8 layers, one thread)
          if (softcap > 0.0f) softcap_inplace(s.data() + from, vis - from, softcap);
          float m_blk = -INFINITY;
          for (int64_t t = from; t < vis; ++t) m_blk = std::max(m_blk, s[t]);
          const float m_new = std::max(mx[r], m_blk);
          const float corr = std::exp(mx[r] - m_new);  // exp(-inf) = 0 on the first block
          mx[r] = m_new;
          float* ar = acc.data() + r * D;
          float l = den[r] * corr;
          for (int64_t c = 0; c < DV; ++c) store(ar + 16 * c, load(ar + 16 * c) * corr);
          for (int64_t t = from; t < vis; t += 16) {
            const v16 p = vexp(load(s.data() + t) - m_new);
            const int64_t n = std::min<int64_t>(16, vis - t);
            for (int64_t u = 0; u < n; ++u) {
              const float pu = lane(p, u);
              l += pu;
              const float* vt = vb + (t + u) * KVH * D;
              for (int64_t c = 0; c < DV; ++c) store(ar + 16 * c, load(ar + 16 * c) + pu * load(vt + 16 * c));
            }
          }
          den[r] = l;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float* dst = out + ((q0 + r / G) * H + h * G + r % G) * D;
        const float inv = 1.0f / den[r];
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
      }
    }
  }
}

}  // namespace

extern "C" {

int sf_abi_version() { return 12; }

// y [M, N] (ldy) = x [M, K] (ldx) @ W (+ bias) (+ res [M, N] (ldr)); W packed as panels (see linear).
void sf_linear_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* panels, int64_t N,
                   const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy, int threads) {
  linear(x, M, K, ldx, panels, nullptr, N, bias, res, ldr, y, ldy, threads);
}

// As sf_linear_f32 over int8 panels: W[k, n] = panels[k, n] * scale[n].
void sf_linear_i8(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* panels, const float* scale,
                  int64_t N, const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy, int threads) {
  linear(x, M, K, ldx, panels, scale, N, bias, res, ldr, y, ldy, threads);
}

// As sf_linear_f32 over 4-, 5- or 6-bit codes (`bits`) in groups of G input rows (G even, K a multiple of G):
// W[k, n] = code[k, n] * scale[k / G, n] + mins[k / G, n]; layout in qlinear_tile. 5- and 6-bit codes: the
// nibbles are their low 4 bits and `high` their planes of high bits (null for 4-bit). scale_kind: how scale
// and mins are stored (with_scales): float32, IEEE halfs (GGUF's own fp16 d and m: a bit per weight less to
// stream), or two-level (GGUF's K-quants).
void sf_linear_q4(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* codes, const uint8_t* high,
                  int bits, const void* scale, const void* mins, int scale_kind, int64_t G, int64_t N,
                  const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy, int threads) {
  with_scales(scale, mins, scale_kind, G, [&](auto s, auto m) {
    grouped<false>(x, M, K, ldx, bits, codes, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
  });
}

// The same over int8 codes (GGUF Q8_0): W[k, n] = code[k, n] * scale[k / G, n] (+ mins[k / G, n]).
void sf_linear_q8g(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* codes, const void* scale,
                   const void* mins, int scale_kind, int64_t G, int64_t N, const float* bias, const float* res,
                   int64_t ldr, float* y, int64_t ldy, int threads) {
  with_scales(scale, mins, scale_kind, G, [&](auto s, auto m) {
    grouped<false>(x, M, K, ldx, 8, codes, nullptr, s, m, G, N, bias, res, ldr, y, ldy, threads);
  });
}

// As sf_linear_q4 / sf_linear_q8g with x quantized to int8 per 32-block first (see dot_linear): codes in
// the dot panels' layout, K a multiple of 32, G a multiple of 32 or (bits 4-6) 16. bits 4-6: nibble codes
// (5- and 6-bit with the planes `high`); 8: 8-bit codes stored + 128.
void sf_linear_qdot(const float* x, int64_t M, int64_t K, int64_t ldx, int bits, const uint8_t* codes,
                    const uint8_t* high, const void* scale, const void* mins, int scale_kind, int64_t G, int64_t N,
                    const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy, int threads) {
  with_scales(scale, mins, scale_kind, G, [&](auto s, auto m) {
    grouped<true>(x, M, K, ldx, bits, codes, high, s, m, G, N, bias, res, ldr, y, ldy, threads);
  });
}

// x [n] = cap * tanh(x / cap) in place: Gemma 2's final logit soft-cap over a step's [rows, vocab] logits, one
// pass across the threads (torch's divide, tanh and multiply made three passes and two 6 MB temporaries at
// c32 x 49k: ~5 CPU ms a step at hidden 512 on one thread, this pass ~1).
void sf_softcap_f32(float* x, int64_t n, float cap, int threads) {
  const int64_t chunk = 4096;  // 16 KiB of floats per task: fits L1, and a 49k-vocab row is 12 tasks
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 4 * chunk)
  for (int64_t i = 0; i < n; i += chunk) softcap_inplace(x + i, std::min(chunk, n - i), cap);
}

// Which instructions the integer dot products (dot4/dot8 above) compiled to, for logs and benchmarks.
const char* sf_dot_backend() {
#if defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(__AVX512BW__)
  return "avx512bw";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

// y [M, D] = x * rsqrt(mean(x^2) + eps) * w, the order transformers' RMSNorm uses.
void sf_rms_norm_f32(const float* x, int64_t M, int64_t D, const float* w, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    int64_t d = 0;
    v16 acc = splat(0.0f);
    for (; d + 16 <= D; d += 16) {
      const v16 v = load(xr + d);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; d < D; ++d) ss += xr[d] * xr[d];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (d = 0; d + 16 <= D; d += 16) store(yr + d, (load(xr + d) * inv) * load(w + d));
    for (; d < D; ++d) yr[d] = (xr[d] * inv) * w[d];
  }
}

// gate_up [M, 2I] -> y [M, I] = silu(gate) * up.
void sf_silu_mul_f32(const float* gate_up, int64_t M, int64_t I, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gate_up + m * 2 * I;
    const float* u = g + I;
    float* yr = y + m * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
      const v16 gv = load(g + i);
      store(yr + i, gv / (splat(1.0f) + vexp(-gv)) * load(u + i));
    }
    for (; i < I; ++i) yr[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

// Causal attention for the sequences listed in `seqs` over the paged cache, read in place.
// q, out: [tokens, H, D] rows (q row stride ldq); caches: [blocks, BS, KVH, D];
// sequence b owns rows query_start[b] .. query_start[b + 1], the last tokens of its seq_lens[b].
// D must be a multiple of 16 (checked by the caller).
void sf_paged_attention_f32(const float* q, int64_t ldq, const float* k_cache, const float* v_cache,
                            const int32_t* block_tables, int64_t bt_stride, const int32_t* seqs, int64_t nseqs,
                            const int32_t* query_start, const int32_t* seq_lens, int64_t H, int64_t KVH,
                            int64_t D, int64_t BS, float scale, float* out, int threads) {
  paged_attention(q, ldq, k_cache, v_cache, block_tables, bt_stride, seqs, nseqs, query_start, seq_lens, H, KVH, D,
                  BS, scale, 0, 0.0f, out, threads);
}

// ---- The decoder layers of a decode step in one call -------------------------------------------------
//
// A decode step at low batch is a few microseconds of math per op and 30 layers x ~16 ops; called from
// Python one op at a time, the calls cost as much as the math. sf_decode_layers runs every layer of
// steps whose queries are all short (decode, speculative verification) from descriptors built once:
// the same kernels as the per-op path (the same linears, rms_norm, silu_mul and paged attention), and
// rotary and the KV write as LlamaLayer.forward does them in torch (x * cos rounded, then
// roll(x, D/2) * sin added with one rounding, as torch's addcmul does with its fused multiply-add), so the
// two paths agree bit for bit (a mixture-of-experts layer's routing weights excepted: its softmax is
// std::exp, not torch's vectorised exp, so they may differ in the last bit).
struct sf_linear_desc {
  int32_t kind;  // 0 float32 panels, 1 int8 panels, 2 4-6-bit float-act, 3 8-bit float-act, 4 int8-act dot
  int32_t bits;  // kinds 2 and 4: the code width (4, 5, 6; 8 for kind 4's int8 codes)
  int32_t scale_kind;  // kinds 2-4: scales/mins float32 (0), IEEE halfs (1) or two-level (2, sf_two_level)
  int32_t reserved;
  const void* codes;  // panels (kinds 0-1) or codes
  const void* scale;  // kind 1: per-column scale; kinds 2-4: per-group scales
  const void* mins;  // kinds 2-4: per-group mins or null
  const uint8_t* high;  // kinds 2 and 4 (nibbles): the high-bit planes of 5- and 6-bit codes, or null
  const float* bias;  // padded to the panels, or null
  int64_t K, N, G;
};

struct sf_layer_desc {
  sf_linear_desc qkv, o, gate_up, down;
  const float* input_norm;
  const float* post_norm;
  float* k_cache;  // [blocks, BS, KVH, D]
  float* v_cache;
  const float* q_norm;  // [D]: RMSNorm of each q head before rotary (Qwen3), or null
  const float* k_norm;  // [D]: the same for each k head; set together with q_norm
  // Gemma's layer (engine/models/gemma.py), all null or 0 for Llama's. With pre_ff_norm set, post_norm
  // normalizes the attention's output before its residual add, pre_ff_norm the MLP's input and post_ff_norm
  // the MLP's output before its residual add.
  const float* pre_ff_norm;
  const float* post_ff_norm;
  const float* cos;  // this layer's rotary tables [max_position, D] (Gemma's local and global bases), or null
  const float* sin;
  int32_t gelu;  // 1: GeGLU, tanh-approximated GELU of the gate times up, instead of SiLU
  int32_t sliding;  // 1: KV slots and block tables from the step's sliding view (the window's own pool)
  int64_t window;  // > 0: a query sees the last `window` keys only
  float softcap;  // > 0: attention scores soft-capped (Gemma 2)
  float reserved;
  // A mixture-of-experts layer (engine/models/moe.py), null for a dense MLP: `experts` [num_experts][2] (each
  // expert's gate_up and down), `router` the float32 [hidden -> num_experts] gate. The MLP then runs as
  // MoeLayer.mlp's per-layer path does: router logits, softmax, top k (renormalised when `renormalize`), each
  // expert over its routed rows in expert order, its output times the routing weight summed into zeros, then
  // added to x.
  const sf_linear_desc* experts;
  sf_linear_desc router;
  int64_t num_experts, top_k;
  int32_t renormalize;
  int32_t reserved2;
};

struct sf_model_desc {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
  float eps, scale;
};

// A step's LoRA adapters (kernels/cpu/lora.cpp, kernels/cpu_lora.py): each projection adds its adapters'
// deltas right after its linear, as LlamaLayer.forward's per-layer path does with the same kernel.
struct sf_lora_weights;
void sf_lora_add_f32(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t G, const int64_t* group_start,
                     const int64_t* rows, const sf_lora_weights* const* w, int threads);
struct sf_lora_step {
  int64_t groups;
  const int64_t* group_start;  // [groups + 1]
  const int64_t* rows;  // [group_start[groups]]: each group's rows of the step
  const sf_lora_weights* const* weights;  // [layers, 4 (qkv, o, gate_up, down), groups], null: untouched
};

}  // extern "C"

namespace {

void run_linear(const sf_linear_desc& L, const float* x, int64_t M, int64_t ldx, const float* res, int64_t ldr,
                float* y, int64_t ldy, int threads) {
  switch (L.kind) {
    case 0:
      return linear(x, M, L.K, ldx, static_cast<const float*>(L.codes), nullptr, L.N, L.bias, res, ldr, y, ldy,
                    threads);
    case 1:
      return linear(x, M, L.K, ldx, static_cast<const int8_t*>(L.codes), static_cast<const float*>(L.scale), L.N,
                    L.bias, res, ldr, y, ldy, threads);
    case 2:
      return sf_linear_q4(x, M, L.K, ldx, static_cast<const uint8_t*>(L.codes), L.high, L.bits, L.scale, L.mins,
                          L.scale_kind, L.G, L.N, L.bias, res, ldr, y, ldy, threads);
    case 3:
      return sf_linear_q8g(x, M, L.K, ldx, static_cast<const int8_t*>(L.codes), L.scale, L.mins, L.scale_kind,
                           L.G, L.N, L.bias, res, ldr, y, ldy, threads);
    default:
      return sf_linear_qdot(x, M, L.K, ldx, L.bits, static_cast<const uint8_t*>(L.codes), L.high, L.scale, L.mins,
                            L.scale_kind, L.G, L.N, L.bias, res, ldr, y, ldy, threads);
  }
}

// gate_up [M, 2I] -> y [M, I] = gelu_tanh(gate) * up, as torch's F.gelu(approximate="tanh"):
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) as 1 - 2 / (exp(2z) + 1).
void gelu_tanh_mul(const float* gate_up, int64_t M, int64_t I, float* y) {
  const float beta = 0.7978845608028654f, kappa = 0.044715f;
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gate_up + m * 2 * I;
    const float* u = g + I;
    float* yr = y + m * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
      const v16 gv = load(g + i);
      const v16 z = splat(beta) * (gv + splat(kappa) * gv * gv * gv);
      const v16 th = splat(1.0f) - splat(2.0f) / (vexp(z + z) + splat(1.0f));
      store(yr + i, splat(0.5f) * gv * (splat(1.0f) + th) * load(u + i));
    }
    for (; i < I; ++i) {
      const float z = beta * (g[i] + kappa * g[i] * g[i] * g[i]);
      yr[i] = 0.5f * g[i] * (1.0f + std::tanh(z)) * u[i];
    }
  }
}

// x [M, D] += rms_norm(y, w): Gemma's post-norm of a sub-layer's output, then its residual add; `tmp` [M, D].
void add_normed(float* x, const float* y, int64_t M, int64_t D, const float* w, float eps, float* tmp) {
  sf_rms_norm_f32(y, M, D, w, eps, tmp);
  for (int64_t i = 0; i < M * D; ++i) x[i] += tmp[i];
}

// Rotary on `heads` heads of D values starting at row (stride ld): v = v * cos + roll(v, D/2) * sin.
void rotate(float* rows, int64_t T, int64_t ld, int64_t heads, int64_t D, const int64_t* positions,
            const float* cos, const float* sin) {
  std::vector<float> tmp(D);
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + positions[t] * D;
    const float* s = sin + positions[t] * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = rows + t * ld + h * D;
      std::copy(v, v + D, tmp.begin());
      for (int64_t d = 0; d < D; ++d) {
        const float a = tmp[d] * c[d];
        v[d] = std::fma(tmp[(d + half) % D], s[d], a);
      }
    }
  }
}

// x [T, H] += sum over k of w[t, k] * expert[ids[t, k]](h[t]) for a layer with `experts` (sf_layer_desc).
void routed_experts(const sf_layer_desc& L, const float* h, float* x, int64_t T, int64_t H, int threads) {
  const int64_t E = L.num_experts, K = L.top_k;
  thread_local std::vector<float> logits, w, out, rows_in, gu, act, y;
  thread_local std::vector<int64_t> ids, rows;
  thread_local std::vector<float> scale;
  logits.resize(T * E);
  run_linear(L.router, h, T, H, nullptr, 0, logits.data(), E, threads);
  w.resize(T * K);
  ids.resize(T * K);
  for (int64_t t = 0; t < T; ++t) {  // softmax in float32, then the top k (the lower id on a tie)
    float* l = logits.data() + t * E;
    float mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (l[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) l[e] /= sum;
    float picked = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken = taken || ids[t * K + j] == e;
        if (!taken && (best < 0 || l[e] > l[best])) best = e;
      }
      ids[t * K + k] = best;
      w[t * K + k] = l[best];
      picked += l[best];
    }
    if (L.renormalize != 0)
      for (int64_t k = 0; k < K; ++k) w[t * K + k] /= picked;
  }
  // The (token, slot) pairs grouped by expert, tokens ascending within each (a stable sort by expert).
  std::vector<int64_t> first(E + 1, 0);
  for (int64_t i = 0; i < T * K; ++i) ++first[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
  rows.resize(T * K);
  scale.resize(T * K);
  rows_in.resize(T * K * H);
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  int64_t I = 0;
  bool panels = true;  // float32 or int8 panels: `linear`, which keeps no state between calls
  for (int64_t e = 0; e < E; ++e) {
    I = std::max(I, L.experts[2 * e + 1].K);
    panels = panels && L.experts[2 * e].kind <= 1 && L.experts[2 * e + 1].kind <= 1;
  }
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t j = next[ids[i]]++;
    rows[j] = i / K;
    scale[j] = w[i];
    std::copy(h + rows[j] * H, h + (rows[j] + 1) * H, rows_in.data() + j * H);
  }
  gu.resize(T * K * 2 * I);
  act.resize(T * K * I);
  y.resize(T * K * H);
  // plain pointers: inside the parallel region a thread_local's name is that thread's own (empty) vector
  float *gu_p = gu.data(), *act_p = act.data(), *y_p = y.data();
  const float* in_p = rows_in.data();
  const int64_t* first_p = first.data();
  auto expert = [&](int64_t e, int inner) {
    const int64_t n = first_p[e + 1] - first_p[e], j = first_p[e];
    if (n == 0) return;
    const sf_linear_desc& G = L.experts[2 * e];
    const sf_linear_desc& D = L.experts[2 * e + 1];
    float* g = gu_p + j * 2 * I;
    float* a = act_p + j * I;
    run_linear(G, in_p + j * H, n, H, nullptr, 0, g, 2 * D.K, inner);
    sf_silu_mul_f32(g, n, D.K, a);
    run_linear(D, a, n, D.K, nullptr, 0, y_p + j * H, H, inner);
  };
  if (panels && threads > 1) {
    // Each expert on one thread: a decode step's experts are a few rows each, and one parallel region per
    // layer instead of two per expert spares the fork and join that a loaded host turns into waits for a
    // descheduled thread. Each output column is the same kernel's whatever the thread count.
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t e = 0; e < E; ++e) expert(e, 1);
  } else {
    for (int64_t e = 0; e < E; ++e) expert(e, threads);
  }
  out.assign(T * H, 0.0f);
  for (int64_t j = 0; j < T * K; ++j) {  // in expert order, as MoeLayer.mlp's index_add_ per expert
    float* o = out.data() + rows[j] * H;
    const float* yr = y.data() + j * H;
    for (int64_t c = 0; c < H; ++c) {
      const volatile float p = yr[c] * scale[j];  // rounded before the add, as torch's two ops
      o[c] += p;
    }
  }
  for (int64_t i = 0; i < T * H; ++i) x[i] += out[i];
}

}  // namespace

extern "C" {

// Every layer over x [T, hidden] (updated in place) for a step whose sequences `seqs` all have short
// queries: positions [T] (int64), cos/sin [max_position, D] (sin sign-folded, engine/models/llama.py),
// slots [T] (int64, < 0: a padding row, not written), block_tables/query_start/seq_lens as for
// sf_paged_attention_f32. sliding_slots/sliding_tables: the same step's slots and tables in the sliding
// layers' own pool, which the layers marked `sliding` read and write (null: those layers use slots and
// block_tables too).
void sf_decode_layers(const sf_model_desc* m, const sf_layer_desc* layers, int64_t num_layers, float* x,
                      int64_t T, const int64_t* positions, const float* cos, const float* sin, const int64_t* slots,
                      const int32_t* block_tables, int64_t bt_stride, const int32_t* seqs, int64_t nseqs,
                      const int32_t* query_start, const int32_t* seq_lens, const int64_t* sliding_slots,
                      const int32_t* sliding_tables, int64_t sliding_stride, int threads, const sf_lora_step* lora) {
  const int64_t H = m->hidden, NH = m->heads, KVH = m->kv_heads, D = m->head_dim;
  const int64_t qkv_w = (NH + 2 * KVH) * D;
  int64_t I = m->intermediate;  // the widest dense MLP (Qwen3-MoE's dense layers may come after a sparse one)
  for (int64_t l = 0; l < num_layers; ++l)
    if (layers[l].experts == nullptr) I = std::max(I, layers[l].down.K);
  thread_local std::vector<float> h, y, qkv, att, gu, act;
  h.resize(T * H);
  qkv.resize(T * qkv_w);
  att.resize(T * NH * D);
  gu.resize(T * 2 * I);
  act.resize(T * I);
  // y += the step's adapters' deltas of projection p (0 qkv, 1 o, 2 gate_up, 3 down) of layer l
  auto adapt = [&](int64_t l, int p, const float* in, int64_t ldin, float* out, int64_t ldout) {
    if (lora == nullptr) return;
    sf_lora_add_f32(in, ldin, out, ldout, lora->groups, lora->group_start, lora->rows,
                    lora->weights + (l * 4 + p) * lora->groups, threads);
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    const sf_layer_desc& L = layers[l];
    const bool own_pool = L.sliding != 0 && sliding_slots != nullptr;
    const int64_t* layer_slots = own_pool ? sliding_slots : slots;
    const int32_t* tables = own_pool ? sliding_tables : block_tables;
    const int64_t stride = own_pool ? sliding_stride : bt_stride;
    const bool gemma = L.pre_ff_norm != nullptr;  // post-norms around attention and the MLP
    sf_rms_norm_f32(x, T, H, L.input_norm, m->eps, h.data());
    run_linear(L.qkv, h.data(), T, H, nullptr, 0, qkv.data(), qkv_w, threads);
    adapt(l, 0, h.data(), H, qkv.data(), qkv_w);
    if (L.q_norm != nullptr) {  // in place, row by row: the kernel reads a row whole before writing it
      for (int64_t t = 0; t < T; ++t) {
        float* row = qkv.data() + t * qkv_w;
        sf_rms_norm_f32(row, NH, D, L.q_norm, m->eps, row);
        sf_rms_norm_f32(row + NH * D, KVH, D, L.k_norm, m->eps, row + NH * D);
      }
    }
    rotate(qkv.data(), T, qkv_w, NH + KVH, D, positions, L.cos != nullptr ? L.cos : cos,
           L.sin != nullptr ? L.sin : sin);
    for (int64_t t = 0; t < T; ++t) {
      if (layer_slots[t] < 0) continue;
      const float* k = qkv.data() + t * qkv_w + NH * D;
      std::copy(k, k + KVH * D, L.k_cache + layer_slots[t] * KVH * D);
      std::copy(k + KVH * D, k + 2 * KVH * D, L.v_cache + layer_slots[t] * KVH * D);
    }
    paged_attention(qkv.data(), qkv_w, L.k_cache, L.v_cache, tables, stride, seqs, nseqs, query_start, seq_lens, NH,
                    KVH, D, m->block_size, m->scale, L.window, L.softcap, att.data(), threads);
    if (gemma) {
      y.resize(T * H);
      run_linear(L.o, att.data(), T, NH * D, nullptr, 0, y.data(), H, threads);
      adapt(l, 1, att.data(), NH * D, y.data(), H);
      add_normed(x, y.data(), T, H, L.post_norm, m->eps, h.data());
      sf_rms_norm_f32(x, T, H, L.pre_ff_norm, m->eps, h.data());
    } else {
      run_linear(L.o, att.data(), T, NH * D, x, H, x, H, threads);
      adapt(l, 1, att.data(), NH * D, x, H);
      sf_rms_norm_f32(x, T, H, L.post_norm, m->eps, h.data());
    }
    if (L.experts != nullptr) {  // adapters on the experts are refused when they load (moe.py)
      routed_experts(L, h.data(), x, T, H, threads);
      continue;
    }
    const int64_t I = L.down.K;
    run_linear(L.gate_up, h.data(), T, H, nullptr, 0, gu.data(), 2 * I, threads);
    adapt(l, 2, h.data(), H, gu.data(), 2 * I);
    if (L.gelu != 0) {
      gelu_tanh_mul(gu.data(), T, I, act.data());
    } else {
      sf_silu_mul_f32(gu.data(), T, I, act.data());
    }
    if (gemma) {
      run_linear(L.down, act.data(), T, I, nullptr, 0, y.data(), H, threads);
      adapt(l, 3, act.data(), I, y.data(), H);
      add_normed(x, y.data(), T, H, L.post_ff_norm, m->eps, h.data());
    } else {
      run_linear(L.down, act.data(), T, I, x, H, x, H, threads);
      adapt(l, 3, act.data(), I, x, H);
    }
  }
}

}  // extern "C"
