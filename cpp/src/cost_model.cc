// Cost model. Legend: d model width, N layers, H heads, hd head dim, bpe bytes per element;
// a placement (u, r) cuts the sequence's unit tokens L into r blocks (two sizes: b and b + 1),
// each block into u chunks; rank (j, k) holds chunk k of block j (n tokens) and h_k heads.
#include "zellige/cost_model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cost_model_internal.h"

namespace zellige {

namespace {
constexpr int64_t kDefaultReservedBytes = int64_t{3} << 30;
constexpr double kLseBytes = 4;  // attention's log-sum-exp per query row and head (float32)
constexpr double kBackwardAttentionFlopsRatio = 2.5;   // analytic fallback only
}  // namespace

using cost_model_internal::kElementwiseBytesPerTokenWidth;
using cost_model_internal::kRouteBytesPerToken;
using cost_model_internal::max_rate;
using cost_model_internal::same_node;

CostModel::LogTable::LogTable(const Table& table) {
  for (size_t i = 0; i < table.x.size(); ++i) {
    log_x.push_back(std::log(table.x[i]));
    log_y.push_back(std::log(table.y[i]));
  }
  for (size_t i = 0; i + 1 < log_x.size(); ++i) {
    slope.push_back((log_y[i + 1] - log_y[i]) / (log_x[i + 1] - log_x[i]));
  }
}

double CostModel::LogTable::operator()(double at) const {
  if (slope.empty()) return std::exp(log_y[0]);
  const double log_at = std::log(at);
  // Segment [i, i + 1] containing `at`; the end segments extend beyond the sampled range.
  const size_t i =
      static_cast<size_t>(std::upper_bound(log_x.begin() + 1, log_x.end() - 1, log_at) -
                          log_x.begin()) -
      1;
  return std::exp(log_y[i] + slope[i] * (log_at - log_x[i]));
}

double CostModel::LogTable::held(double at) const { return std::exp(log_held(std::log(at))); }

double CostModel::LogTable::log_held(double log_at) const {
  if (log_at <= log_x.front()) return log_y.front();
  if (log_at >= log_x.back()) return log_y.back();
  const size_t i =
      static_cast<size_t>(std::upper_bound(log_x.begin() + 1, log_x.end() - 1, log_at) -
                          log_x.begin()) -
      1;
  return log_y[i] + slope[i] * (log_at - log_x[i]);
}

CostModel::CostModel(ModelSpec model, HardwareProfile profile, Cluster cluster, CostOptions options)
    : model_(std::move(model)),
      profile_(std::move(profile)),
      cluster_(std::move(cluster)),
      options_(options) {
  profile_.validate();
  // The model's own per-token rates, where the profile has them, replace the shared tables for
  // everything below (profile() then shows the tables this model is priced with).
  for (size_t i = 0; i < profile_.memory_models.size(); ++i) {
    if (profile_.memory_models[i] != model_.name) continue;
    for (const auto& [own, shared] :
         {std::pair{&profile_.model_matmul_forward_flops_per_s,
                    &profile_.matmul_forward_flops_per_s},
          std::pair{&profile_.model_matmul_backward_flops_per_s,
                    &profile_.matmul_backward_flops_per_s}}) {
      if (i < own->size() && !(*own)[i].empty()) *shared = (*own)[i];
    }
  }
  stream_gain_bound_ =
      profile_.attention_stream_overlap *
      (1.0 - 1.0 / static_cast<double>(std::max<int64_t>(1, profile_.attention_streams)));
  attention_forward_ = LogTable(profile_.attention_forward_s_per_head);
  attention_backward_ = LogTable(profile_.attention_backward_s_per_head);
  matmul_forward_ = LogTable(profile_.matmul_forward_flops_per_s);
  matmul_backward_ = LogTable(profile_.matmul_backward_flops_per_s);
  for (size_t i = 0; i < profile_.attention_call_lengths.size(); ++i) {
    call_log_lengths_.push_back(std::log(profile_.attention_call_lengths[i]));
    call_forward_.emplace_back(profile_.attention_call_forward_s[i]);
    call_backward_.emplace_back(profile_.attention_call_backward_s[i]);
  }
  if (model_.num_heads <= 0 || model_.head_dim <= 0 || model_.num_layers <= 0 ||
      model_.width <= 0) {
    throw std::invalid_argument("cost model: model '" + model_.name +
                                "' needs heads, head_dim, layers and width > 0");
  }
  if (cluster_.num_ranks() <= 0 || cluster_.gpu_memory_bytes <= 0 ||
      !(cluster_.intra_node_bytes_per_s > 0) || !(cluster_.inter_node_bytes_per_s > 0)) {
    throw std::invalid_argument("cost model: cluster needs ranks, GPU memory and link bandwidths");
  }
  validate_cluster(cluster_);
  if (options_.bytes_per_element <= 0 || options_.state_bytes_per_param < 0 ||
      !(options_.gradient_bytes_per_param >= 0 &&
        options_.gradient_bytes_per_param <= options_.state_bytes_per_param) ||
      !(options_.optimizer_copy_bytes_per_param >= 0) ||
      !(options_.memory_headroom >= 0 && options_.memory_headroom < 1)) {
    throw std::invalid_argument(
        "cost model: bytes_per_element must be > 0, state_bytes_per_param >= 0, "
        "gradient_bytes_per_param in [0, state_bytes_per_param], "
        "optimizer_copy_bytes_per_param >= 0 and memory_headroom in [0, 1)");
  }
  const double d = static_cast<double>(model_.width);
  const double bpe = static_cast<double>(options_.bytes_per_element);
  forward_flops_per_token_ = layer_forward_flops(model_, 1, 0).linear;

  // Analytic activations: q, k, v, o, attention in/out, norms and modulated inputs (~16 d) plus
  // the FFN hidden before and after the activation (~3 ffn); cross models add the cross q/o.
  activation_bytes_ = bpe * (16.0 * d + 3.0 * static_cast<double>(model_.ffn_width) +
                             (model_.joint_attention ? 0.0 : 2.0 * d));
  // Checkpointed (selective): the layer input, and o and lse of each attention (self or joint,
  // and cross).
  const double attentions = model_.joint_attention ? 1.0 : 2.0;
  checkpoint_bytes_ =
      d * bpe + attentions * (d * bpe + static_cast<double>(model_.num_heads) * kLseBytes);
  double measured_step_fixed_bytes = 0;
  for (size_t i = 0; i < profile_.memory_models.size(); ++i) {
    if (profile_.memory_models[i] != model_.name) continue;
    if (profile_.activation_bytes_per_token_layer[i] > 0) {
      activation_bytes_ = profile_.activation_bytes_per_token_layer[i];
    }
    if (profile_.checkpoint_bytes_per_token_layer[i] > 0) {
      checkpoint_bytes_ = profile_.checkpoint_bytes_per_token_layer[i];
    }
    // optional rows: empty, or one value per memory model
    const auto read_row = [i](const std::vector<double>& row, double& value) {
      if (!row.empty()) value = row[i];
    };
    read_row(profile_.backward_bytes_per_token_layer, backward_bytes_);
    read_row(profile_.text_bytes_per_token_layer, text_bytes_);
    read_row(profile_.ulysses_bytes_per_token, ulysses_bytes_);
    read_row(profile_.ulysses_exchanged_bytes_per_token, ulysses_exchanged_bytes_);
    read_row(profile_.ring_bytes_per_token, ring_bytes_);
    read_row(profile_.attention_phase_bytes_per_token, attention_phase_bytes_);
    read_row(profile_.step_fixed_bytes, measured_step_fixed_bytes);
    read_row(profile_.reduce_fixed_bytes, reduce_fixed_bytes_);
    read_row(profile_.reduce_bytes_per_token, reduce_bytes_per_token_);
    if (i < profile_.backward_peak_bytes.size()) backward_peak_ = profile_.backward_peak_bytes[i];
    read_row(profile_.launch_s_per_layer, launch_s_per_layer_);
    read_row(profile_.launch_s_per_attention_call, launch_s_per_call_);
  }

  // MMDiT double blocks carry two weight sets, so the largest layer is twice a single one.
  const double params = static_cast<double>(model_.param_count);
  const double block_params = std::min(params, static_cast<double>(block_param_count(model_)));
  const double layer_units = static_cast<double>(model_.num_layers + model_.num_double_layers);
  const double largest_layer_params =
      block_params / layer_units * (model_.num_double_layers > 0 ? 2.0 : 1.0);
  // Parameters outside the blocks (embeddings, time and text MLPs, final layer) belong to the
  // root FSDP unit, which FSDP2 keeps gathered in bf16 from the forward to the backward's end.
  const double root_gathered_bytes = 2.0 * (params - block_params);
  const double reserved =
      static_cast<double>(profile_.runtime_reserved_bytes > 0 ? profile_.runtime_reserved_bytes
                                                              : kDefaultReservedBytes);
  step_fixed_bytes_ =
      measured_step_fixed_bytes > 0
          ? measured_step_fixed_bytes
          : 2.0 * largest_layer_params * 2.0   // two gathered bf16 layers (prefetch)
                + largest_layer_params * 4.0;  // one layer's unsharded fp32 gradients
  const double ranks = static_cast<double>(cluster_.num_ranks());
  fixed_bytes_ = params * options_.state_bytes_per_param / ranks + step_fixed_bytes_ +
                 root_gathered_bytes + reserved;
  gradient_bytes_ = params * options_.gradient_bytes_per_param / ranks;
  // In the optimizer step no activation, gathered layer or root copy is held (the graph is
  // freed after the backward), only the state and the copies a copying optimizer writes.
  optimizer_peak_bytes_ =
      params * (options_.state_bytes_per_param + options_.optimizer_copy_bytes_per_param) /
          ranks +
      reserved;
  layer_gradient_bytes_ =
      block_params * options_.gradient_bytes_per_param / ranks / layer_units;
  layer_weight_bytes_ = block_params * bpe / layer_units;

  const double layers = static_cast<double>(model_.num_layers);
  const double forward_passes = options_.activation_checkpointing ? 2.0 : 1.0;
  min_linear_time_per_token_s_ =
      layers * (forward_flops_per_token_ * forward_passes /
                    max_rate(profile_.matmul_forward_flops_per_s, profile_.matmul_flops_per_s) +
                2.0 * forward_flops_per_token_ /
                    max_rate(profile_.matmul_backward_flops_per_s, profile_.matmul_flops_per_s) +
                kElementwiseBytesPerTokenWidth * d * bpe * (forward_passes + 1.0) /
                    profile_.memory_bytes_per_s);
}

double CostModel::head_forward_s(double query_tokens, double key_tokens) const {
  if (query_tokens <= 0 || key_tokens <= 0) return 0;
  const double hd = static_cast<double>(model_.head_dim);
  if (attention_forward_.empty()) {
    return 4.0 * query_tokens * key_tokens * hd / profile_.attention_flops_per_s;
  }
  return attention_forward_(std::sqrt(query_tokens * key_tokens)) * hd /
         static_cast<double>(profile_.attention_head_dim);
}

double CostModel::head_backward_s(double query_tokens, double key_tokens) const {
  if (query_tokens <= 0 || key_tokens <= 0) return 0;
  const double hd = static_cast<double>(model_.head_dim);
  if (attention_backward_.empty()) {
    return kBackwardAttentionFlopsRatio * 4.0 * query_tokens * key_tokens * hd /
           profile_.attention_flops_per_s;
  }
  return attention_backward_(std::sqrt(query_tokens * key_tokens)) * hd /
         static_cast<double>(profile_.attention_head_dim);
}

// Text key/value projections of a cross-attention layer, fwd + bwd (+ recompute); every rank
// of a placement runs them. The model projects the text of all of a rank's sequences in one
// GEMM, so they run at the rate of a rank-sized GEMM, not of one sequence's few hundred rows
// (charging the latter over-predicted ranks of ~20 sequences by up to 55% on the H200).
namespace {
constexpr double kRankTextRows = 16384;  // text rows of a typical rank's batched projection
}  // namespace

double CostModel::text_projection_forward_s(int64_t text_tokens) const {
  if (model_.joint_attention || text_tokens <= 0) return 0;
  const double d = static_cast<double>(model_.width);
  return 4.0 * d * d * static_cast<double>(text_tokens) /
         (matmul_forward_.empty() ? profile_.matmul_flops_per_s
                                  : matmul_forward_.held(kRankTextRows));
}

double CostModel::text_projection_s(int64_t text_tokens) const {
  if (model_.joint_attention || text_tokens <= 0) return 0;
  const double d = static_cast<double>(model_.width);
  const double flops = 4.0 * d * d * static_cast<double>(text_tokens);
  const double forward_passes = options_.activation_checkpointing ? 2.0 : 1.0;
  return forward_passes * text_projection_forward_s(text_tokens) +
         2.0 * flops /
             (matmul_backward_.empty() ? profile_.matmul_flops_per_s
                                       : matmul_backward_.held(kRankTextRows));
}

// log(per-head seconds of a call of `heads` heads / per-head seconds of the largest call measured)
// at each measured length, heads held inside the measured range; linear in log length between
// lengths and held beyond them. Calls of more heads than measured run at the full-call rate.
double CostModel::call_log_slowdown(const std::vector<LogTable>& tables, double length,
                                    double heads) const {
  return call_log_slowdown_at(tables, std::log(length), std::log(heads));
}

double CostModel::call_log_slowdown_at(const std::vector<LogTable>& tables, double log_length,
                                       double log_heads) const {
  const auto at_length = [&](size_t i) {
    const LogTable& table = tables[i];
    const double log_h = std::clamp(log_heads, table.log_x.front(), table.log_x.back());
    return table.log_held(log_h) - log_h - (table.log_y.back() - table.log_x.back());
  };
  if (log_length <= call_log_lengths_.front()) return at_length(0);
  if (log_length >= call_log_lengths_.back()) return at_length(call_log_lengths_.size() - 1);
  const size_t i = static_cast<size_t>(std::upper_bound(call_log_lengths_.begin(),
                                                        call_log_lengths_.end(), log_length) -
                                       call_log_lengths_.begin()) -
                   1;
  const double t =
      (log_length - call_log_lengths_[i]) / (call_log_lengths_[i + 1] - call_log_lengths_[i]);
  return (1.0 - t) * at_length(i) + t * at_length(i + 1);
}

double CostModel::call_excess_per_head_s(double query_tokens, double key_tokens,
                                         double call_heads) const {
  if (call_log_lengths_.empty() || query_tokens <= 0 || key_tokens <= 0) return 0;
  return call_excess_per_head_s(query_tokens, key_tokens, call_heads,
                                head_forward_s(query_tokens, key_tokens),
                                head_backward_s(query_tokens, key_tokens));
}

double CostModel::call_excess_per_head_s(double query_tokens, double key_tokens, double call_heads,
                                         double forward_s, double backward_s) const {
  if (call_log_lengths_.empty() || query_tokens <= 0 || key_tokens <= 0) return 0;
  const double log_length = std::log(std::sqrt(query_tokens * key_tokens));
  const double log_heads = std::log(call_heads);
  const double forward_excess =
      std::max(0.0, std::expm1(call_log_slowdown_at(call_forward_, log_length, log_heads)));
  const double backward_excess =
      std::max(0.0, std::expm1(call_log_slowdown_at(call_backward_, log_length, log_heads)));
  return forward_s * forward_excess + backward_s * backward_excess;
}

// price_calls = false leaves out every call's excess (the lower bound's shapes).
CostModel::Shape CostModel::make_shape(int64_t unit_tokens, int64_t text_tokens,
                                       int64_t ulysses_degree, int64_t ring_degree,
                                       bool price_calls) const {
  Shape shape;
  shape.price_calls = price_calls;
  shape.unit_tokens = unit_tokens;
  shape.text_tokens = text_tokens;
  shape.ulysses_degree = ulysses_degree;
  shape.ring_degree = ring_degree;
  shape.small_block = unit_tokens / ring_degree;
  shape.num_big_blocks = unit_tokens % ring_degree;
  shape.text_projection_s = text_projection_s(text_tokens);
  for (int q = 0; q < 2; ++q) {
    if (shape.block_count(q) == 0) continue;
    for (int k = 0; k < 2; ++k) {
      if (shape.block_count(k) == 0) continue;
      const double lq = static_cast<double>(shape.block_tokens(q));
      const double lk = static_cast<double>(shape.block_tokens(k));
      shape.forward_s[q][k] = head_forward_s(lq, lk);
      shape.backward_s[q][k] = head_backward_s(lq, lk);
      if (!price_calls) continue;
      const double heads = static_cast<double>(model_.num_heads / ulysses_degree);
      const double forward_s = shape.forward_s[q][k], backward_s = shape.backward_s[q][k];
      shape.call_excess_s[0][q][k] = call_excess_per_head_s(lq, lk, heads, forward_s, backward_s);
      if (model_.num_heads % ulysses_degree != 0) {  // some ranks hold one head more
        shape.call_excess_s[1][q][k] =
            call_excess_per_head_s(lq, lk, heads + 1, forward_s, backward_s);
      }
    }
  }
  return shape;
}

CostModel::RankTerms CostModel::rank_terms(const Shape& shape, int block_class,
                                           int next_block_class, int64_t chunk_tokens,
                                           int64_t heads, bool ulysses_intra_node,
                                           bool ring_intra_node) const {
  const double layers = static_cast<double>(model_.num_layers);
  const double bpe = static_cast<double>(options_.bytes_per_element);
  const double hd = static_cast<double>(model_.head_dim);
  const double d = static_cast<double>(model_.width);
  const double all_heads = static_cast<double>(model_.num_heads);
  const double h = static_cast<double>(heads);
  const double n = static_cast<double>(chunk_tokens);
  const double block = static_cast<double>(shape.block_tokens(block_class));
  const double text = static_cast<double>(shape.text_tokens);
  // Selective checkpointing (docs/training.md): a checkpointed layer keeps its attention outputs,
  // so attention runs forward once either way; only the per-token layers (linear_time_s, the
  // text projections) and the q/k/v exchange that feeds attention run again.
  const bool checkpointing = options_.activation_checkpointing;
  const bool cross = !model_.joint_attention && shape.text_tokens > 0;

  RankTerms terms;
  // Self-attention: every ring step pairs this rank's query block with one key block.
  double layer_s = 0;
  // Each segment is priced as a call of its own (call_excess_per_head_s); evaluate() gives back
  // what the engine saves by running equal segments of a rank as one call.
  const int head_class = static_cast<int>(heads - model_.num_heads / shape.ulysses_degree);
  for (int c = 0; c < 2; ++c) {
    const double count = static_cast<double>(shape.block_count(c));
    if (count == 0) continue;
    layer_s += count * h *
               (shape.forward_s[block_class][c] + shape.backward_s[block_class][c] +
                shape.call_excess_s[head_class][block_class][c]);
  }
  if (cross) {
    const double forward_s = head_forward_s(n, text), backward_s = head_backward_s(n, text);
    const double cross_s =
        all_heads *
        (forward_s + backward_s +
         (shape.price_calls ? call_excess_per_head_s(n, text, all_heads, forward_s, backward_s)
                            : 0.0));
    // The lower bound's shapes (no call prices) take off the most the cross-attention table's
    // streams can save (evaluate prices the actual saving per rank).
    layer_s += (shape.price_calls ? cross_s : (1.0 - stream_gain_bound_) * cross_s) +
               shape.text_projection_s;
    // the text k/v projections are per-token layers of the block: recomputed
    if (checkpointing) terms.recompute_s = layers * text_projection_forward_s(shape.text_tokens);
  }
  terms.attention_s = layers * layer_s;

  // Ulysses: per pass, q, k, v of this chunk for the other ranks' heads go out and the output
  // of this rank's heads for the other chunks goes back (4 all-to-alls): forward and backward,
  // and the recompute of a checkpointed layer sends q, k, v again (3 all-to-alls).
  if (shape.ulysses_degree > 1) {
    const double qkv_send = n * (all_heads - h) * hd * bpe;
    const double qkv_recv = (block - n) * h * hd * bpe;
    const double out_send = qkv_recv;
    const double out_recv = qkv_send;
    const double send = 3.0 * qkv_send + out_send;
    const double recv = 3.0 * qkv_recv + out_recv;
    const Table* measured = nullptr;
    if (ulysses_intra_node) {
      for (size_t i = 0; i < profile_.exchange_group_sizes.size(); ++i) {
        if (profile_.exchange_group_sizes[i] == shape.ulysses_degree) {
          measured = &profile_.exchange_intra_node_s[i];
        }
      }
    }
    double pass_s, qkv_pass_s;
    if (measured != nullptr) {
      qkv_pass_s = 3.0 * (*measured)(std::max(1.0, std::max(qkv_send, qkv_recv)));
      pass_s = qkv_pass_s + (*measured)(std::max(1.0, std::max(out_send, out_recv)));
    } else {
      const double link =
          ulysses_intra_node ? cluster_.intra_node_bytes_per_s : cluster_.inter_node_bytes_per_s;
      const double latency =
          ulysses_intra_node ? cluster_.intra_node_latency_s : cluster_.inter_node_latency_s;
      qkv_pass_s = 3.0 * std::max(qkv_send, qkv_recv) / link + 3.0 * latency;
      pass_s = std::max(send, recv) / link + 4.0 * latency;
    }
    const double exposed = 1.0 - profile_.exchange_overlap;
    terms.exchange_s += layers * 2.0 * pass_s * exposed;
    const double recompute_send = checkpointing ? 3.0 * qkv_send : 0.0;
    if (checkpointing) {
      terms.recompute_exchange_s = layers * qkv_pass_s * exposed;
      terms.exchange_s += terms.recompute_exchange_s;
      terms.attention_recompute_exchange_s += layers * (pass_s - qkv_pass_s) * exposed;
    }
    terms.sent_bytes += layers * (2.0 * send + recompute_send);
    terms.attention_s +=
        layers * (2.0 * send + recompute_send) * profile_.ulysses_layout_s_per_byte;
  }

  // Ring: r - 1 k/v transfers per pass (every block but the next one is forwarded), each hidden
  // behind the ring step computing on the block in flight; backward also carries dk, dv.
  if (shape.ring_degree > 1) {
    const double link =
        ring_intra_node ? cluster_.intra_node_bytes_per_s : cluster_.inter_node_bytes_per_s;
    const double latency =
        ring_intra_node ? cluster_.intra_node_latency_s : cluster_.inter_node_latency_s;
    double forward_exposed_s = 0, backward_exposed_s = 0, kv_sent = 0;
    for (int c = 0; c < 2; ++c) {
      const double transfers =
          static_cast<double>(shape.block_count(c) - (c == next_block_class ? 1 : 0));
      if (transfers <= 0) continue;
      const double kv_bytes = 2.0 * static_cast<double>(shape.block_tokens(c)) * h * hd * bpe;
      forward_exposed_s +=
          transfers * std::max(0.0, kv_bytes / link - h * shape.forward_s[block_class][c]);
      backward_exposed_s +=
          transfers * std::max(0.0, 2.0 * kv_bytes / link - h * shape.backward_s[block_class][c]);
      kv_sent += transfers * kv_bytes;
    }
    // The ring runs in the forward and the backward only: its outputs are kept (no recompute).
    const double step_latency_s = static_cast<double>(shape.ring_degree - 1) * latency;
    terms.exchange_s +=
        layers * (forward_exposed_s + step_latency_s + backward_exposed_s + step_latency_s);
    if (checkpointing) {
      terms.attention_recompute_exchange_s += layers * (forward_exposed_s + step_latency_s);
    }
    terms.sent_bytes += layers * kv_sent * 3.0;
    terms.attention_s += layers * kv_sent * 3.0 * profile_.ring_layout_s_per_byte;
  }

  // A full recompute (memory allows no kept outputs) runs every attention forward again.
  if (checkpointing) {
    double forward_layer_s = 0;
    for (int c = 0; c < 2; ++c) {
      forward_layer_s +=
          static_cast<double>(shape.block_count(c)) * h * shape.forward_s[block_class][c];
    }
    if (cross) forward_layer_s += all_heads * head_forward_s(n, text);
    terms.attention_recompute_s = layers * forward_layer_s;
  }

  // Memory: kept activations, then the transient buffers of one layer. A checkpointed layer
  // keeps its input and its attention outputs (checkpoint_bytes_: measured on one rank, local
  // attention); Ulysses also keeps the exchanged layout's o and lse of this rank's heads, ring
  // the merged lse of its rows.
  terms.layer_activation_bytes = n * activation_bytes_ + (cross ? text * text_bytes_ : 0.0);
  terms.layer_checkpoint_bytes = n * checkpoint_bytes_;
  if (shape.ulysses_degree > 1) {
    terms.layer_checkpoint_bytes += block * h * (hd * bpe + kLseBytes);
  }
  if (shape.ring_degree > 1) terms.layer_checkpoint_bytes += block * h * kLseBytes;
  terms.layer_input_bytes = n * d * bpe;
  // The planners size ranks at the least memory a layer can keep (the input: full recompute);
  // evaluate() keeps the attention outputs wherever they fit.
  const double kept_bytes =
      checkpointing ? layers * terms.layer_input_bytes + terms.layer_activation_bytes
                    : layers * terms.layer_activation_bytes;
  // Measured: one layer's backward transient per token; analytic: q, k, v, o of the segment.
  double buffer_bytes = backward_bytes_ > 0 ? n * backward_bytes_ : 4.0 * block * h * hd * bpe;
  if (cross) buffer_bytes = std::max(buffer_bytes, 2.0 * (n + text) * all_heads * hd * bpe);
  if (shape.ulysses_degree > 1) {
    // measured (over 2 ranks, and the share exchanged beyond), or q/k/v sent and received
    const double u = static_cast<double>(shape.ulysses_degree);
    buffer_bytes += ulysses_bytes_ != 0
                        ? n * (ulysses_bytes_ + ulysses_exchanged_bytes_ * ((u - 1.0) / u - 0.5))
                        : 2.0 * 3.0 * n * d * bpe;
  }
  if (shape.ring_degree > 1) {
    const double largest_block =
        static_cast<double>(shape.block_tokens(shape.num_big_blocks > 0 ? 1 : 0));
    // measured, or the k/v double buffer
    buffer_bytes += ring_bytes_ != 0 ? n * ring_bytes_ : 2.0 * 2.0 * largest_block * h * hd * bpe;
  }
  terms.buffer_bytes = std::max(0.0, buffer_bytes);
  terms.memory_bytes = kept_bytes + terms.buffer_bytes;
  return terms;
}

template <typename Visit>
void CostModel::visit_shares(const Sequence& sequence, const Placement& placement,
                             bool distinct_only, Visit&& visit) const {
  const int64_t unit_tokens = attended_tokens(model_, sequence.num_tokens, sequence.text_tokens);
  const int64_t u = placement.ulysses_degree;
  const int64_t r = placement.ring_degree;
  const Shape shape = make_shape(unit_tokens, sequence.text_tokens, u, r);
  const int64_t all_heads = model_.num_heads;

  std::vector<bool> ring_intra(static_cast<size_t>(u), true);
  if (r > 1) {
    for (int64_t k = 0; k < u; ++k) ring_intra[k] = same_node(cluster_, placement.ranks, k, u, r);
  }
  // A rank's terms depend only on these few values, which take at most a handful of combinations
  // however many ranks there are: each is priced once, so a share costs O(1) and a placement over
  // d ranks O(d) copies instead of d full pricings (planners price degrees up to thousands).
  struct TermsKey {
    int block_class, next_class;
    int64_t chunk, heads;
    bool ulysses_intra, ring_intra;
    bool operator==(const TermsKey&) const = default;
  };
  std::vector<std::pair<TermsKey, RankTerms>> priced;
  // Without Ulysses, ring position j's terms depend on j only through its block class and the
  // next one's: the positions 0, nb - 1, nb and r - 1 (nb big blocks first) meet every pair.
  const int64_t nb = shape.num_big_blocks;
  const int64_t distinct_steps[] = {0, nb - 1, nb, r - 1};
  const bool few_steps = distinct_only && u == 1;
  const int64_t num_steps = few_steps ? 4 : r;
  for (int64_t step = 0; step < num_steps; ++step) {
    const int64_t j = few_steps ? distinct_steps[step] : step;
    if (j < 0 || j >= r || (few_steps && step > 0 && j == distinct_steps[step - 1])) continue;
    const int block_class = j < shape.num_big_blocks ? 1 : 0;
    const int next_class = (j + 1) % r < shape.num_big_blocks ? 1 : 0;
    const int64_t block = shape.block_tokens(block_class);
    const bool ulysses_intra = u == 1 || same_node(cluster_, placement.ranks, j * u, 1, u);
    for (int64_t k = 0; k < u; ++k) {
      const int64_t chunk = block / u + (k < block % u ? 1 : 0);
      const int64_t heads = all_heads / u + (k < all_heads % u ? 1 : 0);
      const TermsKey key{block_class, next_class, chunk, heads, ulysses_intra, ring_intra[k]};
      const RankTerms* found = nullptr;
      for (const auto& [seen, seen_terms] : priced) {
        if (seen == key) found = &seen_terms;
      }
      if (found == nullptr) {
        priced.emplace_back(key, rank_terms(shape, block_class, next_class, chunk, heads,
                                            ulysses_intra, ring_intra[k]));
        found = &priced.back().second;
      }
      const RankTerms& terms = *found;
      RankShare share;
      share.rank = placement.ranks[j * u + k];
      share.tokens = chunk;
      share.attention_s = terms.attention_s;
      share.exchange_s = terms.exchange_s;
      share.memory_bytes = terms.memory_bytes;
      share.layer_activation_bytes = terms.layer_activation_bytes;
      share.layer_checkpoint_bytes = terms.layer_checkpoint_bytes;
      share.buffer_bytes = terms.buffer_bytes;
      share.recompute_s = terms.recompute_s;
      share.recompute_exchange_s = terms.recompute_exchange_s;
      share.layer_input_bytes = terms.layer_input_bytes;
      share.attention_recompute_s = terms.attention_recompute_s;
      share.attention_recompute_exchange_s = terms.attention_recompute_exchange_s;
      visit(share, terms.sent_bytes);
    }
  }
}

std::vector<RankShare> CostModel::shares_and_bytes(const Sequence& sequence,
                                                   const Placement& placement,
                                                   double* sent_bytes) const {
  std::vector<RankShare> result;
  result.reserve(placement.ranks.size());
  double sent = 0;
  visit_shares(sequence, placement, false, [&](const RankShare& share, double share_sent) {
    result.push_back(share);
    sent += share_sent;
    if (share.rank != sequence.source_rank) {
      sent += 2.0 * kRouteBytesPerToken * static_cast<double>(share.tokens);
    }
  });
  if (sent_bytes != nullptr) *sent_bytes = sent;
  return result;
}

double CostModel::busiest_share_s(const Sequence& sequence, const Placement& placement,
                                  double s_per_token) const {
  double busiest_s = 0;
  visit_shares(sequence, placement, true, [&](const RankShare& share, double) {
    busiest_s = std::max(busiest_s, static_cast<double>(share.tokens) * s_per_token +
                                        share.attention_s + share.exchange_s);
  });
  return busiest_s;
}

std::vector<RankShare> CostModel::shares(const Sequence& sequence,
                                         const Placement& placement) const {
  return shares_and_bytes(sequence, placement, nullptr);
}

std::vector<std::pair<int64_t, RankShare>> CostModel::share_runs(const Sequence& sequence,
                                                                 const Placement& placement) const {
  std::vector<std::pair<int64_t, RankShare>> runs;
  const std::vector<int64_t>& ranks = placement.ranks;
  const int64_t num_positions = static_cast<int64_t>(ranks.size());
  if (placement.ulysses_degree != 1) {  // one run per position
    runs.reserve(ranks.size());
    visit_shares(sequence, placement, false,
                 [&](const RankShare& share, double) { runs.emplace_back(1, share); });
    return runs;
  }
  // Without Ulysses, visit_shares' distinct positions come in increasing order, and every
  // position's share is that of the last distinct position at or before it (visit_shares):
  // runs start there. Here a run's count holds its first position until the end.
  int64_t position = -1;
  visit_shares(sequence, placement, true, [&](const RankShare& share, double) {
    const auto at = std::find(ranks.begin() + std::max<int64_t>(position, 0), ranks.end(),
                              share.rank);
    const int64_t found = at - ranks.begin();
    assert(found < num_positions);
    if (found == position) return;  // a position visited twice (fewer distinct blocks)
    position = found;
    runs.emplace_back(position, share);
  });
  for (size_t k = 0; k < runs.size(); ++k) {
    const int64_t end = k + 1 < runs.size() ? runs[k + 1].first : num_positions;
    runs[k].first = end - runs[k].first;
  }
  return runs;
}

// A share's memory depends on its block class, chunk and head count alone (not on links or the
// next block): each (block, chunk, heads) combination the placement has is priced once.
double CostModel::max_share_memory_bytes(const Sequence& sequence, int64_t ulysses_degree,
                                         int64_t ring_degree) const {
  const int64_t unit_tokens = attended_tokens(model_, sequence.num_tokens, sequence.text_tokens);
  const int64_t u = ulysses_degree;
  const Shape shape =
      make_shape(unit_tokens, sequence.text_tokens, u, ring_degree, /*price_calls=*/false);
  double most_bytes = 0;
  for (int block_class = 0; block_class < 2; ++block_class) {
    if (shape.block_count(block_class) == 0) continue;
    const int64_t block = shape.block_tokens(block_class);
    // Chunk k is big iff k < block % u, head group k is big iff k < H % u: three ranges of k.
    const int64_t big_chunks = block % u, big_heads = model_.num_heads % u;
    const int64_t bounds[4] = {0, std::min(big_chunks, big_heads), std::max(big_chunks, big_heads),
                               u};
    for (int range = 0; range < 3; ++range) {
      if (bounds[range + 1] <= bounds[range]) continue;
      const int64_t k = bounds[range];
      const int64_t chunk = block / u + (k < big_chunks ? 1 : 0);
      const int64_t heads = model_.num_heads / u + (k < big_heads ? 1 : 0);
      const RankTerms terms = rank_terms(shape, block_class, block_class, chunk, heads, true, true);
      most_bytes = std::max(most_bytes, terms.memory_bytes);
    }
  }
  return most_bytes;
}

double CostModel::exchange_bytes(const Sequence& sequence, const Placement& placement) const {
  double sent = 0;
  shares_and_bytes(sequence, placement, &sent);
  return sent;
}

double CostModel::linear_time_s(int64_t tokens) const {
  if (tokens <= 0) return 0;
  const double m = static_cast<double>(tokens);
  const double layers = static_cast<double>(model_.num_layers);
  const double forward_passes = options_.activation_checkpointing ? 2.0 : 1.0;
  const double flops = forward_flops_per_token_ * m;
  const double forward_rate =
      (matmul_forward_.empty() ? profile_.matmul_flops_per_s : matmul_forward_.held(m));
  const double backward_rate =
      (matmul_backward_.empty() ? profile_.matmul_flops_per_s : matmul_backward_.held(m));
  const double elementwise_s = kElementwiseBytesPerTokenWidth * static_cast<double>(model_.width) *
                               static_cast<double>(options_.bytes_per_element) * m *
                               (forward_passes + 1.0) / profile_.memory_bytes_per_s;
  return layers *
         (flops * forward_passes / forward_rate + 2.0 * flops / backward_rate + elementwise_s);
}

double CostModel::linear_recompute_s(int64_t tokens) const {
  if (tokens <= 0 || !options_.activation_checkpointing) return 0;
  const double m = static_cast<double>(tokens);
  const double forward_rate =
      (matmul_forward_.empty() ? profile_.matmul_flops_per_s : matmul_forward_.held(m));
  const double elementwise_s = kElementwiseBytesPerTokenWidth * static_cast<double>(model_.width) *
                               static_cast<double>(options_.bytes_per_element) * m /
                               profile_.memory_bytes_per_s;
  return static_cast<double>(model_.num_layers) *
         (forward_flops_per_token_ * m / forward_rate + elementwise_s);
}

double CostModel::min_linear_time_per_token_s() const { return min_linear_time_per_token_s_; }

double CostModel::backward_peak_correction(double tokens) const {
  const std::vector<double>& x = backward_peak_.x;
  const std::vector<double>& y = backward_peak_.y;
  if (x.size() < 2) return 0.0;
  // linear between the packs measured, along the end segments beyond them
  const auto upper = std::upper_bound(x.begin() + 1, x.end() - 1, tokens);
  const size_t i = static_cast<size_t>(upper - x.begin()) - 1;
  const double measured = y[i] + (y[i + 1] - y[i]) / (x[i + 1] - x[i]) * (tokens - x[i]);
  return measured - step_fixed_bytes_ - backward_bytes_ * tokens;
}

double CostModel::fixed_bytes() const { return fixed_bytes_; }

double CostModel::gradient_bytes() const { return gradient_bytes_; }

double CostModel::rank_peak_bytes(double layer_activation_bytes, double layer_checkpoint_bytes,
                                  double buffer_bytes, int64_t checkpointed_layers) const {
  return rank_peak_bytes(layer_activation_bytes, layer_checkpoint_bytes, 0.0, buffer_bytes,
                         checkpointed_layers, 0);
}

double CostModel::rank_peak_bytes(double layer_activation_bytes, double layer_checkpoint_bytes,
                                  double layer_input_bytes, double buffer_bytes,
                                  int64_t checkpointed_layers, int64_t full_layers,
                                  int64_t held_tokens) const {
  const int64_t layers = model_.num_layers;
  const int64_t k = std::clamp<int64_t>(checkpointed_layers, 0, layers);
  const int64_t f = std::clamp<int64_t>(full_layers, 0, k);
  const auto kept = [&](int64_t j) {
    return j < f ? layer_input_bytes : j < k ? layer_checkpoint_bytes : layer_activation_bytes;
  };
  const double held_always = fixed_bytes_ - gradient_bytes_;
  // The backward runs layer L-1 down to 0. Before layer j: kept activations of layers < j,
  // gradients of layers > j (blocks only; the root's come last), or every gradient where earlier
  // micro-batches added theirs (accumulating_gradients).
  double below = static_cast<double>(f) * layer_input_bytes +
                 static_cast<double>(k - f) * layer_checkpoint_bytes +
                 static_cast<double>(layers - k) * layer_activation_bytes;
  // the backward's end (every gradient), and the optimizer step after it
  double peak = std::max(held_always + gradient_bytes_, optimizer_peak_bytes_);
  const double measured_curve =
      held_tokens > 0 ? backward_peak_correction(static_cast<double>(held_tokens)) : 0.0;
  for (int64_t j = layers - 1; j >= 0; --j) {
    below -= kept(j);
    // A checkpointed layer's recompute rebuilds its activations around the tensors it kept
    // (input, attention outputs), which are among them: its own bytes are its activations.
    const double own = layer_activation_bytes;
    const double grads = options_.accumulating_gradients
                             ? gradient_bytes_
                             : static_cast<double>(layers - 1 - j) * layer_gradient_bytes_;
    // weights kept from the forward: layers 0..j, two of which the fixed bytes count
    const double weights =
        options_.weights_kept_to_backward
            ? static_cast<double>(std::max<int64_t>(0, j - 1)) * layer_weight_bytes_
            : 0.0;
    peak = std::max(peak,
                    held_always + grads + below + own + buffer_bytes + weights + measured_curve);
    // Right after this layer's backward (its activations freed), while its gradients are
    // reduced: the moment of the largest layers only (an MMDiT's double blocks come first).
    const bool largest = model_.num_double_layers == 0 || j < model_.num_double_layers;
    if (reduce_fixed_bytes_ > 0 && largest) {
      const double reduced = reduce_fixed_bytes_ - step_fixed_bytes_ +
                             reduce_bytes_per_token_ * static_cast<double>(held_tokens);
      peak = std::max(peak, held_always + grads + below + weights + reduced);
    }
  }
  return peak;
}

double CostModel::memory_capacity_bytes(int64_t rank) const {
  return static_cast<double>(cluster_.memory_of(rank)) * (1.0 - options_.memory_headroom);
}

double CostModel::memory_capacity_bytes() const {
  return static_cast<double>(cluster_.min_memory_bytes()) * (1.0 - options_.memory_headroom);
}

double CostModel::max_memory_capacity_bytes() const {
  int64_t most_bytes = cluster_.gpu_memory_bytes;
  if (!cluster_.rank_memory_bytes.empty()) {
    most_bytes = *std::max_element(cluster_.rank_memory_bytes.begin(),
                                   cluster_.rank_memory_bytes.end());
  }
  return static_cast<double>(most_bytes) * (1.0 - options_.memory_headroom);
}

CostModel CostModel::homogeneous_view() const {
  CostModel view = *this;  // nothing derived in the constructor reads speeds or memory
  view.cluster_ = zellige::homogeneous_view(cluster_);
  return view;
}

CostModel CostModel::accumulating_view() const {
  CostModel view = *this;  // the constructor derives nothing from accumulating_gradients
  view.options_.accumulating_gradients = true;
  return view;
}

double CostModel::rank_time_s(int64_t tokens, double attention_s, double exchange_s) const {
  return linear_time_s(tokens) + attention_s + exchange_s;
}

}  // namespace zellige
