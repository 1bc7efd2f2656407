// A whole transformer block's one-token decoding step in one call: what generation/fast.py's
// `_Layer.step` does in Python, with the same kernels, minus the interpreter between them.
//
// Why. With the small steps already one kernel each (decode.cpp) and the matrix products in
// qmatmul.cpp, GPT-2 small's int4 step still spent ~1 ms of its ~6 on the host: eight module calls
// and their Python wrappers per block, ~8 us each (a `qlinear` through Python is 8 us, the same op
// called from C++ well under 1). A `Block` holds one block's operands (the packed matrices, the norms'
// gains, the rotary tables) and runs its step from C++, so a step is one Python call per block.
//
// The step, exactly as `_Layer.step` (read that first; the readable forward is core/model.py):
//
//   x += pending;  h = ln1(x)                     (the previous block's output, added by this norm)
//   qkv = qkv(h), its q and k heads normed if the block has q/k norms
//   z = decode_attention(qkv, cache, ...)         (decode.cpp: rotary, cache write, attention)
//   a = out(z);  a = ln1_post(a) if present
//   parallel (GPT-NeoX):  pending = a + mlp(ln2(x))
//   sequential:           x += a;  pending = mlp(ln2(x))
//   mlp(h) = down(act(gate(h)) * up(h))  or  down(act(up(h)));  ln2_post after it if present
//
// Every product here is a packed quantized matrix (qmatmul.cpp's `qlinear`); the norms (RMSNorm,
// LayerNorm), GELU's tanh form and SwiGLU's SiLU are decode.cpp's, other activations ATen's. A block
// with anything else (float weights, adapters, other norms) keeps the Python step;
// `glasslm.generation.fast` decides.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace glasslm_kernels {

namespace {

enum NormKind : int64_t { kNoNorm = 0, kRms = 1, kLayer = 2 };
enum Activation : int64_t { kGelu = 0, kGeluTanh = 1, kRelu = 2, kSilu = 3 };
enum Slot : int64_t { kLn1 = 0, kLn1Post = 1, kLn2 = 2, kLn2Post = 3, kQNorm = 4, kKNorm = 5 };
enum Product : int64_t { kQkv = 0, kOut = 1, kGate = 2, kUp = 3, kDown = 4 };

struct Norm {
  int64_t kind = kNoNorm;
  at::Tensor weight;
  std::optional<at::Tensor> bias;
  double eps = 0;
  bool unit_offset = false;

  // norm(x), after x += pending (in place) where something is pending.
  at::Tensor operator()(at::Tensor& x, const std::optional<at::Tensor>& pending) const {
    if (kind == kNoNorm) {
      if (pending) x.add_(*pending);
      return x;
    }
    if (kind == kRms) {
      return pending ? add_rms_norm(x, *pending, weight, eps, unit_offset) : rms_norm(x, weight, eps, unit_offset);
    }
    return pending ? add_layer_norm(x, *pending, weight, bias, eps) : layer_norm(x, weight, bias, eps);
  }
};

// One product: a packed matrix, or (a row split: transforms/split.py) several whose outputs sit side by side.
struct Matrix {
  std::vector<at::Tensor> operands;     // what `parts` points into, kept alive here
  std::vector<std::shared_ptr<const Weights>> parts;  // checked once, in add_matrix; none: no such product
  std::vector<const Weights*> views;

  bool present() const { return !parts.empty(); }
  at::Tensor operator()(const at::Tensor& x) const {
    // Named as the op a Python call would run, so torch.profiler counts it as one (benchmarks).
    RECORD_FUNCTION("glasslm_kernels::qlinear", c10::ArrayRef<const c10::IValue>{});
    return qlinear_parts(x, views);
  }
};

at::Tensor activate(int64_t kind, at::Tensor x) {
  switch (kind) {
    case kGelu: return at::gelu(x);
    case kGeluTanh: gelu_tanh_in_place(x); return x;  // x is a product's fresh output
    case kRelu: return at::relu(x);
    default: return at::silu(x);
  }
}

}  // namespace

struct Block : torch::CustomClassHolder {
  Norm norms[6];
  Matrix products[5];
  std::optional<at::Tensor> cos, sin;
  int64_t heads = 0, kv_heads = 0, window = 0, activation = kGelu;
  double scale = 1.0;
  bool parallel = false;

  void set_norm(int64_t which, int64_t kind, const at::Tensor& weight, const std::optional<at::Tensor>& bias, double eps,
                bool unit_offset) {
    TORCH_CHECK(which >= kLn1 && which <= kKNorm && kind >= kNoNorm && kind <= kLayer, "Block.set_norm: bad slot or kind");
    TORCH_CHECK(kind == kNoNorm || (weight.scalar_type() == at::kFloat && weight.is_contiguous()),
                "Block.set_norm: the gain must be contiguous float32");
    norms[which] = Norm{kind, weight, bias, eps, unit_offset};
  }

  // Adds a part to product `which` (a row split's next rows; the first call for a plain matrix).
  void add_matrix(int64_t which, const at::Tensor& levels, const std::optional<at::Tensor>& scales,
                  const std::optional<at::Tensor>& mins,
                  const std::optional<at::Tensor>& super_scales, const std::optional<at::Tensor>& super_mins, int64_t bits,
                  int64_t offset, int64_t group_size, int64_t super_groups, int64_t d_out,
                  const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(which >= kQkv && which <= kDown, "Block.add_matrix: bad slot");
    Matrix& matrix = products[which];
    matrix.operands.push_back(levels);
    for (const auto* optional : {&scales, &mins, &super_scales, &super_mins, &row_scale, &bias}) {
      if (*optional) matrix.operands.push_back(**optional);
    }
    matrix.parts.push_back(checked_weights(levels, scales, mins, super_scales, super_mins, bits, offset, group_size,
                                           super_groups, d_out, row_scale, bias));
    matrix.views.push_back(matrix.parts.back().get());  // (each call checks every part's width against x's)
  }

  void set_attention(const std::optional<at::Tensor>& cos_, const std::optional<at::Tensor>& sin_, int64_t heads_,
                     int64_t kv_heads_, double scale_, int64_t window_) {
    cos = cos_, sin = sin_, heads = heads_, kv_heads = kv_heads_, scale = scale_, window = window_;
  }

  void set_mlp(int64_t activation_, bool parallel_) {
    TORCH_CHECK(activation_ >= kGelu && activation_ <= kSilu, "Block.set_mlp: unknown activation ", activation_);
    activation = activation_, parallel = parallel_;
  }

  // (x with `pending` added, this block's output still to add): `_Layer.step`'s contract.
  std::tuple<at::Tensor, at::Tensor> step(at::Tensor x, const std::optional<at::Tensor>& pending, at::Tensor keys,
                                          at::Tensor values, int64_t slot, const at::Tensor& positions,
                                          const std::optional<at::Tensor>& key_mask) const {
    RECORD_FUNCTION("glasslm_kernels::Block.step", c10::ArrayRef<const c10::IValue>{});
    const at::Tensor h = norms[kLn1](x, pending);
    at::Tensor qkv = products[kQkv](h).reshape({x.size(0), -1});
    if (norms[kQNorm].kind != kNoNorm) qkv = normed_queries_and_keys(qkv);
    const at::Tensor z = attention(qkv, keys, values, slot, positions, key_mask);
    at::Tensor attended = products[kOut](z.unsqueeze(1));
    if (norms[kLn1Post].kind != kNoNorm) attended = norms[kLn1Post](attended, std::nullopt);
    if (!products[kDown].present()) return {x, attended};
    if (parallel) return {x, attended + mlp(norms[kLn2](x, std::nullopt))};
    return {x, mlp(norms[kLn2](x, attended))};
  }

 private:
  // q|k|v with each query and key head normed over its d_head features (Qwen3, Gemma 3), before rotary.
  at::Tensor normed_queries_and_keys(const at::Tensor& qkv) const {
    const at::Tensor heads = qkv.view({qkv.size(0), this->heads + 2 * kv_heads, -1});
    at::Tensor q = heads.narrow(1, 0, this->heads).contiguous(), k = heads.narrow(1, this->heads, kv_heads).contiguous();
    return at::cat({norms[kQNorm](q, std::nullopt), norms[kKNorm](k, std::nullopt), heads.narrow(1, this->heads + kv_heads, kv_heads)},
                   1).reshape({qkv.size(0), -1});
  }

  at::Tensor attention(const at::Tensor& qkv, at::Tensor& keys, at::Tensor& values, int64_t slot, const at::Tensor& positions,
                       const std::optional<at::Tensor>& key_mask) const {
    RECORD_FUNCTION("glasslm_kernels::decode_attention", c10::ArrayRef<const c10::IValue>{});
    const int64_t rotary_dims = cos ? 2 * cos->size(-1) : 0;
    return decode_attention(qkv, keys, values, slot, positions, cos, sin, heads, kv_heads, rotary_dims, scale, key_mask,
                            window);
  }

  at::Tensor mlp(const at::Tensor& h) const {
    const bool gated = products[kGate].present();
    at::Tensor hidden = products[gated ? kGate : kUp](h);
    if (gated && activation == kSilu) {
      silu_mul_in_place(hidden, products[kUp](h));  // SwiGLU in one pass
    } else {
      hidden = activate(activation, hidden);
      if (gated) hidden = hidden.mul_(products[kUp](h));
    }
    at::Tensor out = products[kDown](hidden);
    return norms[kLn2Post].kind != kNoNorm ? norms[kLn2Post](out, std::nullopt) : out;
  }
};

// Every block of a model, stepped in one call: a custom class's method costs ~6 us to call from
// Python, so GPT-2 small's twelve blocks cost ~0.1 ms a token more as twelve calls than as one.
struct Stack : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<Block>> blocks;

  void add(const c10::intrusive_ptr<Block>& block) { blocks.push_back(block); }

  // (x with every block's output but the last added, the last block's output): Block.step in turn.
  std::tuple<at::Tensor, at::Tensor> step(at::Tensor x, const std::vector<at::Tensor>& keys,
                                          const std::vector<at::Tensor>& values, int64_t slot,
                                          const at::Tensor& positions, const std::optional<at::Tensor>& key_mask) const {
    TORCH_CHECK(!blocks.empty() && keys.size() == blocks.size() && values.size() == blocks.size(), "Stack.step: ",
                blocks.size(), " blocks, ", keys.size(), " key and ", values.size(), " value caches");
    std::optional<at::Tensor> pending;
    for (size_t i = 0; i < blocks.size(); ++i) {
      std::tie(x, pending) = blocks[i]->step(x, pending, keys[i], values[i], slot, positions, key_mask);
    }
    return {x, *pending};
  }
};

TORCH_LIBRARY_FRAGMENT(glasslm_kernels, m) {
  m.class_<Block>("Block")
      .def(torch::init<>())
      .def("set_norm", &Block::set_norm)
      .def("add_matrix", &Block::add_matrix)
      .def("set_attention", &Block::set_attention)
      .def("set_mlp", &Block::set_mlp)
      .def("step", &Block::step);
  // After Block: its methods name Block's type.
  m.class_<Stack>("Stack").def(torch::init<>()).def("add", &Stack::add).def("step", &Stack::step);
}

}  // namespace glasslm_kernels
