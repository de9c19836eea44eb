// The CPU forward of a Llama-family decoder stack in one call (radix_runtime/worker/cpu_native.py).
//
// The same ATen operations, in the same order and on the same dtypes, as the Python modules of
// models/llama.py, layers/ and attention/torch_native.py run, so the outputs are bitwise the same;
// what it removes is the Python interpreter and nn.Module dispatch around each of the ~60 small
// operations of a layer, which dominate a batch-1 decode step of a small model on the CPU
// (docs/decisions.md, "The CPU decoder step in C++").
#include <torch/extension.h>

#include "cpu_quant_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

// The float32 row loops below (rms_norm, rope_store, add_into) are bitwise ATen's separate mul /
// add / div kernels only if the compiler does not contract a * b + c into one FMA: this file is
// built without -mfma (setup.py), which keeps every product rounded on its own.
#if defined(__FMA__)
#error "cpu_decoder.cpp must be built without FMA contraction (its row loops mirror ATen bitwise)"
#endif

namespace {

using at::Tensor;

enum class LinearKind : int64_t {
  Dense = 0,
  Int8 = radix_cpu::kQuantInt8,
  Int4 = radix_cpu::kQuantInt4
};

// One projection in one of the CPU weight formats (cpu_quant.py): y = x W^T (+ b).
struct Projection {
  LinearKind kind;
  Tensor weight;  // dense: [N, K]; int8 / int4: cpu_quant's packed tiles
  Tensor bias;    // may be undefined
  int64_t out_features, in_features;
  int64_t act_passes;  // int8 / int4: cpu_quant.QuantLinear.act_passes

  Tensor operator()(const Tensor& x) const {
    if (kind == LinearKind::Dense) {
      return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
    }
    // cpu_quant.QuantLinear.forward: the same kernel
    std::optional<Tensor> b = bias.defined() ? std::optional<Tensor>(bias) : std::nullopt;
    return radix_cpu::quant_linear(x, weight, static_cast<int64_t>(kind), out_features,
                                   in_features, b, false, act_passes);
  }
};

struct Layer {
  Tensor input_norm, post_norm;  // RMSNorm weights
  Projection qkv, o, gate_up, down;
};

// Where a group of queries reads its keys: a slice [a, b) of the layer's pool or an index_select.
struct KeySource {
  int64_t a = -1, b = -1;  // a span of consecutive pool locations, or a < 0
  Tensor locs;             // int64 pool locations (when there is no span)

  Tensor gather(const Tensor& flat) const {
    if (a >= 0) return flat.slice(0, a, b);
    return flat.index_select(0, locs);
  }
};


// Attention of one query row per sequence over all of its keys (a decode step without padding):
// q [B, H, D], k / v [B, L, Hkv, D] float32 (any strides but a contiguous D), out [B, H, D].
// Each (sequence, KV head) pair: scores of its G query heads against every key, softmax (max
// subtracted, float32 sums in key order), the weighted sum of the values. The Python layers'
// decode (attention/torch_native.py) calls this same function, so both paths give the same bits.
// ATen's flash SDPA costs ~30-55 us a layer here (blocking, buffers) for ~2 us of arithmetic.
static void decode_attention_rows(
    const float* q, const float* k, const float* v, float* out, int64_t b0, int64_t b1,
    int64_t heads, int64_t kv_heads, int64_t len, int64_t d, float scale, int64_t ks_b,
    int64_t ks_l, int64_t ks_h, int64_t vs_b, int64_t vs_l, int64_t vs_h, float* scores) {
  const int64_t group = heads / kv_heads;
  constexpr int64_t W = 16;
  for (int64_t t = b0; t < b1; ++t) {
    const int64_t b = t / kv_heads, g = t % kv_heads;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const float* qh = q + (b * heads + h) * d;
      float* sc = scores + (h - g * group) * len;
      float mx = -INFINITY;
      for (int64_t l = 0; l < len; ++l) {
        const float* kr = k + b * ks_b + l * ks_l + g * ks_h;
        float acc[W] = {0};
        int64_t j = 0;
        for (; j + W <= d; j += W)
          for (int64_t u = 0; u < W; ++u) acc[u] += qh[j + u] * kr[j + u];
        for (; j < d; ++j) acc[j % W] += qh[j] * kr[j];
        float dot = 0.f;
        for (int64_t u = 0; u < W; ++u) dot += acc[u];
        sc[l] = dot * scale;
        mx = std::max(mx, sc[l]);
      }
      float sum = 0.f;
      for (int64_t l = 0; l < len; ++l) {
        sc[l] = std::exp(sc[l] - mx);
        sum += sc[l];
      }
      float* o = out + (b * heads + h) * d;
      for (int64_t j = 0; j < d; ++j) o[j] = 0.f;
      for (int64_t l = 0; l < len; ++l) {
        const float* vr = v + b * vs_b + l * vs_l + g * vs_h;
        const float p = sc[l];
        for (int64_t j = 0; j < d; ++j) o[j] += p * vr[j];
      }
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < d; ++j) o[j] *= inv;
    }
  }
}

// exp of 16 floats <= 0 (Cephes' expf: 2^n times a degree-6 polynomial of the remainder,
// ~1 ulp; below -87 it flushes towards 0 as a softmax weight may)
__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}

// decode_attention_rows with AVX-512 (d a multiple of 16): a key row's dot products with the G
// query heads of its KV head in 16-lane FMAs, the value rows added in 16-lane FMAs.
__attribute__((target("avx512f"))) static void decode_attention_rows_avx512(
    const float* q, const float* k, const float* v, float* out, int64_t b0, int64_t b1,
    int64_t heads, int64_t kv_heads, int64_t len, int64_t d, float scale, int64_t ks_b,
    int64_t ks_l, int64_t ks_h, int64_t vs_b, int64_t vs_l, int64_t vs_h, float* scores) {
  const int64_t group = heads / kv_heads;
  for (int64_t t = b0; t < b1; ++t) {
    const int64_t b = t / kv_heads, g = t % kv_heads;
    const float* q0 = q + (b * heads + g * group) * d;
    for (int64_t l = 0; l < len; ++l) {
      const float* kr = k + b * ks_b + l * ks_l + g * ks_h;
      for (int64_t hh = 0; hh < group; ++hh) {
        const float* qh = q0 + hh * d;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 16)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j), _mm512_loadu_ps(kr + j), acc);
        scores[hh * len + l] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
    for (int64_t hh = 0; hh < group; ++hh) {
      float* sc = scores + hh * len;
      float mx = -INFINITY;
      for (int64_t l = 0; l < len; ++l) mx = std::max(mx, sc[l]);
      __m512 total = _mm512_setzero_ps();
      const __m512 m = _mm512_set1_ps(mx);
      for (int64_t l = 0; l < len; l += 16) {
        const __mmask16 live = len - l >= 16 ? 0xFFFF : (__mmask16)((1u << (len - l)) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + l), m));
        _mm512_mask_storeu_ps(sc + l, live, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
      }
      const float sum = _mm512_reduce_add_ps(total);
      float* o = out + (b * heads + g * group + hh) * d;
      const __m512 inv = _mm512_set1_ps(1.0f / sum);
      for (int64_t j0 = 0; j0 < d; j0 += 64) {  // up to 4 independent accumulator chains
        const int64_t n = std::min<int64_t>(4, (d - j0) / 16);
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        const float* vr = v + b * vs_b + g * vs_h + j0;
        for (int64_t l = 0; l < len; ++l) {
          const __m512 p = _mm512_set1_ps(sc[l]);
          for (int64_t u = 0; u < n; ++u)
            acc[u] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + l * vs_l + 16 * u), acc[u]);
        }
        for (int64_t u = 0; u < n; ++u) _mm512_storeu_ps(o + j0 + 16 * u, _mm512_mul_ps(acc[u], inv));
      }
    }
  }
}

}  // namespace

// q [B, H, D], k / v [B, L, Hkv, D] float32 on the CPU -> [B, H, D] (decode_attention_rows)
Tensor decode_attention(const Tensor& q_in, const Tensor& k, const Tensor& v, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 4 && v.dim() == 4, "q [B, H, D], k/v [B, L, Hkv, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && q_in.device().is_cpu(),
              "float32 CPU tensors");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q_in.size(0) && k.size(3) == q_in.size(2),
              "k and v [B, L, Hkv, D] with q's B and D");
  TORCH_CHECK(k.size(1) > 0 && q_in.size(1) % k.size(2) == 0, "keys, and H a multiple of Hkv");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "a contiguous head dimension");
  Tensor q = q_in.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t len = k.size(1), kv_heads = k.size(2), group = heads / kv_heads;
  Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t work = std::max<int64_t>(1, 2 * group * len * d);
  static const bool avx512_cpu = __builtin_cpu_supports("avx512f");
  const bool avx512 = avx512_cpu && d % 16 == 0;
  at::parallel_for(0, batch * kv_heads, std::max<int64_t>(1, at::internal::GRAIN_SIZE / work),
                   [&](int64_t t0, int64_t t1) {
                     std::vector<float> scores(group * len);
                     auto rows = avx512 ? decode_attention_rows_avx512 : decode_attention_rows;
                     rows(qp, kp, vp, op, t0, t1, heads, kv_heads, len, d,
                          static_cast<float>(scale), k.stride(0), k.stride(1), k.stride(2),
                          v.stride(0), v.stride(1), v.stride(2), scores.data());
                   });
  return out;
}

// A small prefill chunk over its cached prefix (a chat's next turn: a few new query rows over a
// long history), float32: query row j (at position prefix + j) attends to the sequence's keys
// 0..prefix+j, read from the pool through their locations (no gathered copy of K/V). Three
// passes, each split over small work items so two threads share them evenly (3 KV heads do not
// split over 2 threads): the scores of every (KV head, block of 16 keys) against all of the
// head's query rows (key-major: a key's scores for all query rows in 16-lane vectors, each one
// an in-order sum over the head dimension), the softmax of every (KV head, 16 query rows) in
// 16-lane steps over the keys, and the value sums of every (KV head, query row) over its keys
// in order. No sum depends on the other rows or the thread count: a query row's result is the
// same in a chunk of 1 or of 20 rows, on 1 or 2 threads.
namespace {

constexpr int64_t kKeyBlock = 16;

struct ChunkArgs {
  const float *k, *v;
  const int64_t* locs;  // pool location of each key position
  const float* qt;      // [Hkv, D, nqp]: each KV head's query rows transposed (qv = j * G + hh)
  float* out;
  float* scores;  // [Hkv, len, nqp]: scores, then the softmax numerators (0 past a row's keys)
  float* inv;     // [Hkv, nqp]: 1 / the softmax denominators
  int64_t n, heads, kv_heads, group, d, prefix, nqp;
  int64_t ks0, ks1, vs0, vs1;  // pool strides (location, KV head); the head dimension contiguous
  float scale;
  int64_t len() const { return prefix + n; }
  int64_t nq() const { return n * group; }
  float* score(int64_t g, int64_t l) const { return scores + (g * len() + l) * nqp; }
  // keys a query column sees: its row's position + 1 (0 for the padding columns)
  int64_t keys_of(int64_t qv) const { return qv < nq() ? prefix + qv / group + 1 : 0; }
};

// pass 1, scalar: key l's scores for KV head g's query columns
void chunk_scores(const ChunkArgs& a, int64_t g, int64_t b) {
  const int64_t l1 = std::min(a.len(), (b + 1) * kKeyBlock);
  for (int64_t l = b * kKeyBlock; l < l1; ++l) {
    const float* kr = a.k + a.locs[l] * a.ks0 + g * a.ks1;
    float* sc = a.score(g, l);
    for (int64_t qv = 0; qv < a.nqp; ++qv) {
      float dot = 0.f;
      for (int64_t j = 0; j < a.d; ++j) dot += a.qt[(g * a.d + j) * a.nqp + qv] * kr[j];
      sc[qv] = dot * a.scale;
    }
  }
}

// pass 2, scalar: the softmax of query columns [16 c, 16 c + 16) of KV head g
void chunk_softmax(const ChunkArgs& a, int64_t g, int64_t c) {
  for (int64_t qv = c * 16; qv < std::min(a.nqp, c * 16 + 16); ++qv) {
    const int64_t keys = a.keys_of(qv);
    float mx = -INFINITY;
    for (int64_t l = 0; l < keys; ++l) mx = std::max(mx, a.score(g, l)[qv]);
    float sum = 0.f;
    for (int64_t l = 0; l < a.len(); ++l) {
      float* s = a.score(g, l) + qv;
      *s = l < keys ? std::exp(*s - mx) : 0.f;
      sum += *s;
    }
    a.inv[g * a.nqp + qv] = 1.0f / sum;
  }
}

// pass 3, scalar: the value sums of query row j of KV head g
void chunk_values(const ChunkArgs& a, int64_t g, int64_t j) {
  const int64_t keys = a.prefix + j + 1;
  for (int64_t hh = 0; hh < a.group; ++hh) {
    const int64_t qv = j * a.group + hh;
    float* o = a.out + (j * a.heads + g * a.group + hh) * a.d;
    for (int64_t c = 0; c < a.d; ++c) o[c] = 0.f;
    for (int64_t l = 0; l < keys; ++l) {
      const float* vr = a.v + a.locs[l] * a.vs0 + g * a.vs1;
      const float p = a.score(g, l)[qv];
      for (int64_t c = 0; c < a.d; ++c) o[c] += p * vr[c];
    }
    const float inv = a.inv[g * a.nqp + qv];
    for (int64_t c = 0; c < a.d; ++c) o[c] *= inv;
  }
}

// pass 1 with AVX-512 over NC x 16 query columns (from column 16 c0): 4 keys at a time (4 x NC
// independent FMA chains), each key element broadcast against the transposed queries
template <int NC>
__attribute__((target("avx512f"))) void key_scores(const ChunkArgs& a, int64_t g, int64_t l0,
                                                   int64_t l1, int64_t c0) {
  const float* qt = a.qt + g * a.d * a.nqp + 16 * c0;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t l = l0; l < l1; l += 4) {
    const int64_t m = std::min<int64_t>(4, l1 - l);
    const float* kr[4];
    for (int64_t u = 0; u < 4; ++u)
      kr[u] = a.k + a.locs[l + std::min(u, m - 1)] * a.ks0 + g * a.ks1;
    __m512 acc[4][NC];
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[u][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < a.d; ++j) {
      __m512 qv[NC];
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(qt + j * a.nqp + 16 * c);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512 kb = _mm512_set1_ps(kr[u][j]);
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[u][c] = _mm512_fmadd_ps(kb, qv[c], acc[u][c]);
      }
    }
    for (int64_t u = 0; u < m; ++u)
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c)
        _mm512_storeu_ps(a.score(g, l + u) + 16 * (c0 + c), _mm512_mul_ps(acc[u][c], scale));
  }
}

__attribute__((target("avx512f"))) void chunk_scores_avx512(const ChunkArgs& a, int64_t g,
                                                             int64_t b) {
  const int64_t l0 = b * kKeyBlock, l1 = std::min(a.len(), l0 + kKeyBlock);
  // the keys two blocks on (this thread's item after next): pool rows read from L3 / memory
  for (int64_t l = l0 + 2 * kKeyBlock; l < std::min(a.len(), l0 + 3 * kKeyBlock); ++l) {
    const char* kr = reinterpret_cast<const char*>(a.k + a.locs[l] * a.ks0 + g * a.ks1);
    for (int64_t byte = 0; byte < a.d * 4; byte += 64) _mm_prefetch(kr + byte, _MM_HINT_T0);
  }
  const int64_t chunks = a.nqp / 16;
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    switch (std::min<int64_t>(4, chunks - c0)) {
      case 1: key_scores<1>(a, g, l0, l1, c0); break;
      case 2: key_scores<2>(a, g, l0, l1, c0); break;
      case 3: key_scores<3>(a, g, l0, l1, c0); break;
      default: key_scores<4>(a, g, l0, l1, c0); break;
    }
  }
}

// pass 2 with AVX-512: 16 query columns' softmax in one vector per key (a lane per column)
__attribute__((target("avx512f"))) void chunk_softmax_avx512(const ChunkArgs& a, int64_t g,
                                                              int64_t c) {
  alignas(64) int32_t keys[16];
  for (int64_t i = 0; i < 16; ++i) keys[i] = static_cast<int32_t>(a.keys_of(16 * c + i));
  const __m512i kv = _mm512_load_si512(keys);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t l = 0; l < a.len(); ++l) {
    const __mmask16 live = _mm512_cmpgt_epi32_mask(kv, _mm512_set1_epi32(static_cast<int32_t>(l)));
    mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(a.score(g, l) + 16 * c));
  }
  __m512 sum = _mm512_setzero_ps();
  for (int64_t l = 0; l < a.len(); ++l) {
    const __mmask16 live = _mm512_cmpgt_epi32_mask(kv, _mm512_set1_epi32(static_cast<int32_t>(l)));
    float* s = a.score(g, l) + 16 * c;
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(s), mx)));
    _mm512_storeu_ps(s, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(a.inv + g * a.nqp + 16 * c, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
}

// pass 3's value sums of HN heads over CN x 16 dims (fixed counts: the accumulators stay in
// registers), keys in order: o_u = inv_u * sum_l p_u[l] v[l], p_u[l] = sc[u + l * stride]
template <int HN, int CN>
__attribute__((target("avx512f"))) void chunk_value_sums(const float* sc, int64_t stride,
                                                          const float* v, const int64_t* locs,
                                                          int64_t len, int64_t vs0,
                                                          float* const* out, const float* inv) {
  __m512 acc[HN][CN];
#pragma GCC unroll 4
  for (int u = 0; u < HN; ++u)
#pragma GCC unroll 4
    for (int c = 0; c < CN; ++c) acc[u][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; ++l) {
    const float* vr = v + locs[l] * vs0;
    if (l + 8 < len) {  // (pool rows: see chunk_scores_avx512)
      const char* ahead = reinterpret_cast<const char*>(v + locs[l + 8] * vs0);
#pragma GCC unroll 4
      for (int c = 0; c < CN; ++c) _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
    }
    __m512 vv[CN];
#pragma GCC unroll 4
    for (int c = 0; c < CN; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
#pragma GCC unroll 4
    for (int u = 0; u < HN; ++u) {
      const __m512 p = _mm512_set1_ps(sc[u + l * stride]);
#pragma GCC unroll 4
      for (int c = 0; c < CN; ++c) acc[u][c] = _mm512_fmadd_ps(p, vv[c], acc[u][c]);
    }
  }
#pragma GCC unroll 4
  for (int u = 0; u < HN; ++u) {
    const __m512 s = _mm512_set1_ps(inv[u]);
#pragma GCC unroll 4
    for (int c = 0; c < CN; ++c) _mm512_storeu_ps(out[u] + 16 * c, _mm512_mul_ps(acc[u][c], s));
  }
}

using ValueSums = void (*)(const float*, int64_t, const float*, const int64_t*, int64_t, int64_t,
                           float* const*, const float*);

template <int HN>
ValueSums value_sums_for(int64_t cn) {
  switch (cn) {
    case 1: return chunk_value_sums<HN, 1>;
    case 2: return chunk_value_sums<HN, 2>;
    case 3: return chunk_value_sums<HN, 3>;
    default: return chunk_value_sums<HN, 4>;
  }
}

ValueSums value_sums_for(int64_t hn, int64_t cn) {
  switch (hn) {
    case 1: return value_sums_for<1>(cn);
    case 2: return value_sums_for<2>(cn);
    case 3: return value_sums_for<3>(cn);
    default: return value_sums_for<4>(cn);
  }
}

// pass 3 with AVX-512: row j's G heads share each value row's loads (up to 4 heads x 64 dims)
__attribute__((target("avx512f"))) void chunk_values_avx512(const ChunkArgs& a, int64_t g,
                                                             int64_t j) {
  const int64_t keys = a.prefix + j + 1;
  for (int64_t h0 = 0; h0 < a.group; h0 += 4) {
    const int64_t hn = std::min<int64_t>(4, a.group - h0), qv = j * a.group + h0;
    for (int64_t c0 = 0; c0 < a.d; c0 += 64) {
      const int64_t cn = std::min<int64_t>(4, (a.d - c0) / 16);
      float* o[4];
      for (int64_t u = 0; u < hn; ++u)
        o[u] = a.out + (j * a.heads + g * a.group + h0 + u) * a.d + c0;
      value_sums_for(hn, cn)(a.score(g, 0) + qv, a.nqp, a.v + g * a.vs1 + c0, a.locs, keys,
                             a.vs0, o, a.inv + g * a.nqp + qv);
    }
  }
}

}  // namespace

// q [n, H, D] float32 (the chunk's query rows), k_all / v_all [P, Hkv, D] (a layer's pool),
// locs [prefix + n] int64 (the sequence's pool locations) -> out [n, H, D] (see above)
Tensor chunk_attention(const Tensor& q_in, const Tensor& k_all, const Tensor& v_all,
                       const Tensor& locs_in, int64_t prefix, double scale, bool simd) {
  TORCH_CHECK(q_in.dim() == 3 && k_all.dim() == 3 && v_all.dim() == 3,
              "q [n, H, D], k/v [P, Hkv, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_all.scalar_type() == at::kFloat &&
                  v_all.scalar_type() == at::kFloat && q_in.device().is_cpu() &&
                  k_all.device().is_cpu() && v_all.device().is_cpu(),
              "float32 CPU tensors");
  TORCH_CHECK(k_all.sizes() == v_all.sizes() && k_all.size(2) == q_in.size(2) &&
                  q_in.size(1) % k_all.size(1) == 0,
              "k and v [P, Hkv, D] with q's D, and H a multiple of Hkv");
  TORCH_CHECK(k_all.stride(2) == 1 && v_all.stride(2) == 1, "a contiguous head dimension");
  TORCH_CHECK(locs_in.scalar_type() == at::kLong && locs_in.dim() == 1 && prefix >= 0 &&
                  locs_in.size(0) == prefix + q_in.size(0),
              "locs: int64 [prefix + n]");
  Tensor locs = locs_in.contiguous();
  const int64_t n = q_in.size(0), heads = q_in.size(1), d = q_in.size(2);
  const int64_t kv_heads = k_all.size(1), group = heads / kv_heads;
  const int64_t* lp = locs.data_ptr<int64_t>();
  for (int64_t l = 0; l < locs.size(0); ++l)
    TORCH_CHECK(lp[l] >= 0 && lp[l] < k_all.size(0), "key location ", lp[l], " outside the pool");
  Tensor out = at::empty({n, heads, d}, q_in.options());
  if (n == 0) return out;
  const int64_t nq = n * group, nqp = (nq + 15) / 16 * 16, len = prefix + n;
  // [Hkv, D, nqp]: column j * G + hh holds query head g * G + hh of row j (padding: 0)
  Tensor qt = at::zeros({kv_heads, nqp, d}, q_in.options());
  qt.narrow(1, 0, nq).copy_(q_in.view({n, kv_heads, group, d}).permute({1, 0, 2, 3})
                                .reshape({kv_heads, nq, d}));
  qt = qt.transpose(1, 2).contiguous();
  Tensor scores = at::empty({kv_heads * len * nqp}, q_in.options());
  Tensor inv = at::empty({kv_heads * nqp}, q_in.options());
  ChunkArgs a{k_all.data_ptr<float>(), v_all.data_ptr<float>(), lp, qt.data_ptr<float>(),
              out.data_ptr<float>(), scores.data_ptr<float>(), inv.data_ptr<float>(), n, heads,
              kv_heads, group, d, prefix, nqp, k_all.stride(0), k_all.stride(1),
              v_all.stride(0), v_all.stride(1), static_cast<float>(scale)};
  static const bool avx512_cpu = __builtin_cpu_supports("avx512f");
  const bool avx512 = simd && avx512_cpu && d % 16 == 0;
  const int64_t blocks = (len + kKeyBlock - 1) / kKeyBlock, chunks = nqp / 16;
  // each stage over (KV head, item) tasks, items split between threads; a stage ends before the
  // next starts
  using Stage = void (*)(const ChunkArgs&, int64_t, int64_t);
  auto run = [&](int64_t items, Stage simd_fn, Stage plain_fn) {
    const Stage fn = avx512 ? simd_fn : plain_fn;
    at::parallel_for(0, kv_heads * items, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) fn(a, t / items, t % items);
    });
  };
  run(blocks, chunk_scores_avx512, chunk_scores);
  run(chunks, chunk_softmax_avx512, chunk_softmax);
  run(n, chunk_values_avx512, chunk_values);
  return out;
}

class CpuDecoder {
 public:
  CpuDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale) {}

  // `projections`: qkv, o, gate_up, down, each
  // (kind, weight, bias, out_features, in_features, act_passes)
  void add_layer(Tensor input_norm, Tensor post_norm,
                 std::vector<std::tuple<int64_t, Tensor, std::optional<Tensor>, int64_t, int64_t,
                                        int64_t>>
                     projections) {
    TORCH_CHECK(projections.size() == 4, "a layer has 4 projections");
    std::vector<Projection> p;
    for (auto& [kind, weight, bias, out_features, in_features, passes] : projections) {
      TORCH_CHECK(kind >= 0 && kind <= 2, "unknown projection kind ", kind);
      p.push_back(Projection{static_cast<LinearKind>(kind), weight, bias.value_or(Tensor()),
                             out_features, in_features, passes});
    }
    layers_.push_back(Layer{input_norm, post_norm, p[0], p[1], p[2], p[3]});
  }

  void bind_pool(std::vector<Tensor> k_flat, std::vector<Tensor> v_flat) {
    TORCH_CHECK(k_flat.size() == layers_.size() && v_flat.size() == layers_.size(),
                "one K and one V pool view per layer");
    k_flat_ = std::move(k_flat);
    v_flat_ = std::move(v_flat);
  }

  // The decoder stack over a flat batch: h [N, hidden] (the embeddings), cos/sin [N, 1, D],
  // out_cache_loc [N] (where the new K/V go). The attention plan (torch_native.py) is either a
  // decode-only batch (`decode` and no prefill chunks: every row one query) or a list of prefill
  // chunks plus, optionally, a decode group with the rows it owns. Returns the residual stream
  // after the last layer (the caller applies the final norm).
  Tensor forward(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& out_cache_loc,
                 std::optional<std::tuple<std::optional<Tensor>, int64_t, int64_t,
                                          std::optional<Tensor>, int64_t, int64_t,
                                          std::optional<Tensor>>>
                     decode,
                 std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t,
                                        std::optional<Tensor>, std::optional<Tensor>, int64_t,
                                        int64_t>>
                     prefills) {
    // decode: (rows, span_a, span_b, kv_locs, batch, max_len, mask)
    // prefill chunk: (start, end, span_a, span_b, kv_locs, mask, grouped, row_prefix)
    Plan plan;
    if (decode) {
      auto& [rows, a, b, locs, batch, max_len, mask] = *decode;
      plan.has_decode = true;
      plan.decode_rows = rows.value_or(Tensor());
      plan.decode_keys = KeySource{a, b, locs.value_or(Tensor())};
      plan.decode_shape = {batch, max_len};
      plan.decode_mask = mask.value_or(Tensor());
    }
    for (auto& [start, end, a, b, locs, mask, grouped, row_prefix] : prefills) {
      Tensor m = mask.has_value() ? mask->unsqueeze(0).unsqueeze(0) : Tensor();
      TORCH_CHECK(row_prefix < 0 || locs.has_value(), "a row-kernel chunk needs its locations");
      plan.chunks.push_back(
          Chunk{start, end, KeySource{a, b, locs.value_or(Tensor())}, m, grouped, row_prefix});
    }
    // float32 activations, pool and tables: the elementwise work of a layer runs as plain loops
    // over the rows (one pass each instead of ~25 small ATen calls, bitwise the same results)
    const bool rows = row_loops_ && h.scalar_type() == at::kFloat && h.dim() == 2 &&
                      cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                      cos.is_contiguous() && sin.is_contiguous() &&
                      out_cache_loc.scalar_type() == at::kLong && !k_flat_.empty() &&
                      k_flat_[0].scalar_type() == at::kFloat;
    if (rows) h = h.contiguous().clone();  // the residual stream, updated in place
    const Tensor loc = rows ? out_cache_loc.contiguous() : out_cache_loc;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (rows) {
        add_into(h, attention(i, l, rms_norm_rows(h, l.input_norm), cos, sin, loc, plan, true));
        Tensor gate_up = l.gate_up(rms_norm_rows(h, l.post_norm));
        auto parts = gate_up.chunk(2, -1);
        add_into(h, l.down(at::silu(parts[0]).mul_(parts[1])));
        continue;
      }
      h = h + attention(i, l, rms_norm(h, l.input_norm), cos, sin, out_cache_loc, plan, false);
      Tensor gate_up = l.gate_up(rms_norm(h, l.post_norm));
      auto parts = gate_up.chunk(2, -1);
      h = h + l.down(at::silu(parts[0]) * parts[1]);
    }
    return h;
  }

  // Off: every layer runs its elementwise work as ATen calls (tests compare the two)
  void set_row_loops(bool on) { row_loops_ = on; }
  bool row_loops() const { return row_loops_; }

 private:
  struct Chunk {
    int64_t start, end;
    KeySource keys;
    Tensor mask;  // [1, 1, n, L] bool, or undefined: causal; grouped: [1, 1, G*n, L] additive
    int64_t grouped;  // G > 0: the queries run as [1, Hkv, G*n, D] (torch_native._PrefillChunk)
    int64_t row_prefix;  // >= 0: chunk_attention over this cached prefix (float32)
  };
  struct Plan {
    bool has_decode = false;
    Tensor decode_rows;  // undefined: every row (a decode-only batch)
    KeySource decode_keys;
    std::vector<int64_t> decode_shape;
    Tensor decode_mask;  // [B, 1, 1, L] bool or undefined
    std::vector<Chunk> chunks;
  };

  // layers/norms.py RMSNorm: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)
  Tensor rms_norm(const Tensor& x, const Tensor& weight) const {
    Tensor f = x.to(at::kFloat);
    Tensor n = f * at::rsqrt(f.pow(2).mean({-1}, true) + eps_);
    return weight * n.to(x.scalar_type());
  }

  // rms_norm of float32 rows: the sum of squares stays ATen's (its summation order), the rest
  // (/ count, + eps, rsqrt = 1 / sqrt, the two products) is one pass, as ATen rounds each step
  Tensor rms_norm_rows(const Tensor& x, const Tensor& weight) const {
    if (weight.scalar_type() != at::kFloat || !weight.is_contiguous())
      return rms_norm(x, weight);
    // ATen's mean on the CPU is its sum, then a true division by the count: the same two steps
    // here without mean's wrapper and div_ call
    Tensor ss = at::sum(x.pow(2), {-1}, true);  // [N, 1]
    Tensor out = at::empty_like(x);
    const int64_t n = x.size(0), c = x.size(1);
    const float eps = static_cast<float>(eps_);
    const float* xp = x.data_ptr<float>();
    const float* mp = ss.data_ptr<float>();
    const float count = static_cast<float>(c);
    const float* wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, n, rows_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float mean = mp[r] / count;
        const float inv = 1.0f / std::sqrt(mean + eps);
        const float* xr = xp + r * c;
        float* orow = op + r * c;
        for (int64_t j = 0; j < c; ++j) {
          const float normed = xr[j] * inv;
          orow[j] = wp[j] * normed;
        }
      }
    });
    return out;
  }

  // rows per OpenMP task: a batch-1 row runs inline (no fork/join), a prefill's rows split as
  // ATen splits an elementwise op (GRAIN_SIZE elements a task)
  static int64_t rows_grain(int64_t width) {
    return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, width));
  }

  // h += y, row-major float32 (ATen's add of two floats: one rounding)
  static void add_into(Tensor& h, const Tensor& y) {
    Tensor yc = y.contiguous();
    float* hp = h.data_ptr<float>();
    const float* yp = yc.data_ptr<float>();
    at::parallel_for(0, h.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) hp[j] = hp[j] + yp[j];
    });
  }

  // rope() of the q and k heads of qkv [N, (H + 2 Hkv) D] in one pass: q comes back as
  // [N, H, D]; the rotated k and the v rows go straight to the pool at `loc` (KVPool.store)
  Tensor rope_store(const Tensor& qkv_in, const Tensor& cos, const Tensor& sin,
                    const Tensor& loc, const Tensor& k_all, const Tensor& v_all) const {
    Tensor qkv = qkv_in.contiguous();
    const int64_t n = qkv.size(0), d = head_dim_, half = d / 2;
    const int64_t heads = num_heads_ + num_kv_heads_, width = qkv.size(1);
    const int64_t kv = num_kv_heads_ * d;
    Tensor q = at::empty({n, num_heads_, d}, qkv.options());
    const float* src = qkv.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t* lp = loc.data_ptr<int64_t>();
    float* qp = q.data_ptr<float>();
    float* kp = k_all.data_ptr<float>();
    float* vp = v_all.data_ptr<float>();
    const int64_t pool_rows = k_all.size(0);
    for (int64_t r = 0; r < n; ++r) {  // the pool rows are checked before any is written
      TORCH_CHECK(lp[r] >= 0 && lp[r] < pool_rows, "out_cache_loc ", lp[r], " outside the pool");
    }
    at::parallel_for(0, n, rows_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* row = src + r * width;
        const float* c = cp + r * d;
        const float* s = sp + r * d;
        const int64_t dst = lp[r];
        for (int64_t h = 0; h < heads; ++h) {
          const float* x = row + h * d;
          float* o = h < num_heads_ ? qp + (r * num_heads_ + h) * d
                                    : kp + dst * kv + (h - num_heads_) * d;
          for (int64_t j = 0; j < d; ++j) {
            const float rotated = j < half ? -x[j + half] : x[j - half];
            const float a = x[j] * c[j];
            const float b = rotated * s[j];
            o[j] = a + b;
          }
        }
        std::memcpy(vp + dst * kv, row + heads * d, sizeof(float) * kv);
      }
    });
    return q;
  }

  // layers/rotary.py apply_rope (rotate-half)
  static Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
    int64_t half = x.size(-1) / 2;
    Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
    return x * cos + rotated * sin;
  }

  // torch_native._sdpa without an FP8 pool: q [B, H, n, D] (gqa false: [B, Hkv, n, D]),
  // k/v [B, L, Hkv, D]
  Tensor sdpa(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
              bool gqa = true) const {
    Tensor kt = k.transpose(1, 2).to(q.scalar_type());
    Tensor vt = v.transpose(1, 2).to(q.scalar_type());
    std::optional<Tensor> m = mask.defined() ? std::optional<Tensor>(mask) : std::nullopt;
    return at::scaled_dot_product_attention(q, kt, vt, m, 0.0, !mask.defined() && causal, scale_,
                                            gqa && num_heads_ != num_kv_heads_);
  }

  // models/llama.py LlamaAttention + torch_native.TorchNativeBackend.forward
  Tensor attention(size_t i, const Layer& l, const Tensor& x, const Tensor& cos, const Tensor& sin,
                   const Tensor& out_cache_loc, const Plan& plan, bool rows) const {
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    Tensor qkv = l.qkv(x);
    const Tensor& k_all = k_flat_[i];
    const Tensor& v_all = v_flat_[i];
    Tensor q;
    if (rows && qkv.scalar_type() == at::kFloat && k_all.is_contiguous() &&
        v_all.is_contiguous()) {
      q = rope_store(qkv, cos, sin, out_cache_loc, k_all, v_all);
    } else {
      Tensor qk =
          qkv.slice(1, 0, q_size + kv_size).view({-1, num_heads_ + num_kv_heads_, head_dim_});
      auto qk_split = rope(qk, cos, sin).split({num_heads_, num_kv_heads_}, 1);
      q = qk_split[0];
      const Tensor& k = qk_split[1];
      Tensor v = qkv.slice(1, q_size + kv_size).view({-1, num_kv_heads_, head_dim_});
      // KVPool.store
      k_all.index_put_({out_cache_loc}, k.to(k_all.scalar_type()));
      v_all.index_put_({out_cache_loc}, v.to(v_all.scalar_type()));
    }
    Tensor out;
    if (plan.has_decode && !plan.decode_rows.defined() && !plan.decode_mask.defined() &&
        q.scalar_type() == at::kFloat && k_all.scalar_type() == at::kFloat) {
      // torch_native.TorchNativeBackend.forward: a decode-only step without padding
      out = decode_attention(q, gather_decode(plan, k_all), gather_decode(plan, v_all), scale_);
    } else if (plan.has_decode && !plan.decode_rows.defined()) {
      out = sdpa(q.unsqueeze(2), gather_decode(plan, k_all), gather_decode(plan, v_all),
                 plan.decode_mask, false)
                .squeeze(2);
    } else {
      out = at::empty_like(q);
      if (plan.has_decode) {
        const Tensor& rows = plan.decode_rows;
        out.index_put_({rows}, sdpa(q.index({rows}).unsqueeze(2), gather_decode(plan, k_all),
                                    gather_decode(plan, v_all), plan.decode_mask, false)
                                   .squeeze(2));
      }
      for (const Chunk& c : plan.chunks) {
        const int64_t n = c.end - c.start;
        if (c.row_prefix >= 0 && q.scalar_type() == at::kFloat &&
            k_all.scalar_type() == at::kFloat) {  // torch_native: a small chunk over its prefix
          out.slice(0, c.start, c.end)
              .copy_(chunk_attention(q.slice(0, c.start, c.end), k_all, v_all, c.keys.locs,
                                     c.row_prefix, scale_, true));
          continue;
        }
        Tensor q_c = q.slice(0, c.start, c.end).transpose(0, 1).unsqueeze(0);
        Tensor k_c = c.keys.gather(k_all).unsqueeze(0), v_c = c.keys.gather(v_all).unsqueeze(0);
        if (c.grouped > 0)  // a KV head's query heads one after the other
          q_c = q_c.reshape({1, num_kv_heads_, c.grouped * n, head_dim_});
        Tensor o = sdpa(q_c, k_c, v_c, c.mask, true, c.grouped == 0);
        out.slice(0, c.start, c.end).copy_(o.reshape({num_heads_, n, head_dim_}).transpose(0, 1));
      }
    }
    return l.o(out.reshape({-1, q_size}));
  }

  static Tensor gather_decode(const Plan& plan, const Tensor& flat) {
    Tensor keys = plan.decode_keys.gather(flat);
    if (plan.decode_keys.a >= 0) return keys.unsqueeze(0);
    return keys.view({plan.decode_shape[0], plan.decode_shape[1], flat.size(1), flat.size(2)});
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  std::vector<Tensor> k_flat_, v_flat_;
  bool row_loops_ = true;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The CPU decoder stack of a Llama-family model in one call (worker/cpu_native.py)";
  py::class_<CpuDecoder>(m, "CpuDecoder")
      .def(py::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &CpuDecoder::add_layer)
      .def("bind_pool", &CpuDecoder::bind_pool)
      .def_property("row_loops", &CpuDecoder::row_loops, &CpuDecoder::set_row_loops)
      .def("forward", &CpuDecoder::forward, py::call_guard<py::gil_scoped_release>());
  m.def("chunk_attention", &chunk_attention, py::call_guard<py::gil_scoped_release>(),
        py::arg("q"), py::arg("k_all"), py::arg("v_all"), py::arg("locs"), py::arg("prefix"),
        py::arg("scale"), py::arg("simd") = true,
        "a prefill chunk's query rows over their cached prefix, keys read through `locs`");
  m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>(),
        "one query row per sequence over all its keys: q [B, H, D], k/v [B, L, Hkv, D] float32");
  radix_cpu::bind_quant_kernels(m);
}
