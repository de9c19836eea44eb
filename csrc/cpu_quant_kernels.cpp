// Quantized CPU linears for a decode step read at memory speed (worker/cpu_quant.py holds the
// layout's definition and a plain-torch twin of every step).
//
// Weights, repacked once at load into the order the kernel streams: tiles of 16 output rows; per
// tile and per block of 32 input columns one record:
//   int4: 4 x 64 bytes of nibbles, then 16 fp16 scales d, then 16 fp16 offsets m (w = d*q + m,
//         q in 0..15): byte (j, row i, t) holds q[i][4j+t] in its low nibble and q[i][16+4j+t] in
//         its high one, so one AND and one shift unpack 2 x 64 weights ready for VNNI;
//   int8: 8 x 64 bytes of u = q + 128 (q in -128..127), then 16 fp16 scales d (w = d*q).
// Byte (j, i, t) is input column 4j+t of row i: `vpdpbusd` multiplies 4 consecutive weight bytes
// of each of 16 rows with the same 4 activation bytes (broadcast) and sums them into that row's
// int32 lane.
//
// Activations: each row quantized per block of 32 to int8 (scale dx = amax / 127, round to
// nearest even; sx = the block's sum of quantized values) - the same for one row whatever else
// is in the call. Per row, tile and block the integer dot is exact; the float epilogue is, in
// block order, acc = fma(dot, d * dx, acc) [int4: then acc = fma(m, dx * sx, acc)], the same
// instructions on every ISA path, so AVX512, AVX2 and scalar give the same bits, and so do 1 or
// N rows, 1 or N threads.
#include "cpu_quant_kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace radix_cpu {
namespace {

using at::Tensor;

constexpr int64_t kTile = 16;   // output rows per tile (one 512-bit int32 / float vector)
constexpr int64_t kBlock = 32;  // input columns per block (one activation scale)
constexpr int64_t kInt4Record = 4 * 64 + 2 * 32;
constexpr int64_t kInt8Record = 8 * 64 + 32;
// Records read ahead of the one being computed: a batch-1 product does little work per byte, and
// the hardware prefetcher alone left one thread's stream at ~5 GB/s of its ~20 GB/s (8 records
// ahead: ~13 GB/s, 16: ~15 GB/s of a ~16 GB/s sum on gate/up 3072x576, one thread).
constexpr int64_t kPrefetchRecords = 16;
// the many-rows path from this many quantized rows (rows x passes) on; work items of a chunk of
// at most kManyChunk quantized rows and a pair of tiles (a call's chunks of equal size, a multiple
// of kMany2Group below: every pass of the two-tile kernel is full, the threads' shares even). A
// chunk re-reads the weights of every pair from memory: 2 x 1020 rows of a ~890-token prefill
// ran the 30 layers' products in ~510 ms on 2 threads where chunks of 504 took ~550 and of 128
// ~790 (weights cycled over 8 copies; one chunk of 1780, each thread half the pairs: ~590)
constexpr int64_t kManyRows = 8;
constexpr int64_t kManyChunk = 1020;
constexpr int kRowGroup = 4;  // quantized rows per pass over a tile's weights (registers; even:
                              // both passes of a two-pass row fall in one group)

// One call's quantized activation rows.
struct Act {
  const int8_t* xq;   // [R, B * 32]
  const float* dx;    // [R, B] block scales
  const float* mdx;   // [R, B] dx * sx (the int4 offset term's factor)
  const int32_t* sx;  // [R, B] block sums of xq
  int64_t blocks;
};

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------------------------------------
// activation quantization: src row (float32 or bf16 converted to float32) -> int8 blocks

// `residual` (or null): what the rounding left, x - d * q (one exact fma a value: the same bits
// on every path), over the padded width - a two-pass row's second input.
template <typename T>
void quantize_row_scalar(const T* x, int64_t k, int64_t blocks, int8_t* xq, float* dx, float* mdx,
                         int32_t* sx, float* residual) {
  float buf[kBlock];
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t c = b * kBlock + j;
      buf[j] = c < k ? static_cast<float>(x[c]) : 0.f;
      amax = std::max(amax, std::fabs(buf[j]));
    }
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(buf[j] * id));
      xq[b * kBlock + j] = static_cast<int8_t>(q);
      sum += q;
      if (residual) residual[b * kBlock + j] = std::fma(-d, static_cast<float>(q), buf[j]);
    }
    dx[b] = d;
    sx[b] = sum;
    mdx[b] = d * static_cast<float>(sum);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16_avx512(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16_avx512(
    const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Per lane b: the maximum (sum) of a[b]'s 16 lanes, for 16 blocks at once: four rounds of
// shuffles, each halving the vectors (~3 instructions a block where a horizontal reduction per
// block took ~8). A max and an integer sum are exact in any order; the rounds leave block b in
// lane block_lanes()[b] (a 4 x 4 transpose, its own inverse), which one permute puts back.
#define RR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
RR_AVX512 inline __m512i block_lanes() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// The rounds for either reduction: `op` combines two vectors lane by lane (the shuffles move
// 32-bit lanes whatever they hold, so an integer sum goes through the float view).
template <typename Op>
RR_AVX512 inline __m512 reduce_each(const __m512* a, Op op) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {
    x[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
              _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    y[i] = op(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
              _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    z[i] = op(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
              _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  }
  const __m512 r = op(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  return _mm512_permutexvar_ps(block_lanes(), r);
}

struct MaxPs {
  RR_AVX512 __m512 operator()(__m512 p, __m512 q) const { return _mm512_max_ps(p, q); }
};
struct AddEpi32 {
  RR_AVX512 __m512 operator()(__m512 p, __m512 q) const {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_castps_si512(q)));
  }
};

RR_AVX512 inline __m512 max_of_each(const __m512* a) { return reduce_each(a, MaxPs{}); }

RR_AVX512 inline __m512i sum_of_each(const __m512i* a) {
  return _mm512_castps_si512(reduce_each(reinterpret_cast<const __m512*>(a), AddEpi32{}));
}

// The same arithmetic as quantize_row_scalar (max, one division, one reciprocal, x * id rounded
// to nearest even), 16 blocks at a time: their maxima and sums reduced together, the divisions
// on 16 lanes (IEEE division: the same bits as one at a time); a row whose width is not a
// multiple of 32 takes the scalar way.
template <typename T>
RR_AVX512 void quantize_row_avx512(const T* x, int64_t k, int64_t blocks, int8_t* xq, float* dx,
                                   float* mdx, int32_t* sx, float* residual) {
  if (k % kBlock) return quantize_row_scalar(x, k, blocks, xq, dx, mdx, sx, residual);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int nb = static_cast<int>(std::min<int64_t>(16, blocks - b0));
    const T* xb = x + b0 * kBlock;
    __m512 a[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = i < nb ? _mm512_max_ps(_mm512_abs_ps(load16_avx512(xb + i * kBlock)),
                                    _mm512_abs_ps(load16_avx512(xb + i * kBlock + 16)))
                    : _mm512_setzero_ps();
    }
    const __m512 d = _mm512_div_ps(max_of_each(a), _mm512_set1_ps(127.f));
    const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_OQ),
                                          _mm512_set1_ps(1.f), d);
    alignas(64) float ds[16], ids[16];
    _mm512_store_ps(ds, d);
    _mm512_store_ps(ids, id);
    __m512i s[16];
    for (int i = 0; i < 16; ++i) {
      if (i >= nb) {
        s[i] = _mm512_setzero_si512();
        continue;
      }
      const __m512 v0 = load16_avx512(xb + i * kBlock), v1 = load16_avx512(xb + i * kBlock + 16);
      const __m512 vid = _mm512_set1_ps(ids[i]);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, vid), kRound));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, vid), kRound));
      int8_t* q = xq + (b0 + i) * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
      if (residual) {
        const __m512 vd = _mm512_set1_ps(ds[i]);
        float* r = residual + (b0 + i) * kBlock;
        _mm512_storeu_ps(r, _mm512_fnmadd_ps(vd, _mm512_cvtepi32_ps(q0), v0));
        _mm512_storeu_ps(r + 16, _mm512_fnmadd_ps(vd, _mm512_cvtepi32_ps(q1), v1));
      }
      s[i] = _mm512_add_epi32(q0, q1);
    }
    const __m512i sum = sum_of_each(s);
    const __mmask16 m = static_cast<__mmask16>((1u << nb) - 1);
    _mm512_mask_storeu_ps(dx + b0, m, d);
    _mm512_mask_storeu_epi32(sx + b0, m, sum);
    _mm512_mask_storeu_ps(mdx + b0, m, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));
  }
}

// ---------------------------------------------------------------------------------------------
// tile kernels: `nr` (<= kRowGroup) activation rows from r0 against one tile's records;
// acc[r * 16 + i] += row r0 + r's sum for the tile's output row i

void int4_tile_scalar(const uint8_t* rec, const Act& a, int64_t r0, int nr, float* acc) {
  for (int64_t b = 0; b < a.blocks; ++b, rec += kInt4Record) {
    for (int r = 0; r < nr; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xq = a.xq + row * a.blocks * kBlock + b * kBlock;
      const float dx = a.dx[row * a.blocks + b], mdx = a.mdx[row * a.blocks + b];
      for (int64_t i = 0; i < kTile; ++i) {
        int32_t dot = 0;
        for (int64_t j = 0; j < 4; ++j) {
          for (int64_t t = 0; t < 4; ++t) {
            const uint8_t byte = rec[j * 64 + i * 4 + t];
            dot += (byte & 0x0F) * xq[4 * j + t] + (byte >> 4) * xq[16 + 4 * j + t];
          }
        }
        const float d = half_to_float(rec + 256 + 2 * i), m = half_to_float(rec + 288 + 2 * i);
        float& s = acc[r * kTile + i];
        s = std::fma(static_cast<float>(dot), d * dx, s);
        s = std::fma(m, mdx, s);
      }
    }
  }
}

void int8_tile_scalar(const uint8_t* rec, const Act& a, int64_t r0, int nr, float* acc) {
  for (int64_t b = 0; b < a.blocks; ++b, rec += kInt8Record) {
    for (int r = 0; r < nr; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xq = a.xq + row * a.blocks * kBlock + b * kBlock;
      const float dx = a.dx[row * a.blocks + b];
      for (int64_t i = 0; i < kTile; ++i) {
        int32_t dot = 0;
        for (int64_t j = 0; j < 8; ++j) {
          for (int64_t t = 0; t < 4; ++t) {
            dot += (static_cast<int32_t>(rec[j * 64 + i * 4 + t]) - 128) * xq[4 * j + t];
          }
        }
        const float d = half_to_float(rec + 512 + 2 * i);
        float& s = acc[r * kTile + i];
        s = std::fma(static_cast<float>(dot), d * dx, s);
      }
    }
  }
}

// Past the end of the weights (the last tiles) this touches no memory that matters: a prefetch
// never faults.
inline void prefetch_record(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

#define RR_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

template <int NR>
RR_AVX512_VNNI void int4_tile_vnni_n(const uint8_t* rec, const Act& a, int64_t r0, float* out) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_loadu_ps(out + r * kTile);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t kp = a.blocks * kBlock;
  for (int64_t b = 0; b < a.blocks; ++b, rec += kInt4Record) {
    prefetch_record(rec + kPrefetchRecords * kInt4Record, kInt4Record);
    __m512i w[8];
    for (int j = 0; j < 4; ++j) {
      __m512i p = _mm512_loadu_si512(rec + 64 * j);
      w[j] = _mm512_and_si512(p, low);
      w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
    for (int r = 0; r < NR; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xq = a.xq + row * kp + b * kBlock;
      // two dependency chains of 4 (vpdpbusd's latency, not its throughput, bounds one chain)
      __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        dot0 = _mm512_dpbusd_epi32(dot0, w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
        dot1 = _mm512_dpbusd_epi32(dot1, w[j + 4], _mm512_set1_epi32(load_i32(xq + 16 + 4 * j)));
      }
      __m512i dot = _mm512_add_epi32(dot0, dot1);
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[row * a.blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.mdx[row * a.blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

template <int NR>
RR_AVX512_VNNI void int8_tile_vnni_n(const uint8_t* rec, const Act& a, int64_t r0, float* out) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_loadu_ps(out + r * kTile);
  const int64_t kp = a.blocks * kBlock;
  for (int64_t b = 0; b < a.blocks; ++b, rec += kInt8Record) {
    prefetch_record(rec + kPrefetchRecords * kInt8Record, kInt8Record);
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(rec + 64 * j);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 512)));
    for (int r = 0; r < NR; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xq = a.xq + row * kp + b * kBlock;
      // two dependency chains of 4 (vpdpbusd's latency, not its throughput, bounds one chain)
      __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        dot0 = _mm512_dpbusd_epi32(dot0, w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
        dot1 = _mm512_dpbusd_epi32(dot1, w[j + 4], _mm512_set1_epi32(load_i32(xq + 16 + 4 * j)));
      }
      __m512i dot = _mm512_add_epi32(dot0, dot1);
      // the weights are stored as q + 128: take 128 x the block's activation sum back out
      dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * a.sx[row * a.blocks + b]));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[row * a.blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

// Many rows (a prefill chunk): the products are compute-bound, so each tile's weights are unpacked
// ONCE per call into a per-thread scratch (8 x 64 weight bytes ready for `vpdpbusd`, then the 16
// scales d and 16 offsets m as float32 a block) and reused by every group of kManyGroup quantized
// rows. The integer dot of a row, tile and block is the same exact int32 (integer sums in any
// order), and the float epilogue is the same instructions in the same block order as
// int4_tile_vnni_n / int8_tile_vnni_n: the same bits.
constexpr int64_t kScratchBlock = 8 * 64 + 2 * kTile * 4;
constexpr int kManyGroup = 8;  // quantized rows per pass over the scratch (8 acc + 8 dot + 8 w regs)
// quantized rows per pass of the two-tile kernel (2 x 4 acc + 2 x 4 dot registers; even: both
// passes of a two-pass row fall in one group)
constexpr int kMany2Group = 6;

template <bool kInt4>
RR_AVX512_VNNI void unpack_tile_vnni(const uint8_t* rec, int64_t blocks, uint8_t* scratch) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  constexpr int64_t record = kInt4 ? kInt4Record : kInt8Record;
  for (int64_t b = 0; b < blocks; ++b, rec += record, scratch += kScratchBlock) {
    if (kInt4) {
      for (int j = 0; j < 4; ++j) {
        __m512i p = _mm512_loadu_si512(rec + 64 * j);
        _mm512_storeu_si512(scratch + 64 * j, _mm512_and_si512(p, low));
        _mm512_storeu_si512(scratch + 64 * (j + 4), _mm512_and_si512(_mm512_srli_epi16(p, 4), low));
      }
      const __m256i* h = reinterpret_cast<const __m256i*>(rec + 256);
      _mm512_storeu_ps(scratch + 512, _mm512_cvtph_ps(_mm256_loadu_si256(h)));
      _mm512_storeu_ps(scratch + 576, _mm512_cvtph_ps(_mm256_loadu_si256(h + 1)));
    } else {
      for (int j = 0; j < 8; ++j) {
        _mm512_storeu_si512(scratch + 64 * j, _mm512_loadu_si512(rec + 64 * j));
      }
      const __m256i* h = reinterpret_cast<const __m256i*>(rec + 512);
      _mm512_storeu_ps(scratch + 512, _mm512_cvtph_ps(_mm256_loadu_si256(h)));
    }
  }
}

template <bool kInt4, int NR>
RR_AVX512_VNNI void many_rows_vnni_n(const uint8_t* scratch, const Act& a, int64_t r0,
                                     float* out) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_loadu_ps(out + r * kTile);
  const int64_t kp = a.blocks * kBlock;
  for (int64_t b = 0; b < a.blocks; ++b, scratch += kScratchBlock) {
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(scratch + 64 * j);
    __m512i dot[NR];
    for (int r = 0; r < NR; ++r) {
      // int8: the weights are stored as q + 128: start from -128 x the block's activation sum
      dot[r] = kInt4 ? _mm512_setzero_si512()
                     : _mm512_set1_epi32(-128 * a.sx[(r0 + r) * a.blocks + b]);
    }
    // byte group j of the scratch holds columns 4j..4j+3 of the block (int4: 0-15 the low
    // nibbles, 16-31 the high ones): activation bytes 4j..4j+3 for both kinds
    for (int j = 0; j < 8; ++j) {
      for (int r = 0; r < NR; ++r) {
        const int8_t* xq = a.xq + (r0 + r) * kp + b * kBlock;
        dot[r] = _mm512_dpbusd_epi32(dot[r], w[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
      }
    }
    const __m512 d = _mm512_loadu_ps(scratch + 512);
    for (int r = 0; r < NR; ++r) {
      const int64_t row = r0 + r;
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[row * a.blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
      if (kInt4) {
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(scratch + 576),
                                 _mm512_set1_ps(a.mdx[row * a.blocks + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

// Two tiles (32 output rows) x NR quantized rows a pass: each activation broadcast feeds both
// tiles' `vpdpbusd` and each weight vector NR rows, with 2 x NR independent dependency chains
// (the one-tile kernel above did one `vpdpbusd` a broadcast: the front end, not the VNNI ports,
// bound it). Per (row, tile) the integer dot of a block is the same exact int32 and the epilogue
// the same instructions in block order: the same bits as many_rows_vnni_n.
// Where a two-tile pass of a two-pass call writes its rows' results itself: the two tiles' 32
// float32 outputs of row 0 (of quantized rows r0, r0 + 1) and the row stride; `bias` (or null) at
// the same columns.
struct RowsOut {
  float* y;
  int64_t stride;
  const float* bias;
};

template <bool kInt4, int NR>
RR_AVX512_VNNI void many_rows2_vnni_n(const uint8_t* s0, const uint8_t* s1, const Act& a,
                                      int64_t r0, float* out0, float* out1, const RowsOut* rows) {
  __m512 acc0[NR], acc1[NR];
  const int8_t* xr[NR];
  const float *dxr[NR], *mdxr[NR];
  const int32_t* sxr[NR];
  const int64_t kp = a.blocks * kBlock;
  for (int r = 0; r < NR; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
    xr[r] = a.xq + (r0 + r) * kp;
    dxr[r] = a.dx + (r0 + r) * a.blocks;
    mdxr[r] = a.mdx + (r0 + r) * a.blocks;
    sxr[r] = a.sx + (r0 + r) * a.blocks;
  }
  for (int64_t b = 0; b < a.blocks; ++b, s0 += kScratchBlock, s1 += kScratchBlock) {
    __m512i dot0[NR], dot1[NR];
    for (int r = 0; r < NR; ++r) {
      // int8: the weights are stored as q + 128: start from -128 x the block's activation sum
      dot0[r] = kInt4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * sxr[r][b]);
      dot1[r] = dot0[r];
    }
    for (int j = 0; j < 8; ++j) {
      const __m512i w0 = _mm512_loadu_si512(s0 + 64 * j), w1 = _mm512_loadu_si512(s1 + 64 * j);
      for (int r = 0; r < NR; ++r) {
        const __m512i x = _mm512_set1_epi32(load_i32(xr[r] + b * kBlock + 4 * j));
        dot0[r] = _mm512_dpbusd_epi32(dot0[r], w0, x);
        dot1[r] = _mm512_dpbusd_epi32(dot1[r], w1, x);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(s0 + 512), d1 = _mm512_loadu_ps(s1 + 512);
    for (int r = 0; r < NR; ++r) {
      const __m512 dx = _mm512_set1_ps(dxr[r][b]);
      acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0[r]), _mm512_mul_ps(d0, dx), acc0[r]);
      acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1[r]), _mm512_mul_ps(d1, dx), acc1[r]);
      if (kInt4) {
        const __m512 mdx = _mm512_set1_ps(mdxr[r][b]);
        acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(s0 + 576), mdx, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(s1 + 576), mdx, acc1[r]);
      }
    }
  }
  if (rows != nullptr) {
    // the emit of quant_linear for a two-pass row (its passes added in pass order, then the bias),
    // on 16 lanes: the same float additions, the same bits
    for (int r = 0; r + 1 < NR; r += 2) {
      float* o = rows->y + (r / 2) * rows->stride;
      __m512 v0 = _mm512_add_ps(acc0[r], acc0[r + 1]), v1 = _mm512_add_ps(acc1[r], acc1[r + 1]);
      if (rows->bias != nullptr) {
        v0 = _mm512_add_ps(v0, _mm512_loadu_ps(rows->bias));
        v1 = _mm512_add_ps(v1, _mm512_loadu_ps(rows->bias + kTile));
      }
      _mm512_storeu_ps(o, v0);
      _mm512_storeu_ps(o + kTile, v1);
    }
    return;
  }
  for (int r = 0; r < NR; ++r) {
    _mm512_storeu_ps(out0 + r * kTile, acc0[r]);
    _mm512_storeu_ps(out1 + r * kTile, acc1[r]);
  }
}

// nr quantized rows from r0 against two unpacked tiles: their sums into out0 / out1 (acc[qr * 16
// + i], as many_rows_vnni), or with `rows` (an even nr of a two-pass call) the rows' results
// straight into y
template <bool kInt4>
void many_rows2_vnni(const uint8_t* s0, const uint8_t* s1, const Act& a, int64_t r0, int nr,
                     float* out0, float* out1, const RowsOut* rows) {
  switch (nr) {
    case 1: return many_rows2_vnni_n<kInt4, 1>(s0, s1, a, r0, out0, out1, rows);
    case 2: return many_rows2_vnni_n<kInt4, 2>(s0, s1, a, r0, out0, out1, rows);
    case 3: return many_rows2_vnni_n<kInt4, 3>(s0, s1, a, r0, out0, out1, rows);
    case 4: return many_rows2_vnni_n<kInt4, 4>(s0, s1, a, r0, out0, out1, rows);
    case 5: return many_rows2_vnni_n<kInt4, 5>(s0, s1, a, r0, out0, out1, rows);
    default: return many_rows2_vnni_n<kInt4, 6>(s0, s1, a, r0, out0, out1, rows);
  }
}

template <bool kInt4>
void many_rows_vnni(const uint8_t* scratch, const Act& a, int64_t r0, int nr, float* out) {
  switch (nr) {
    case 1: return many_rows_vnni_n<kInt4, 1>(scratch, a, r0, out);
    case 2: return many_rows_vnni_n<kInt4, 2>(scratch, a, r0, out);
    case 3: return many_rows_vnni_n<kInt4, 3>(scratch, a, r0, out);
    case 4: return many_rows_vnni_n<kInt4, 4>(scratch, a, r0, out);
    case 5: return many_rows_vnni_n<kInt4, 5>(scratch, a, r0, out);
    case 6: return many_rows_vnni_n<kInt4, 6>(scratch, a, r0, out);
    case 7: return many_rows_vnni_n<kInt4, 7>(scratch, a, r0, out);
    default: return many_rows_vnni_n<kInt4, 8>(scratch, a, r0, out);
  }
}

#define RR_AVX2 __attribute__((target("avx2,fma,f16c")))

// AVX2: the tile as two halves of 8 rows (32 bytes of each 64-byte record vector);
// u8 x s8 pairs through vpmaddubsw (no saturation: int4 weights are <= 15, int8 ones go through
// |w| x sign(x, w) as a signed product) and vpmaddwd into int32 lanes.
RR_AVX2 void int4_tile_avx2(const uint8_t* rec0, const Act& a, int64_t r0, int nr, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t kp = a.blocks * kBlock;
  for (int r = 0; r < nr; ++r) {
    const int64_t row = r0 + r;
    for (int h = 0; h < 2; ++h) {
      __m256 acc = _mm256_loadu_ps(out + r * kTile + 8 * h);
      const uint8_t* rec = rec0;
      for (int64_t b = 0; b < a.blocks; ++b, rec += kInt4Record) {
        const int8_t* xq = a.xq + row * kp + b * kBlock;
        __m256i dot = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * h));
          __m256i lo = _mm256_and_si256(p, low);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
          __m256i xl = _mm256_set1_epi32(load_i32(xq + 4 * j));
          __m256i xh = _mm256_set1_epi32(load_i32(xq + 16 + 4 * j));
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones));
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), ones));
        }
        const __m256 d =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256 + 16 * h)));
        const __m256 m =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 288 + 16 * h)));
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.dx[row * a.blocks + b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc);
        acc = _mm256_fmadd_ps(m, _mm256_set1_ps(a.mdx[row * a.blocks + b]), acc);
      }
      _mm256_storeu_ps(out + r * kTile + 8 * h, acc);
    }
  }
}

RR_AVX2 void int8_tile_avx2(const uint8_t* rec0, const Act& a, int64_t r0, int nr, float* out) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const int64_t kp = a.blocks * kBlock;
  for (int r = 0; r < nr; ++r) {
    const int64_t row = r0 + r;
    for (int h = 0; h < 2; ++h) {
      __m256 acc = _mm256_loadu_ps(out + r * kTile + 8 * h);
      const uint8_t* rec = rec0;
      for (int64_t b = 0; b < a.blocks; ++b, rec += kInt8Record) {
        const int8_t* xq = a.xq + row * kp + b * kBlock;
        __m256i dot = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * j + 32 * h));
          __m256i w = _mm256_xor_si256(u, bias);  // q + 128 -> q (signed)
          __m256i x = _mm256_set1_epi32(load_i32(xq + 4 * j));
          __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(prod, ones));
        }
        const __m256 d =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 512 + 16 * h)));
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.dx[row * a.blocks + b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc);
      }
      _mm256_storeu_ps(out + r * kTile + 8 * h, acc);
    }
  }
}

template <void (*F1)(const uint8_t*, const Act&, int64_t, float*),
          void (*F2)(const uint8_t*, const Act&, int64_t, float*),
          void (*F3)(const uint8_t*, const Act&, int64_t, float*),
          void (*F4)(const uint8_t*, const Act&, int64_t, float*)>
void by_rows(const uint8_t* rec, const Act& a, int64_t r0, int nr, float* out) {
  switch (nr) {
    case 1: return F1(rec, a, r0, out);
    case 2: return F2(rec, a, r0, out);
    case 3: return F3(rec, a, r0, out);
    default: return F4(rec, a, r0, out);
  }
}

// ---------------------------------------------------------------------------------------------
// run-time choice of the path

using TileFn = void (*)(const uint8_t*, const Act&, int64_t, int, float*);
using QuantFn32 = void (*)(const float*, int64_t, int64_t, int8_t*, float*, float*, int32_t*,
                           float*);
using QuantFn16 = void (*)(const at::BFloat16*, int64_t, int64_t, int8_t*, float*, float*,
                           int32_t*, float*);

using UnpackFn = void (*)(const uint8_t*, int64_t, uint8_t*);
using ManyFn = void (*)(const uint8_t*, const Act&, int64_t, int, float*);
using Many2Fn = void (*)(const uint8_t*, const uint8_t*, const Act&, int64_t, int, float*, float*,
                         const RowsOut*);

struct Isa {
  const char* name;
  TileFn int4, int8;
  QuantFn32 quant32;
  QuantFn16 quant16;
  // the many-rows path (null: the tile kernels for every row count)
  UnpackFn unpack4, unpack8;
  ManyFn many4, many8;
  Many2Fn many2_4, many2_8;  // two tiles a pass
};

const Isa kIsas[] = {
    {"avx512_vnni",
     by_rows<int4_tile_vnni_n<1>, int4_tile_vnni_n<2>, int4_tile_vnni_n<3>, int4_tile_vnni_n<4>>,
     by_rows<int8_tile_vnni_n<1>, int8_tile_vnni_n<2>, int8_tile_vnni_n<3>, int8_tile_vnni_n<4>>,
     quantize_row_avx512<float>, quantize_row_avx512<at::BFloat16>, unpack_tile_vnni<true>,
     unpack_tile_vnni<false>, many_rows_vnni<true>, many_rows_vnni<false>, many_rows2_vnni<true>,
     many_rows2_vnni<false>},
    {"avx2", int4_tile_avx2, int8_tile_avx2, quantize_row_scalar<float>,
     quantize_row_scalar<at::BFloat16>, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr},
    {"scalar", int4_tile_scalar, int8_tile_scalar, quantize_row_scalar<float>,
     quantize_row_scalar<at::BFloat16>, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr},
};

bool supported(const Isa& isa) {
  const std::string name = isa.name;
  if (name == "avx512_vnni") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }
  if (name == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  return true;
}

const Isa* find_isa(const std::string& name) {
  for (const Isa& isa : kIsas) {
    if (name == isa.name) return &isa;
  }
  return nullptr;
}

// The best path this CPU has, or RADIX_CPU_KERNEL_ISA's (when this CPU has it).
const Isa* initial_isa() {
  if (const char* env = std::getenv("RADIX_CPU_KERNEL_ISA")) {
    const Isa* isa = find_isa(env);
    if (isa != nullptr && supported(*isa)) return isa;
  }
  for (const Isa& isa : kIsas) {
    if (supported(isa)) return &isa;
  }
  return &kIsas[2];
}

const Isa* g_isa = initial_isa();

}  // namespace

Tensor quant_linear(const Tensor& x, const Tensor& packed, int64_t kind, int64_t out_features,
                    int64_t in_features, const std::optional<Tensor>& bias, bool float_out,
                    int64_t act_passes) {
  TORCH_CHECK(kind == kQuantInt8 || kind == kQuantInt4, "unknown quantized kind ", kind);
  TORCH_CHECK(act_passes == 1 || act_passes == 2, "act_passes is 1 or 2, not ", act_passes);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "packed weights: a contiguous uint8 [N/16, K/32, record] tensor");
  const int64_t record = kind == kQuantInt4 ? kInt4Record : kInt8Record;
  const int64_t tiles = packed.size(0), blocks = packed.size(1);
  TORCH_CHECK(packed.size(2) == record, "packed record of ", packed.size(2), " bytes, not ", record);
  TORCH_CHECK(out_features <= tiles * kTile && out_features > (tiles - 1) * kTile &&
                  in_features <= blocks * kBlock && in_features > (blocks - 1) * kBlock,
              "packed weights do not match ", out_features, " x ", in_features);
  TORCH_CHECK(x.size(-1) == in_features, "input has ", x.size(-1), " features, not ", in_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "input must be float32 or bfloat16");
  Tensor rows = x.reshape({-1, in_features}).contiguous();
  const int64_t n_rows = rows.size(0), k = in_features, kp = blocks * kBlock;
  const Isa* isa = g_isa;
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  const auto out_dtype = float_out ? at::kFloat : rows.scalar_type();
  // no rows (an LM head over a step that samples nothing): nothing to split between threads
  // (the tile grain below divides by the row count)
  if (n_rows == 0) return at::empty(shape, rows.options().dtype(out_dtype));

  // pass p of row r is quantized row r * act_passes + p: the passes of a row go through the tile
  // kernel as neighbouring rows, its weights unpacked once for both
  Tensor xq = at::empty({act_passes * n_rows, kp}, rows.options().dtype(at::kChar));
  Tensor scales = at::empty({2, act_passes * n_rows, blocks}, rows.options().dtype(at::kFloat));
  Tensor sums = at::empty({act_passes * n_rows, blocks}, rows.options().dtype(at::kInt));
  auto* xq_p = xq.data_ptr<int8_t>();
  float* dx_p = scales.data_ptr<float>();
  float* mdx_p = dx_p + act_passes * n_rows * blocks;
  auto* sx_p = sums.data_ptr<int32_t>();
  const bool bf16 = rows.scalar_type() == at::kBFloat16;
  const void* src = rows.data_ptr();
  at::parallel_for(0, n_rows, std::max<int64_t>(1, 16384 / kp), [&](int64_t first, int64_t end) {
    std::vector<float> residual(act_passes > 1 ? kp : 0);
    for (int64_t r = first; r < end; ++r) {
      const int64_t r1 = r * act_passes;
      int8_t* q = xq_p + r1 * kp;
      float *d = dx_p + r1 * blocks, *md = mdx_p + r1 * blocks;
      float* res = act_passes > 1 ? residual.data() : nullptr;
      if (bf16) {
        isa->quant16(static_cast<const at::BFloat16*>(src) + r * k, k, blocks, q, d, md,
                     sx_p + r1 * blocks, res);
      } else {
        isa->quant32(static_cast<const float*>(src) + r * k, k, blocks, q, d, md,
                     sx_p + r1 * blocks, res);
      }
      if (res) {
        const int64_t r2 = r1 + 1;
        isa->quant32(res, kp, blocks, xq_p + r2 * kp, dx_p + r2 * blocks, mdx_p + r2 * blocks,
                     sx_p + r2 * blocks, nullptr);
      }
    }
  });
  const Act act{xq_p, dx_p, mdx_p, sx_p, blocks};

  Tensor y = at::empty({n_rows, out_features}, rows.options().dtype(out_dtype));
  Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "bias has ", bias->numel(), " values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const TileFn tile_fn = kind == kQuantInt4 ? isa->int4 : isa->int8;
  const auto* w = packed.data_ptr<uint8_t>();
  const int64_t q_rows = n_rows * act_passes;
  // one group's sums (nq quantized rows of tile t, acc[qr * 16 + i]) -> y: the passes of a row
  // added in pass order, then the bias
  float* const y_f = out_dtype == at::kFloat ? y.data_ptr<float>() : nullptr;
  at::BFloat16* const y_b = y_f ? nullptr : y.data_ptr<at::BFloat16>();
  auto emit = [&](int64_t t, int64_t q0, int nq, const float* acc) {
    const int64_t c0 = t * kTile, width = std::min(kTile, out_features - c0);
    const float* b = bias_p ? bias_p + c0 : nullptr;
    for (int qr = 0; qr < nq; qr += act_passes) {
      const float* s = acc + qr * kTile;
      const int64_t row = (q0 + qr) / act_passes;
      // float32 output: straight into y's row (a staging copy per row and tile was a call to
      // memmove each: ~7% of a cached turn's step)
      float sum[kTile];
      float* o = y_f ? y_f + row * out_features + c0 : sum;
      if (act_passes == 2) {
        for (int64_t i = 0; i < width; ++i) {
          const float v = s[i] + s[kTile + i];
          o[i] = b ? v + b[i] : v;
        }
      } else {
        for (int64_t i = 0; i < width; ++i) o[i] = b ? s[i] + b[i] : s[i];
      }
      if (!y_f) {
        at::BFloat16* ob = y_b + row * out_features + c0;
        for (int64_t i = 0; i < width; ++i) ob[i] = sum[i];
      }
    }
  };
  const UnpackFn unpack = kind == kQuantInt4 ? isa->unpack4 : isa->unpack8;
  const ManyFn many = kind == kQuantInt4 ? isa->many4 : isa->many8;
  const Many2Fn many2 = kind == kQuantInt4 ? isa->many2_4 : isa->many2_8;
  if (unpack != nullptr && q_rows >= kManyRows) {
    // work items: (chunk of quantized rows, pair of tiles), chunk-major: a chunk's activations
    // stay in cache across the tiles and its output rows are written whole (tile-major, which
    // unpacks each tile once, measured ~1.3x slower at 512 rows: row-strided output lines); an
    // odd last tile goes alone through the one-tile kernel
    const int64_t chunks = (q_rows + kManyChunk - 1) / kManyChunk, pairs = (tiles + 1) / 2;
    const int64_t per_chunk = (q_rows + chunks - 1) / chunks;
    const int64_t chunk = (per_chunk + kMany2Group - 1) / kMany2Group * kMany2Group;
    // a two-pass float32 call's full pairs of tiles write their rows' results from the kernel
    const bool direct = y_f != nullptr && act_passes == 2;
    at::parallel_for(0, pairs * chunks, 1, [&](int64_t i0, int64_t i1) {
      std::vector<uint8_t> scratch(2 * blocks * kScratchBlock);
      uint8_t* const s0 = scratch.data();
      uint8_t* const s1 = s0 + blocks * kScratchBlock;
      int64_t unpacked = -1;
      alignas(64) float acc0[kManyGroup * kTile], acc1[kManyGroup * kTile];
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t p = item % pairs, c = item / pairs, t = 2 * p;
        const bool two = t + 1 < tiles;
        if (p != unpacked) {
          unpack(w + t * blocks * record, blocks, s0);
          if (two) unpack(w + (t + 1) * blocks * record, blocks, s1);
          unpacked = p;
        }
        const int64_t q_end = std::min(q_rows, (c + 1) * chunk);
        const int64_t group = two ? kMany2Group : kManyGroup;
        const bool pair_direct = direct && two && (t + 2) * kTile <= out_features;
        for (int64_t q0 = c * chunk; q0 < q_end; q0 += group) {
          const int nq = static_cast<int>(std::min<int64_t>(group, q_end - q0));
          if (pair_direct) {
            const RowsOut out{y_f + (q0 / 2) * out_features + t * kTile, out_features,
                              bias_p ? bias_p + t * kTile : nullptr};
            many2(s0, s1, act, q0, nq, nullptr, nullptr, &out);
          } else if (two) {
            many2(s0, s1, act, q0, nq, acc0, acc1, nullptr);
            emit(t, q0, nq, acc0);
            emit(t + 1, q0, nq, acc1);
          } else {
            std::fill(acc0, acc0 + nq * kTile, 0.f);
            many(s0, act, q0, nq, acc0);
            emit(t, q0, nq, acc0);
          }
        }
      }
    });
  } else {
    // split output tiles between threads; each tile's rows x blocks is a few microseconds at least
    const int64_t grain =
        std::max<int64_t>(1, 256 / (blocks * std::min<int64_t>(n_rows * act_passes, 8)));
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      float acc[kRowGroup * kTile];
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t q0 = 0; q0 < q_rows; q0 += kRowGroup) {
          const int nq = static_cast<int>(std::min<int64_t>(kRowGroup, q_rows - q0));
          std::fill(acc, acc + nq * kTile, 0.f);
          tile_fn(w + t * blocks * record, act, q0, nq, acc);
          emit(t, q0, nq, acc);
        }
      }
    });
  }
  return y.view(shape);
}

void bind_quant_kernels(pybind11::module& m) {
  m.def("quant_linear", &quant_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y = x W^T (+ bias) for cpu_quant's packed int8 / int4 weights");
  m.def("kernel_isa", []() { return std::string(g_isa->name); },
        "the instruction set the quantized kernels use now");
  m.def("kernel_isas", []() {
    std::vector<std::string> names;
    for (const Isa& isa : kIsas) {
      if (supported(isa)) names.emplace_back(isa.name);
    }
    return names;
  }, "the paths this CPU can run, best first");
  m.def("parallel_threads", [](int64_t tasks) {
    // how many threads one at::parallel_for of `tasks` one-item tasks runs on: 1 in a module
    // built without OpenMP (ATen's parallel_for is inline and runs serially there)
    std::atomic<int64_t> used{1};
    at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
      int64_t seen = used.load();
      const int64_t mine = at::get_thread_num() + 1;
      while (seen < mine && !used.compare_exchange_weak(seen, mine)) {
      }
    });
    return used.load();
  }, pybind11::call_guard<pybind11::gil_scoped_release>(),
     "threads one parallel_for of `tasks` tasks ran on (1 without OpenMP)");
  m.def("set_kernel_isa", [](const std::string& name) {
    const Isa* isa = find_isa(name);
    TORCH_CHECK(isa != nullptr, "unknown kernel ISA ", name);
    TORCH_CHECK(supported(*isa), "this CPU cannot run ", name);
    g_isa = isa;
  }, "force a path (tests, benchmarks): avx512_vnni, avx2 or scalar");
}

}  // namespace radix_cpu
