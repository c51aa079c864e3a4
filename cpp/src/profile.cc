#include "zellige/profile.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace zellige {
namespace {

std::string number_text(double value) {  // %g, without iostreams (see test_core_sources.py)
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
}

std::string range_text(double low, double high) {
  return "[" + number_text(low) + ", " + number_text(high) + "]";
}

// "[i]", built by appending: `"[" + std::to_string(i) + "]"` draws a false -Wrestrict warning
// from GCC 12's inlined operator+(const char*, std::string&&).
std::string index_text(size_t i) {
  std::string text("[");
  text += std::to_string(i);
  text += ']';
  return text;
}


void require_in(double value, double low, double high, const std::string& what) {
  if (!(value >= low && value <= high)) {  // NaN fails too
    throw std::invalid_argument("profile: " + what + " = " + number_text(value) +
                                " is outside its physical range " + range_text(low, high));
  }
}

// A validated table's samples inside x in [1, kMaxTableX] and y in [y_low, y_high].
void require_table_in(const Table& table, const std::string& name, double y_low, double y_high) {
  for (size_t i = 0; i < table.x.size(); ++i) {
    const std::string at = index_text(i);
    require_in(table.x[i], 1.0, kMaxTableX, name + ".x" + at);
    require_in(table.y[i], y_low, y_high, name + ".y" + at);
  }
}

}  // namespace

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
  require_in(matmul_flops_per_s, kMinRatePerS, kMaxRatePerS, "matmul_flops_per_s");
  require_in(attention_flops_per_s, kMinRatePerS, kMaxRatePerS, "attention_flops_per_s");
  require_in(memory_bytes_per_s, kMinRatePerS, kMaxRatePerS, "memory_bytes_per_s");
  if (attention_head_dim <= 0 || attention_head_dim > kMaxHeadDim) {
    throw std::invalid_argument("profile: attention_head_dim must be in [1, " +
                                std::to_string(kMaxHeadDim) + "], got " +
                                std::to_string(attention_head_dim));
  }
  for (const auto& [table, name] :
       {std::pair{&attention_forward_s_per_head, "attention_forward_s_per_head"},
        std::pair{&attention_backward_s_per_head, "attention_backward_s_per_head"}}) {
    table->validate(name);
    require_table_in(*table, name, kMinTableSeconds, kMaxTableSeconds);
  }
  for (const auto& [table, name] :
       {std::pair{&matmul_forward_flops_per_s, "matmul_forward_flops_per_s"},
        std::pair{&matmul_backward_flops_per_s, "matmul_backward_flops_per_s"}}) {
    table->validate(name);
    require_table_in(*table, name, kMinRatePerS, kMaxRatePerS);
  }
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
    const std::string at = index_text(i);
    require_in(attention_call_lengths[i], 1.0, kMaxTableX, "attention_call_lengths" + at);
    for (const auto& [tables, name] :
         {std::pair{&attention_call_forward_s, "attention_call_forward_s"},
          std::pair{&attention_call_backward_s, "attention_call_backward_s"}}) {
      (*tables)[i].validate(name + at);
      require_table_in((*tables)[i], name + at, kMinTableSeconds, kMaxTableSeconds);
    }
    if (attention_call_forward_s[i].empty() || attention_call_backward_s[i].empty()) {
      throw std::invalid_argument("profile: attention call tables" + at + " must not be empty");
    }
  }
  if (exchange_group_sizes.size() != exchange_intra_node_s.size()) {
    throw std::invalid_argument(
        "profile: exchange_group_sizes and exchange_intra_node_s differ in length");
  }
  for (size_t i = 0; i < exchange_group_sizes.size(); ++i) {
    if (exchange_group_sizes[i] < 2 || exchange_group_sizes[i] > kMaxTableX) {
      throw std::invalid_argument("profile: exchange group sizes must be >= 2");
    }
    const std::string name =
        "exchange_intra_node_s" + index_text(static_cast<size_t>(exchange_group_sizes[i]));
    exchange_intra_node_s[i].validate(name);
    require_table_in(exchange_intra_node_s[i], name, kMinTableSeconds, kMaxTableSeconds);
  }
  require_in(ulysses_layout_s_per_byte, 0.0, kMaxLayoutSecondsPerByte, "ulysses_layout_s_per_byte");
  require_in(ring_layout_s_per_byte, 0.0, kMaxLayoutSecondsPerByte, "ring_layout_s_per_byte");
  if (attention_streams < 1 || attention_streams > 8) {
    throw std::invalid_argument("profile: attention_streams must be an integer from 1 to 8, got " +
                                std::to_string(attention_streams));
  }
  if (!(attention_stream_overlap >= 0 && attention_stream_overlap <= 1)) {
    throw std::invalid_argument("profile: attention_stream_overlap must be in [0, 1]");
  }
  if (!(exchange_overlap >= 0 && exchange_overlap < 1)) {
    throw std::invalid_argument("profile: exchange_overlap must be in [0, 1)");
  }
  for (const auto& [tables, name] :
       {std::pair{&model_matmul_forward_flops_per_s, "model_matmul_forward_flops_per_s"},
        std::pair{&model_matmul_backward_flops_per_s, "model_matmul_backward_flops_per_s"}}) {
    if (!tables->empty() && tables->size() != memory_models.size()) {
      throw std::invalid_argument(std::string("profile: ") + name +
                                  " must be empty or hold one table per memory model");
    }
    for (size_t i = 0; i < tables->size(); ++i) {
      const std::string at = name + index_text(i) + " (" + memory_models[i] + ")";
      (*tables)[i].validate(at);
      require_table_in((*tables)[i], at, kMinRatePerS, kMaxRatePerS);
    }
  }
  if (!backward_peak_bytes.empty() && backward_peak_bytes.size() != memory_models.size()) {
    throw std::invalid_argument(
        "profile: backward_peak_bytes must be empty or hold one table per memory model");
  }
  for (size_t i = 0; i < backward_peak_bytes.size(); ++i) {
    const std::string at = "backward_peak_bytes" + index_text(i) + " (" + memory_models[i] + ")";
    backward_peak_bytes[i].validate(at);
    require_table_in(backward_peak_bytes[i], at, 1.0, kMaxProfileBytes);
  }
  if (memory_models.size() != activation_bytes_per_token_layer.size() ||
      memory_models.size() != checkpoint_bytes_per_token_layer.size()) {
    throw std::invalid_argument(
        "profile: memory_models, activation_bytes_per_token_layer and "
        "checkpoint_bytes_per_token_layer differ in length");
  }
  for (const auto* optional :
       {&backward_bytes_per_token_layer, &text_bytes_per_token_layer, &step_fixed_bytes,
        &reduce_fixed_bytes, &reduce_bytes_per_token, &attention_phase_bytes_per_token,
        &launch_s_per_layer, &launch_s_per_attention_call}) {
    if (!optional->empty() && optional->size() != memory_models.size()) {
      throw std::invalid_argument(
          "profile: backward_bytes_per_token_layer, text_bytes_per_token_layer, "
          "step_fixed_bytes, reduce_fixed_bytes, reduce_bytes_per_token, "
          "attention_phase_bytes_per_token, launch_s_per_layer and launch_s_per_attention_call "
          "must be empty or as long as memory_models");
    }
    for (double value : *optional) {
      if (!(value >= 0)) {
        throw std::invalid_argument("profile: per-model rows must be >= 0");
      }
    }
  }
  for (size_t i = 0; i < memory_models.size(); ++i) {
    const std::string of = index_text(i) + " (" + memory_models[i] + ")";
    for (const auto& [row, name, high] :
         {std::tuple{&activation_bytes_per_token_layer, "activation_bytes_per_token_layer",
                     kMaxBytesPerToken},
          std::tuple{&checkpoint_bytes_per_token_layer, "checkpoint_bytes_per_token_layer",
                     kMaxBytesPerToken},
          std::tuple{&backward_bytes_per_token_layer, "backward_bytes_per_token_layer",
                     kMaxBytesPerToken},
          std::tuple{&text_bytes_per_token_layer, "text_bytes_per_token_layer", kMaxBytesPerToken},
          std::tuple{&step_fixed_bytes, "step_fixed_bytes", kMaxProfileBytes},
          std::tuple{&reduce_fixed_bytes, "reduce_fixed_bytes", kMaxProfileBytes},
          std::tuple{&reduce_bytes_per_token, "reduce_bytes_per_token", kMaxBytesPerToken},
          std::tuple{&attention_phase_bytes_per_token, "attention_phase_bytes_per_token",
                     kMaxBytesPerToken},
          std::tuple{&launch_s_per_layer, "launch_s_per_layer", kMaxLaunchSeconds},
          std::tuple{&launch_s_per_attention_call, "launch_s_per_attention_call",
                     kMaxLaunchSeconds}}) {
      if (!row->empty()) require_in((*row)[i], 0.0, high, name + of);
    }
    for (const auto& [row, name] :
         {std::pair{&ulysses_bytes_per_token, "ulysses_bytes_per_token"},
          std::pair{&ring_bytes_per_token, "ring_bytes_per_token"},
          std::pair{&ulysses_exchanged_bytes_per_token, "ulysses_exchanged_bytes_per_token"}}) {
      if (!row->empty() && i < row->size()) {
        require_in((*row)[i], -kMaxBytesPerToken, kMaxBytesPerToken, name + of);
      }
    }
  }
  for (const auto* signed_row :
       {&ulysses_bytes_per_token, &ring_bytes_per_token, &ulysses_exchanged_bytes_per_token}) {
    if (!signed_row->empty() && signed_row->size() != memory_models.size()) {
      throw std::invalid_argument(
          "profile: ulysses_bytes_per_token, ring_bytes_per_token and "
          "ulysses_exchanged_bytes_per_token must be empty or as long as memory_models");
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
  require_in(static_cast<double>(runtime_reserved_bytes), 0.0, kMaxProfileBytes,
             "runtime_reserved_bytes");
  require_in(static_cast<double>(device_memory_bytes), 0.0, kMaxProfileBytes,
             "device_memory_bytes");
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
