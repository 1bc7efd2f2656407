// A mixture of experts' feed-forward for a few rows (a decoding step), in one call: each row goes
// through the experts its router chose, and only those experts' matrices are read.
//
// The readable definition is experts_reference in kernels/experts.py (and core/moe.py's MoE): for a
// row x with chosen experts e_j and weights w_j,
//
//   y = sum_j w_j * down_{e_j}( silu(gate_{e_j} x) * up_{e_j} x )
//
// added in increasing expert id from zero, as MoE.experts_grouped adds them (so the float32 sums
// come in the same order). Each expert's matrices are panels of the stacked matrix a GGUF file's
// ffn_gate_exps / ffn_up_exps / ffn_down_exps make (transforms/experts.py's ExpertBlocks): expert e
// is its own packed matrix, a view of its rows' panels, multiplied by qmatmul.cpp's kernels (gate
// and up as one product of two matrices side by side: one rounding of x to int8 for both). With at
// least as many chosen experts as threads, the threads take whole experts (one parallel region a
// row); with fewer, each product is threaded over its panels of rows.
//
// Why in C++: OLMoE's shape routes a token to 8 of 64 experts in each of 16 layers; three products
// per expert through Python would be ~400 calls a token at ~8 us each.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"

namespace glasslm_kernels {

namespace {
enum Projection : int64_t { kGate = 0, kUp = 1, kDown = 2 };
}  // namespace

struct Experts : torch::CustomClassHolder {
  std::vector<at::Tensor> operands;  // what the matrices point into, kept alive here
  std::vector<std::shared_ptr<const Weights>> matrices[3];  // [projection][expert]
  int64_t d_expert = 0, d_model = 0;

  // Expert `expert`'s matrix of `projection` (experts are added in order, 0 first).
  void add(int64_t projection, int64_t expert, const at::Tensor& levels, const std::optional<at::Tensor>& scales,
           const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& super_scales,
           const std::optional<at::Tensor>& super_mins, int64_t bits, int64_t offset, int64_t group_size,
           int64_t super_groups, int64_t d_out, const std::optional<at::Tensor>& row_scale) {
    TORCH_CHECK(projection >= kGate && projection <= kDown, "Experts.add: projection is 0 (gate), 1 (up) or 2 (down)");
    auto& list = matrices[projection];
    TORCH_CHECK(expert == static_cast<int64_t>(list.size()), "Experts.add: expert ", expert, " added out of order");
    operands.push_back(levels);
    for (const auto* optional : {&scales, &mins, &super_scales, &super_mins, &row_scale}) {
      if (*optional) operands.push_back(**optional);
    }
    list.push_back(checked_weights(levels, scales, mins, super_scales, super_mins, bits, offset, group_size, super_groups,
                                   d_out, row_scale, std::nullopt));
    if (projection == kDown) d_model = d_out;
    else d_expert = d_out;
  }

  int64_t count() const { return static_cast<int64_t>(matrices[kGate].size()); }

  // x (rows, d_model) float32; experts (rows, k) int64 ids; weights (rows, k) float32 -> (rows, d_model).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights) const {
    RECORD_FUNCTION("glasslm_kernels::Experts.forward", c10::ArrayRef<const c10::IValue>{});
    const int64_t n = count();
    TORCH_CHECK(n > 0 && static_cast<int64_t>(matrices[kUp].size()) == n && static_cast<int64_t>(matrices[kDown].size()) == n,
                "Experts.forward: every expert needs its gate, up and down matrices");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == d_model,
                "Experts.forward: x must be float32 (rows, ", d_model, "), got ", x.scalar_type(), " ", x.sizes());
    TORCH_CHECK(experts.dim() == 2 && experts.scalar_type() == at::kLong && experts.size(0) == x.size(0) &&
                    weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat,
                "Experts.forward: experts (int64) and weights (float32) must both be (rows, k)");
    const at::Tensor ids = experts.contiguous(), w = weights.contiguous(), rows = x.contiguous();
    const int64_t k = ids.size(1);
    const int64_t* id = ids.const_data_ptr<int64_t>();
    const float* weight = w.const_data_ptr<float>();
    at::Tensor out = at::zeros({rows.size(0), d_model}, rows.options());
    std::vector<std::pair<int64_t, float>> chosen(k);
    for (int64_t r = 0; r < rows.size(0); ++r) {
      for (int64_t j = 0; j < k; ++j) {
        chosen[j] = {id[r * k + j], weight[r * k + j]};
        TORCH_CHECK(chosen[j].first >= 0 && chosen[j].first < n, "Experts.forward: expert id ", chosen[j].first,
                    " is not one of the ", n, " experts");
      }
      // In increasing expert id, as MoE.experts_grouped adds them (stable: a repeated id keeps its order).
      std::stable_sort(chosen.begin(), chosen.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      const at::Tensor row = rows.narrow(0, r, 1);
      std::vector<at::Tensor> downs(k);  // each chosen expert's output, (1, d_model)
      auto run = [&](int64_t j) { downs[j] = expert_output(row, chosen[j].first); };
      if (k >= at::get_num_threads()) {
        // A thread per expert (or several), each product whole on its thread (nested, it runs inline):
        // one parallel region a row instead of two per expert, whose start and end cost more than
        // a decoding step's small products gain from being split (OLMoE's shape: 16 a layer).
        at::parallel_for(0, k, 1, [&](int64_t begin, int64_t end) {
          for (int64_t j = begin; j < end; ++j) run(j);
        });
      } else {
        for (int64_t j = 0; j < k; ++j) run(j);  // (each product split over the threads itself)
      }
      float* y = out.mutable_data_ptr<float>() + r * d_model;
      for (int64_t j = 0; j < k; ++j) {
        const float* d = downs[j].const_data_ptr<float>();
        const float scale = chosen[j].second;
        // y + (d * w): two roundings, as the readable sum (built with -ffp-contract=off).
        for (int64_t i = 0; i < d_model; ++i) y[i] = y[i] + d[i] * scale;
      }
    }
    return out;
  }

 private:
  // down_e(silu(gate_e x) * up_e x) for one row x (1, d_model): gate and up as one product of two matrices.
  at::Tensor expert_output(const at::Tensor& row, int64_t e) const {
    at::Tensor hidden = qlinear_parts(row, {matrices[kGate][e].get(), matrices[kUp][e].get()});  // (1, 2 d_expert)
    at::Tensor gate = hidden.narrow(1, 0, d_expert);
    silu_mul_in_place(gate, hidden.narrow(1, d_expert, d_expert));
    return qlinear_parts(gate, {matrices[kDown][e].get()});  // (1, d_model)
  }
};

TORCH_LIBRARY_FRAGMENT(glasslm_kernels, m) {
  m.class_<Experts>("Experts")
      .def(torch::init<>())
      .def("add", &Experts::add)
      .def("count", &Experts::count)
      .def("forward", &Experts::forward);
}

}  // namespace glasslm_kernels
