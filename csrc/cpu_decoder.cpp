// The CPU forward of a Llama-family decoder stack in one call (radix_runtime/worker/cpu_native.py).
//
// The same ATen operations, in the same order and on the same dtypes, as the Python modules of
// models/llama.py, layers/ and attention/torch_native.py run, so the outputs are bitwise the same;
// what it removes is the Python interpreter and nn.Module dispatch around each of the ~60 small
// operations of a layer, which dominate a batch-1 decode step of a small model on the CPU
// (docs/decisions.md, "The CPU decoder step in C++").
#include <torch/extension.h>

#include "cpu_quant_kernels.h"

#include <optional>
#include <tuple>
#include <vector>

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
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      h = h + attention(i, l, rms_norm(h, l.input_norm), cos, sin, out_cache_loc, plan);
      Tensor gate_up = l.gate_up(rms_norm(h, l.post_norm));
      auto parts = gate_up.chunk(2, -1);
      h = h + l.down(at::silu(parts[0]) * parts[1]);
    }
    return h;
  }

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
                   const Tensor& out_cache_loc, const Plan& plan) const {
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    Tensor qkv = l.qkv(x);
    Tensor qk = qkv.slice(1, 0, q_size + kv_size).view({-1, num_heads_ + num_kv_heads_, head_dim_});
    auto qk_split = rope(qk, cos, sin).split({num_heads_, num_kv_heads_}, 1);
    const Tensor& q = qk_split[0];
    const Tensor& k = qk_split[1];
    Tensor v = qkv.slice(1, q_size + kv_size).view({-1, num_kv_heads_, head_dim_});
    const Tensor& k_all = k_flat_[i];
    const Tensor& v_all = v_flat_[i];
    // KVPool.store
    k_all.index_put_({out_cache_loc}, k.to(k_all.scalar_type()));
    v_all.index_put_({out_cache_loc}, v.to(v_all.scalar_type()));
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
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The CPU decoder stack of a Llama-family model in one call (worker/cpu_native.py)";
  py::class_<CpuDecoder>(m, "CpuDecoder")
      .def(py::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &CpuDecoder::add_layer)
      .def("bind_pool", &CpuDecoder::bind_pool)
      .def("forward", &CpuDecoder::forward, py::call_guard<py::gil_scoped_release>());
  radix_cpu::bind_quant_kernels(m);
}
