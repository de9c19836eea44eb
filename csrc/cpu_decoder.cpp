// The CPU forward of a Llama-family decoder stack in one call (radix_runtime/worker/cpu_native.py).
//
// The same ATen operations, in the same order and on the same dtypes, as the Python modules of
// models/llama.py, layers/ and attention/torch_native.py run, so the outputs are bitwise the same;
// what it removes is the Python interpreter and nn.Module dispatch around each of the ~60 small
// operations of a layer, which dominate a batch-1 decode step of a small model on the CPU
// (docs/decisions.md, "The CPU decoder step in C++").
#include <torch/extension.h>

#include "cpu_quant_kernels.h"

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

}  // namespace

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
                                        std::optional<Tensor>, std::optional<Tensor>, int64_t>>
                     prefills) {
    // decode: (rows, span_a, span_b, kv_locs, batch, max_len, mask)
    // prefill chunk: (start, end, span_a, span_b, kv_locs, mask, grouped)
    Plan plan;
    if (decode) {
      auto& [rows, a, b, locs, batch, max_len, mask] = *decode;
      plan.has_decode = true;
      plan.decode_rows = rows.value_or(Tensor());
      plan.decode_keys = KeySource{a, b, locs.value_or(Tensor())};
      plan.decode_shape = {batch, max_len};
      plan.decode_mask = mask.value_or(Tensor());
    }
    for (auto& [start, end, a, b, locs, mask, grouped] : prefills) {
      Tensor m = mask.has_value() ? mask->unsqueeze(0).unsqueeze(0) : Tensor();
      plan.chunks.push_back(
          Chunk{start, end, KeySource{a, b, locs.value_or(Tensor())}, m, grouped});
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

  // rms_norm of float32 rows: the reduction stays ATen's (its summation order), the rest
  // (+ eps, rsqrt = 1 / sqrt, the two products) is one pass, as ATen rounds each step
  Tensor rms_norm_rows(const Tensor& x, const Tensor& weight) const {
    if (weight.scalar_type() != at::kFloat || !weight.is_contiguous())
      return rms_norm(x, weight);
    Tensor ms = x.pow(2).mean({-1}, true);  // [N, 1]
    Tensor out = at::empty_like(x);
    const int64_t n = x.size(0), c = x.size(1);
    const float eps = static_cast<float>(eps_);
    const float* xp = x.data_ptr<float>();
    const float* mp = ms.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, n, rows_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float inv = 1.0f / std::sqrt(mp[r] + eps);
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
    if (plan.has_decode && !plan.decode_rows.defined()) {
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
        Tensor q_c = q.slice(0, c.start, c.end).transpose(0, 1).unsqueeze(0);
        Tensor k_c = c.keys.gather(k_all).unsqueeze(0), v_c = c.keys.gather(v_all).unsqueeze(0);
        if (c.grouped > 0) {  // a KV head's query heads one after the other
          q_c = q_c.reshape({1, num_kv_heads_, c.grouped * n, head_dim_});
          Tensor o = sdpa(q_c, k_c, v_c, c.mask, true, false).reshape({num_heads_, n, head_dim_});
          out.slice(0, c.start, c.end).copy_(o.transpose(0, 1));
        } else {
          out.slice(0, c.start, c.end).copy_(sdpa(q_c, k_c, v_c, c.mask, true)[0].transpose(0, 1));
        }
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
  radix_cpu::bind_quant_kernels(m);
}
