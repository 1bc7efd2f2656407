// What the kernels' files call across one another: qmatmul.cpp's products of checked weights and
// decode.cpp's small steps, used by block.cpp (a block's decoding step) and experts.cpp (a mixture's
// experts). Each defining file includes this too, so the compiler holds every declaration here to its
// definition.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace glasslm_kernels {

// qmatmul.cpp
struct Weights;  // one matrix's operands, checked once (its tensors kept alive by the caller)
std::shared_ptr<const Weights> checked_weights(const at::Tensor& levels, const std::optional<at::Tensor>& scales,
                                               const std::optional<at::Tensor>& mins,
                                               const std::optional<at::Tensor>& super_scales,
                                               const std::optional<at::Tensor>& super_mins, int64_t bits, int64_t offset,
                                               int64_t group_size, int64_t super_groups, int64_t d_out,
                                               const std::optional<at::Tensor>& row_scale,
                                               const std::optional<at::Tensor>& bias);
at::Tensor qlinear_parts(const at::Tensor& x, const std::vector<const Weights*>& parts);

// decode.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps, bool unit_offset);
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, double eps);
at::Tensor add_layer_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, double eps);
void gelu_tanh_in_place(at::Tensor& x);
void silu_mul_in_place(at::Tensor& gate, const at::Tensor& up);
at::Tensor decode_attention(const at::Tensor& qkv, at::Tensor& keys, at::Tensor& values, int64_t slot,
                            const at::Tensor& positions, const std::optional<at::Tensor>& cos,
                            const std::optional<at::Tensor>& sin, int64_t heads, int64_t kv_heads, int64_t rotary_dims,
                            double scale, const std::optional<at::Tensor>& key_mask, int64_t window);

}  // namespace glasslm_kernels
