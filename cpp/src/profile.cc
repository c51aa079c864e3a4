#include "zellige/profile.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <stdexcept>

namespace zellige {

void Table::validate(const std::string& name) const {
  if (x.size() != y.size()) {
    throw std::invalid_argument("profile table '" + name + "': x has " + std::to_string(x.size()) +
                                " entries but y has " + std::to_string(y.size()));
  }
  for (size_t i = 0; i < x.size(); ++i) {
    if (!(x[i] > 0) || !(y[i] > 0) || !std::isfinite(x[i]) || !std::isfinite(y[i])) {
      throw std::invalid_argument("profile table '" + name + "': entry " + std::to_string(i) +
                                  " is not a positive finite (x, y) pair");
    }
    if (i > 0 && !(x[i] > x[i - 1])) {
      throw std::invalid_argument("profile table '" + name + "': x must be strictly increasing");
    }
  }
  if (source != "measured" && source != "seeded" && source != "analytic") {
    throw std::invalid_argument("profile table '" + name + "': source '" + source +
                                "' is not one of measured, seeded, analytic");
  }
}

double Table::operator()(double at) const {
  assert(!x.empty() && at > 0);
  if (x.size() == 1) return y[0];
  // Segment [i, i + 1] containing `at`; the end segments extend beyond the sampled range.
  const auto upper = std::upper_bound(x.begin() + 1, x.end() - 1, at);
  const size_t i = static_cast<size_t>(upper - x.begin()) - 1;
  const double slope = std::log(y[i + 1] / y[i]) / std::log(x[i + 1] / x[i]);
  return y[i] * std::pow(at / x[i], slope);
}

void HardwareProfile::validate() const {
  if (!(matmul_flops_per_s > 0) || !(attention_flops_per_s > 0) || !(memory_bytes_per_s > 0)) {
    throw std::invalid_argument(
        "profile: matmul_flops_per_s, attention_flops_per_s and memory_bytes_per_s must be > 0");
  }
  if (attention_head_dim <= 0)
    throw std::invalid_argument("profile: attention_head_dim must be > 0");
  attention_forward_s_per_head.validate("attention_forward_s_per_head");
  attention_backward_s_per_head.validate("attention_backward_s_per_head");
  matmul_forward_flops_per_s.validate("matmul_forward_flops_per_s");
  matmul_backward_flops_per_s.validate("matmul_backward_flops_per_s");
  if (attention_call_forward_s.size() != attention_call_lengths.size() ||
      attention_call_backward_s.size() != attention_call_lengths.size()) {
    throw std::invalid_argument(
        "profile: attention_call_lengths, attention_call_forward_s and attention_call_backward_s "
        "differ in length");
  }
  for (size_t i = 0; i < attention_call_lengths.size(); ++i) {
    if (!(attention_call_lengths[i] > 0) ||
        (i > 0 && !(attention_call_lengths[i] > attention_call_lengths[i - 1]))) {
      throw std::invalid_argument("profile: attention_call_lengths must be > 0 and increasing");
    }
    const std::string at = "[" + std::to_string(i) + "]";
    attention_call_forward_s[i].validate("attention_call_forward_s" + at);
    attention_call_backward_s[i].validate("attention_call_backward_s" + at);
    if (attention_call_forward_s[i].empty() || attention_call_backward_s[i].empty()) {
      throw std::invalid_argument("profile: attention call tables" + at + " must not be empty");
    }
  }
  if (exchange_group_sizes.size() != exchange_intra_node_s.size()) {
    throw std::invalid_argument(
        "profile: exchange_group_sizes and exchange_intra_node_s differ in length");
  }
  for (size_t i = 0; i < exchange_group_sizes.size(); ++i) {
    if (exchange_group_sizes[i] < 2) {
      throw std::invalid_argument("profile: exchange group sizes must be >= 2");
    }
    exchange_intra_node_s[i].validate("exchange_intra_node_s[" +
                                      std::to_string(exchange_group_sizes[i]) + "]");
  }
  if (!(ulysses_layout_s_per_byte >= 0) || !std::isfinite(ulysses_layout_s_per_byte)) {
    throw std::invalid_argument("profile: ulysses_layout_s_per_byte must be >= 0");
  }
  if (!(ring_layout_s_per_byte >= 0) || !std::isfinite(ring_layout_s_per_byte)) {
    throw std::invalid_argument("profile: ring_layout_s_per_byte must be >= 0");
  }
  if (!(exchange_overlap >= 0 && exchange_overlap < 1)) {
    throw std::invalid_argument("profile: exchange_overlap must be in [0, 1)");
  }
  if (memory_models.size() != activation_bytes_per_token_layer.size() ||
      memory_models.size() != checkpoint_bytes_per_token_layer.size()) {
    throw std::invalid_argument(
        "profile: memory_models, activation_bytes_per_token_layer and "
        "checkpoint_bytes_per_token_layer differ in length");
  }
  for (const auto* optional :
       {&backward_bytes_per_token_layer, &text_bytes_per_token_layer, &step_fixed_bytes,
        &launch_s_per_layer, &launch_s_per_attention_call}) {
    if (!optional->empty() && optional->size() != memory_models.size()) {
      throw std::invalid_argument(
          "profile: backward_bytes_per_token_layer, text_bytes_per_token_layer, "
          "step_fixed_bytes, launch_s_per_layer and launch_s_per_attention_call must be empty "
          "or as long as memory_models");
    }
    for (double value : *optional) {
      if (!(value >= 0)) {
        throw std::invalid_argument("profile: per-model rows must be >= 0");
      }
    }
  }
  for (const auto* signed_row : {&ulysses_bytes_per_token, &ring_bytes_per_token}) {
    if (!signed_row->empty() && signed_row->size() != memory_models.size()) {
      throw std::invalid_argument(
          "profile: ulysses_bytes_per_token and ring_bytes_per_token must be empty or as long "
          "as memory_models");
    }
    for (double value : *signed_row) {
      if (!std::isfinite(value)) {
        throw std::invalid_argument("profile: per-model rows must be finite");
      }
    }
  }
  for (size_t i = 0; i < memory_models.size(); ++i) {
    if (activation_bytes_per_token_layer[i] < 0 || checkpoint_bytes_per_token_layer[i] < 0 ||
        (!backward_bytes_per_token_layer.empty() && backward_bytes_per_token_layer[i] < 0) ||
        (!text_bytes_per_token_layer.empty() && text_bytes_per_token_layer[i] < 0)) {
      throw std::invalid_argument("profile: memory bytes per token of '" + memory_models[i] +
                                  "' must be >= 0");
    }
  }
  if (runtime_reserved_bytes < 0) {
    throw std::invalid_argument("profile: runtime_reserved_bytes must be >= 0");
  }
}

HardwareProfile analytic_profile(const std::string& device_name, double matmul_flops_per_s,
                                 double attention_flops_per_s, double memory_bytes_per_s) {
  HardwareProfile profile;
  profile.device_name = device_name;
  profile.created = "analytic";
  profile.matmul_flops_per_s = matmul_flops_per_s;
  profile.attention_flops_per_s = attention_flops_per_s;
  profile.memory_bytes_per_s = memory_bytes_per_s;
  profile.validate();
  return profile;
}

}  // namespace zellige
