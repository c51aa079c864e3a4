// Cost model. Legend: d model width, N layers, H heads, hd head dim, bpe bytes per element;
// a placement (u, r) cuts the sequence's unit tokens L into r blocks (two sizes: b and b + 1),
// each block into u chunks; rank (j, k) holds chunk k of block j (n tokens) and h_k heads.
#include "zellige/cost_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace zellige {

namespace {
// A call key's tag (CostModel::CallKey) for cross-attention; -1 is a coalescable self-attention
// segment, >= 0 a ring step's sequence.
constexpr int64_t kCrossTag = -2;


constexpr double kRouteBytesPerToken = 512;  // latent features + ids, each direction
constexpr int64_t kDefaultReservedBytes = int64_t{3} << 30;
constexpr double kElementwiseBytesPerTokenWidth = 24;  // norms, modulation, residual, gates
constexpr double kLseBytes = 4;  // attention's log-sum-exp per query row and head (float32)
constexpr double kBackwardAttentionFlopsRatio = 2.5;   // analytic fallback only

double max_rate(const Table& table, double peak_flops_per_s) {
  if (table.empty()) return peak_flops_per_s;
  return *std::max_element(table.y.begin(), table.y.end());
}

bool same_node(const Cluster& cluster, const std::vector<int64_t>& ranks, int64_t first,
               int64_t stride, int64_t count) {
  const int64_t node = cluster.node_of(ranks[first]);
  for (int64_t i = 1; i < count; ++i) {
    if (cluster.node_of(ranks[first + i * stride]) != node) return false;
  }
  return true;
}

}  // namespace

std::vector<int64_t> stream_assignment(const std::vector<int64_t>& works, int64_t streams) {
  std::vector<int64_t> queued(static_cast<size_t>(std::max<int64_t>(1, streams)), 0);
  std::vector<int64_t> chosen;
  chosen.reserve(works.size());
  for (const int64_t work : works) {
    const auto least = std::min_element(queued.begin(), queued.end());  // first of the least
    *least += work;
    chosen.push_back(least - queued.begin());
  }
  return chosen;
}

double streamed_calls_s(const std::vector<int64_t>& works, const std::vector<double>& seconds,
                        int64_t streams, double overlap) {
  if (works.size() != seconds.size()) {
    throw std::invalid_argument("streamed_calls_s: one work and one time per call");
  }
  double serial_s = 0;
  for (const double call_s : seconds) serial_s += call_s;
  if (streams <= 1 || overlap == 0 || works.size() < 2) return serial_s;
  std::vector<double> load_s(static_cast<size_t>(streams), 0.0);
  const std::vector<int64_t> chosen = stream_assignment(works, streams);
  for (size_t i = 0; i < chosen.size(); ++i) load_s[static_cast<size_t>(chosen[i])] += seconds[i];
  const double most_s = *std::max_element(load_s.begin(), load_s.end());
  return serial_s - overlap * (serial_s - most_s);
}

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

struct CostModel::Shape {
  int64_t unit_tokens = 0, text_tokens = 0, ulysses_degree = 1, ring_degree = 1;
  int64_t small_block = 0, num_big_blocks = 0;  // big blocks (the first ones) hold one more
  // Per-head seconds of one layer pass of one ring step, [query block class][key block class];
  // class 0 = small block, 1 = big block.
  double forward_s[2][2] = {{0, 0}, {0, 0}};
  double backward_s[2][2] = {{0, 0}, {0, 0}};
  // call_excess_per_head_s of one such segment alone in its call, [heads - H / u][q][k]; all 0
  // unless price_calls (make_shape).
  bool price_calls = true;
  double call_excess_s[2][2][2] = {};
  double text_projection_s = 0;  // per layer, on every rank

  int64_t block_tokens(int block_class) const { return small_block + block_class; }
  int64_t block_count(int block_class) const {
    return block_class ? num_big_blocks : ring_degree - num_big_blocks;
  }
};

struct CostModel::RankTerms {
  double attention_s = 0;
  double exchange_s = 0;
  double memory_bytes = 0;
  double sent_bytes = 0;  // exchanges only; routing is added per placement
  double recompute_s = 0, recompute_exchange_s = 0;  // checkpointing's share of the two times
  double attention_recompute_s = 0, attention_recompute_exchange_s = 0;  // full recompute's
  double layer_activation_bytes = 0, layer_checkpoint_bytes = 0, layer_input_bytes = 0;
  double buffer_bytes = 0;
};

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
  const double log_heads = std::log(heads);
  const auto at_length = [&](size_t i) {
    const LogTable& table = tables[i];
    const double log_h = std::clamp(log_heads, table.log_x.front(), table.log_x.back());
    return table.log_held(log_h) - log_h - (table.log_y.back() - table.log_x.back());
  };
  const double log_length = std::log(length);
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
  const double length = std::sqrt(query_tokens * key_tokens);
  const double forward_excess =
      std::max(0.0, std::expm1(call_log_slowdown(call_forward_, length, call_heads)));
  const double backward_excess =
      std::max(0.0, std::expm1(call_log_slowdown(call_backward_, length, call_heads)));
  return head_forward_s(query_tokens, key_tokens) * forward_excess +
         head_backward_s(query_tokens, key_tokens) * backward_excess;
}

// The segments each rank of `placement` attends, as the engine groups them into calls (see
// the step program's dense groups, docs/architecture.md): self-attention of its block's heads against
// every block (one call per ring step), and cross-attention of its chunk to the text.
void CostModel::add_attention_calls(const Sequence& sequence, const Placement& placement,
                                    std::vector<RankCall>* calls) const {
  std::vector<CallKey> keys;
  const int64_t u = placement.ulysses_degree;
  for (int64_t j = 0; j < placement.ring_degree; ++j) {
    for (int64_t k = 0; k < u; ++k) {
      position_calls(sequence, placement, j, k, &keys);
      const int64_t rank = placement.ranks[j * u + k];
      for (const CallKey& key : keys) calls->push_back({rank, key});
    }
  }
}

// Position (j, k) holds block j of the ring and head group k of the Ulysses group. Every key it
// lists differs from the others (ring steps by step, the text call by its tag).
void CostModel::position_calls(const Sequence& sequence, const Placement& placement, int64_t j,
                               int64_t k, std::vector<CallKey>* keys) const {
  keys->clear();
  const int64_t unit_tokens = attended_tokens(model_, sequence.num_tokens, sequence.text_tokens);
  const int64_t u = placement.ulysses_degree;
  const int64_t r = placement.ring_degree;
  const int64_t all_heads = model_.num_heads;
  const bool cross = !model_.joint_attention && sequence.text_tokens > 0;
  const int64_t small_block = unit_tokens / r, num_big_blocks = unit_tokens % r;
  const auto block_of = [&](int64_t i) { return small_block + (i < num_big_blocks ? 1 : 0); };
  const int64_t block = block_of(j);
  const int64_t chunk = block / u + (k < block % u ? 1 : 0);
  const int64_t heads = all_heads / u + (k < all_heads % u ? 1 : 0);
  if (block > 0 && heads > 0) {
    for (int64_t step = 0; step < r; ++step) {
      const int64_t key_block = block_of((j + r - step) % r);
      if (key_block == 0) continue;
      const int64_t tag = r == 1 ? -1 : sequence.id;
      keys->push_back({block, key_block, heads, tag, r == 1 ? 0 : step});
    }
  }
  if (cross && chunk > 0) keys->push_back({chunk, sequence.text_tokens, all_heads, kCrossTag, 0});
}

int CostModel::ragged_kind(const CallKey& key) const {
  if (key[3] == kCrossTag) return 2;
  if (key[3] != -1) return -1;  // a ring step's sequence
  return key[2] == model_.num_heads ? 0 : 1;  // a Ulysses rank holds fewer heads than all
}

std::array<bool, CostModel::kRaggedKinds> CostModel::ragged_tables(
    std::vector<RankCall>::const_iterator first, std::vector<RankCall>::const_iterator last) const {
  std::array<bool, kRaggedKinds> ragged{};
  if (!profile_.attention_ragged) return ragged;
  std::array<int64_t, kRaggedKinds> calls{}, heads{}, longest{};
  std::array<bool, kRaggedKinds> one_head_count{true, true, true};
  for (auto it = first; it != last; ++it) {
    if (it != first && std::prev(it)->key == it->key) continue;  // one call per distinct key
    const int kind = ragged_kind(it->key);
    if (kind < 0) continue;
    if (calls[kind]++ == 0) heads[kind] = it->key[2];
    one_head_count[kind] = one_head_count[kind] && heads[kind] == it->key[2];
    longest[kind] = std::max({longest[kind], it->key[0], it->key[1]});
  }
  for (int kind = 0; kind < kRaggedKinds; ++kind) {
    ragged[kind] = calls[kind] >= kRaggedMinCalls && one_head_count[kind] &&
                   longest[kind] <= kRaggedMaxSegmentTokens;
  }
  return ragged;
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
      shape.call_excess_s[0][q][k] = call_excess_per_head_s(lq, lk, heads);
      if (model_.num_heads % ulysses_degree != 0) {  // some ranks hold one head more
        shape.call_excess_s[1][q][k] = call_excess_per_head_s(lq, lk, heads + 1);
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
    const double cross_s =
        all_heads * (head_forward_s(n, text) + head_backward_s(n, text) +
                     (shape.price_calls ? call_excess_per_head_s(n, text, all_heads) : 0.0));
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

std::vector<RankShare> CostModel::shares_and_bytes(const Sequence& sequence,
                                                   const Placement& placement,
                                                   double* sent_bytes) const {
  const int64_t unit_tokens = attended_tokens(model_, sequence.num_tokens, sequence.text_tokens);
  const int64_t u = placement.ulysses_degree;
  const int64_t r = placement.ring_degree;
  const Shape shape = make_shape(unit_tokens, sequence.text_tokens, u, r);
  const int64_t all_heads = model_.num_heads;

  std::vector<bool> ring_intra(static_cast<size_t>(u), true);
  if (r > 1) {
    for (int64_t k = 0; k < u; ++k) ring_intra[k] = same_node(cluster_, placement.ranks, k, u, r);
  }
  std::vector<RankShare> result;
  result.reserve(placement.ranks.size());
  double sent = 0;
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
  for (int64_t j = 0; j < r; ++j) {
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
      result.push_back(share);
      sent += terms.sent_bytes;
      if (share.rank != sequence.source_rank) {
        sent += 2.0 * kRouteBytesPerToken * static_cast<double>(chunk);
      }
    }
  }
  if (sent_bytes != nullptr) *sent_bytes = sent;
  return result;
}

std::vector<RankShare> CostModel::shares(const Sequence& sequence,
                                         const Placement& placement) const {
  return shares_and_bytes(sequence, placement, nullptr);
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
  // gradients of layers > j (blocks only; the root's come last).
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
    const double grads = static_cast<double>(layers - 1 - j) * layer_gradient_bytes_;
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

double CostModel::memory_capacity_bytes() const {
  return static_cast<double>(cluster_.gpu_memory_bytes) * (1.0 - options_.memory_headroom);
}

double CostModel::rank_time_s(int64_t tokens, double attention_s, double exchange_s) const {
  return linear_time_s(tokens) + attention_s + exchange_s;
}

size_t EvaluationCache::KeyHash::operator()(const std::vector<int64_t>& key) const {
  uint64_t hash = 1469598103934665603ull;
  for (int64_t value : key) {
    hash ^= static_cast<uint64_t>(value) + 0x9e3779b97f4a7c15ull + (hash << 6) + (hash >> 2);
  }
  return static_cast<size_t>(hash);
}

namespace {
// Stands for the sequence's own id in a memoised call key (ring steps never coalesce across
// sequences).
constexpr int64_t kOwnTag = std::numeric_limits<int64_t>::min();
}  // namespace

// Key: lengths, degrees, then each rank's node renumbered by first appearance (shares depend on
// the ranks only through which of them share a node).
EvaluationCache::Entry& CostModel::cached_terms(const Sequence& sequence,
                                                const Placement& placement,
                                                EvaluationCache& cache) const {
  EvaluationCache::Entry* found = nullptr;
  bool inserted = false;
  if (placement.ranks.size() == 1) {
    auto [it, is_new] =
        cache.local_entries_.try_emplace({sequence.num_tokens, sequence.text_tokens});
    found = &it->second;
    inserted = is_new;
  } else {
    found = &find_entry(sequence, placement, cache, &inserted);
  }
  EvaluationCache::Entry& entry = *found;
  if (!inserted) return entry;
  fill_entry(sequence, placement, &entry);
  return entry;
}

EvaluationCache::Entry& CostModel::find_entry(const Sequence& sequence, const Placement& placement,
                                              EvaluationCache& cache, bool* inserted) const {
  std::vector<int64_t>& key = cache.key_;
  key.assign({sequence.num_tokens, sequence.text_tokens, placement.ulysses_degree,
              placement.ring_degree});
  int64_t first_node = -1, next_label = 0;
  int64_t last_node = -1, last_label = 0;  // the last node looked up in `labels`, its label
  std::unordered_map<int64_t, int64_t> labels;
  for (int64_t rank : placement.ranks) {
    const int64_t node = cluster_.node_of(rank);
    if (placement.ranks.size() <= 1 || node == first_node) {
      key.push_back(0);
      continue;
    }
    if (first_node < 0) {  // label 0, told apart without the map
      first_node = node;
      ++next_label;
      key.push_back(0);
      continue;
    }
    if (node != last_node) {  // ranks of one node usually come together: one lookup per run
      const auto [it, inserted] = labels.try_emplace(node, next_label);
      if (inserted) ++next_label;
      last_node = node;
      last_label = it->second;
    }
    key.push_back(last_label);
  }
  auto [it, is_new] = cache.entries_.try_emplace(key);
  *inserted = is_new;
  return it->second;
}

void CostModel::fill_entry(const Sequence& sequence, const Placement& placement,
                           EvaluationCache::Entry* out) const {
  EvaluationCache::Entry& entry = *out;
  double sent = 0;
  entry.shares = shares_and_bytes(sequence, placement, &sent);
  for (RankShare& share : entry.shares) {
    if (share.rank != sequence.source_rank) {
      sent -= 2.0 * kRouteBytesPerToken * static_cast<double>(share.tokens);
    }
  }
  entry.exchange_bytes = sent;
  for (size_t k = 0; k < entry.shares.size(); ++k) entry.shares[k].rank = static_cast<int64_t>(k);
  // Each position's call excess, summed over its calls in key order (as evaluate lists them).
  // A position's calls are fixed by its block, head count and text chunk up to the ring step
  // (every position's ring meets every block once), so positions alike share one sum: a ring
  // over thousands of ranks lists a few positions' calls, not every one's.
  const int64_t u = placement.ulysses_degree;
  const int64_t r = placement.ring_degree;
  entry.call_excess_s.assign(entry.shares.size(), 0.0);
  entry.calls.clear();
  entry.calls_listed = false;
  const double layers = static_cast<double>(model_.num_layers);
  // Positions repeat a few (query, key, heads) triples (a ring has at most two block sizes):
  // each one's excess is priced once.
  std::vector<std::pair<std::array<int64_t, 3>, double>> excess_per_head_s;
  std::vector<std::pair<std::array<int64_t, 3>, double>> excess_of_position;  // by its triple
  std::vector<CallKey> keys;
  Sequence own = sequence;  // keys ordered as list_calls orders them
  own.id = kOwnTag;
  const int64_t unit_tokens = attended_tokens(model_, sequence.num_tokens, sequence.text_tokens);
  const int64_t all_heads = model_.num_heads;
  for (int64_t j = 0; j < r; ++j) {
    const int64_t block = unit_tokens / r + (j < unit_tokens % r ? 1 : 0);
    for (int64_t k = 0; k < u; ++k) {
      const std::array<int64_t, 3> position = {block, block / u + (k < block % u ? 1 : 0),
                                               all_heads / u + (k < all_heads % u ? 1 : 0)};
      auto alike = std::find_if(excess_of_position.begin(), excess_of_position.end(),
                                [&](const auto& item) { return item.first == position; });
      if (alike == excess_of_position.end()) {
        position_calls(own, placement, j, k, &keys);
        std::sort(keys.begin(), keys.end());  // distinct keys, one segment each
        double excess_s = 0;
        for (const CallKey& call : keys) {
          const std::array<int64_t, 3> lengths_heads = {call[0], call[1], call[2]};
          auto known = std::find_if(excess_per_head_s.begin(), excess_per_head_s.end(),
                                    [&](const auto& item) { return item.first == lengths_heads; });
          if (known == excess_per_head_s.end()) {
            excess_per_head_s.push_back(
                {lengths_heads,
                 call_excess_per_head_s(static_cast<double>(call[0]), static_cast<double>(call[1]),
                                        static_cast<double>(call[2]))});
            known = excess_per_head_s.end() - 1;
          }
          const double heads = static_cast<double>(call[2]);
          excess_s += layers * 1.0 * heads * known->second;
          if (call[3] == kCrossTag && stream_gain_bound_ > 0) {
            // what the cross-attention table's streams may save of this call at most: the floor
            // takes it off with the excess (evaluate prices the actual saving per rank)
            const double lq = static_cast<double>(call[0]), lk = static_cast<double>(call[1]);
            excess_s += stream_gain_bound_ * layers * heads *
                        (head_forward_s(lq, lk) + head_backward_s(lq, lk) + known->second);
          }
        }
        excess_of_position.push_back({position, excess_s});
        alike = excess_of_position.end() - 1;
      }
      entry.call_excess_s[j * u + k] = alike->second;
    }
  }
}

void CostModel::list_calls(const Sequence& sequence, const Placement& placement,
                           EvaluationCache::Entry* entry) const {
  if (entry->calls_listed) return;
  entry->calls_listed = true;
  Sequence own = sequence;
  own.id = kOwnTag;
  const int64_t u = placement.ulysses_degree;
  entry->calls.resize(placement.ranks.size());
  std::vector<CallKey> keys;
  for (int64_t j = 0; j < placement.ring_degree; ++j) {
    for (int64_t k = 0; k < u; ++k) {
      position_calls(own, placement, j, k, &keys);
      std::sort(keys.begin(), keys.end());  // distinct keys, one segment each
      auto& calls = entry->calls[j * u + k];
      calls.clear();
      for (const CallKey& key : keys) calls.push_back({key, 1});
    }
  }
}

double CostModel::makespan_floor(const Batch& batch, const Plan& plan,
                                 EvaluationCache& cache) const {
  const int64_t num_ranks = cluster_.num_ranks();
  std::vector<int64_t> tokens(static_cast<size_t>(num_ranks), 0);
  std::vector<double> other_s(static_cast<size_t>(num_ranks), 0.0);
  std::unordered_map<int64_t, const Sequence*> by_id;
  const size_t num_sequences = batch.sequences.size();
  const bool skips_recompute = options_.activation_checkpointing && options_.adaptive_checkpointing;
  for (size_t i = 0; i < plan.placements.size(); ++i) {
    const Placement& placement = plan.placements[i];
    const Sequence* sequence = i < num_sequences ? &batch.sequences[i] : nullptr;
    if (sequence == nullptr || sequence->id != placement.sequence_id) {  // not in batch order
      if (by_id.empty()) {
        for (const Sequence& s : batch.sequences) by_id[s.id] = &s;
      }
      sequence = by_id.at(placement.sequence_id);
    }
    const EvaluationCache::Entry& entry = cached_terms(*sequence, placement, cache);
    for (size_t k = 0; k < entry.shares.size(); ++k) {
      const RankShare& share = entry.shares[k];
      const int64_t rank = placement.ranks[k];
      tokens[rank] += share.tokens;
      other_s[rank] += share.attention_s + share.exchange_s - entry.call_excess_s[k];
      // Adaptive checkpointing may skip every layer's recompute where memory allows.
      if (skips_recompute) other_s[rank] -= share.recompute_s + share.recompute_exchange_s;
    }
  }
  return floor_of_totals(tokens, other_s);
}

void CostModel::floor_terms(const Sequence& sequence, const Placement& placement,
                            EvaluationCache& cache, std::vector<FloorTerm>* terms) const {
  const bool skips_recompute = options_.activation_checkpointing && options_.adaptive_checkpointing;
  const EvaluationCache::Entry& entry = cached_terms(sequence, placement, cache);
  terms->resize(entry.shares.size());
  for (size_t k = 0; k < entry.shares.size(); ++k) {
    const RankShare& share = entry.shares[k];
    (*terms)[k].tokens = share.tokens;
    (*terms)[k].added_s = share.attention_s + share.exchange_s - entry.call_excess_s[k];
    (*terms)[k].skipped_s = skips_recompute ? share.recompute_s + share.recompute_exchange_s : 0.0;
  }
}

double CostModel::floor_of_totals(const std::vector<int64_t>& tokens,
                                  const std::vector<double>& other_s) const {
  const bool skips_recompute = options_.activation_checkpointing && options_.adaptive_checkpointing;
  double floor_s = 0;
  for (size_t rank = 0; rank < tokens.size(); ++rank) {
    const double linear_s = linear_time_s(tokens[rank]) -
                            (skips_recompute ? linear_recompute_s(tokens[rank]) : 0.0);
    floor_s = std::max(floor_s, linear_s + other_s[rank]);
  }
  return floor_s;
}

double CostModel::min_floor_time_per_token_s() const {
  if (!(options_.activation_checkpointing && options_.adaptive_checkpointing)) {
    return min_linear_time_per_token_s_;
  }
  // linear_time_s - linear_recompute_s per token: one forward pass and one elementwise pass less,
  // each at its fastest rate.
  const double d = static_cast<double>(model_.width);
  const double bpe = static_cast<double>(options_.bytes_per_element);
  return min_linear_time_per_token_s_ -
         static_cast<double>(model_.num_layers) *
             (forward_flops_per_token_ /
                  max_rate(profile_.matmul_forward_flops_per_s, profile_.matmul_flops_per_s) +
              kElementwiseBytesPerTokenWidth * d * bpe / profile_.memory_bytes_per_s);
}

double CostModel::floor_rank_seconds(const Sequence& sequence, const Placement& placement,
                                     EvaluationCache& cache) const {
  const bool skips_recompute = options_.activation_checkpointing && options_.adaptive_checkpointing;
  const double rate_s = min_floor_time_per_token_s();
  const EvaluationCache::Entry& entry = cached_terms(sequence, placement, cache);
  double total_s = 0;
  for (size_t k = 0; k < entry.shares.size(); ++k) {
    const RankShare& share = entry.shares[k];
    // As makespan_floor adds it to the rank.
    double other_s = share.attention_s + share.exchange_s - entry.call_excess_s[k];
    if (skips_recompute) other_s -= share.recompute_s + share.recompute_exchange_s;
    total_s += rate_s * static_cast<double>(share.tokens) + other_s;
  }
  return total_s;
}

std::vector<RankShare> CostModel::shares(const Sequence& sequence, const Placement& placement,
                                         EvaluationCache& cache) const {
  std::vector<RankShare> result = cached_terms(sequence, placement, cache).shares;
  for (size_t k = 0; k < result.size(); ++k) result[k].rank = placement.ranks[k];
  return result;
}

PlanCost CostModel::evaluate(const Batch& batch, const Plan& plan) const {
  return evaluate_impl(batch, plan, nullptr);
}

PlanCost CostModel::evaluate(const Batch& batch, const Plan& plan, EvaluationCache& cache) const {
  return evaluate_impl(batch, plan, &cache);
}

PlanCost CostModel::evaluate_impl(const Batch& batch, const Plan& plan,
                                  EvaluationCache* cache) const {
  const int64_t num_ranks = cluster_.num_ranks();
  if (plan.num_ranks != num_ranks) {
    throw std::invalid_argument("plan is for " + std::to_string(plan.num_ranks) +
                                " ranks but the cluster has " + std::to_string(num_ranks));
  }
  validate_plan(plan, batch, num_ranks, model_.num_heads);
  std::unordered_map<int64_t, const Sequence*> by_id;
  by_id.reserve(batch.sequences.size());
  for (const Sequence& sequence : batch.sequences) by_id[sequence.id] = &sequence;

  PlanCost cost;
  cost.ranks.assign(static_cast<size_t>(num_ranks), RankCost{});
  // per rank: one layer's kept activations without / with checkpointing, buffers, recompute
  std::vector<double> activation(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> checkpoint(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> buffer(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> recompute(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> recompute_exchange(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> input(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> attention_recompute(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> attention_recompute_exchange(static_cast<size_t>(num_ranks), 0.0);
  // per rank: held tokens of each phase of its attention backward (local sequences' calls, the
  // calls of the sequences Ulysses exchanged, ring steps), whose buffers never coexist
  std::vector<std::array<double, 3>> phase_tokens(static_cast<size_t>(num_ranks), {0, 0, 0});
  const auto phase_of = [](const Placement& placement) {
    return placement.ring_degree > 1 ? 2 : placement.ulysses_degree > 1 ? 1 : 0;
  };
  // Every segment's call, by rank at the end: a rank's calls sorted by key, equal keys merged (a
  // vector sorted once, not a map per rank: a ring over thousands of ranks lists millions).
  std::vector<RankCall> calls;
  auto add_share = [&](const RankShare& share, int64_t rank_index, int phase) {
    RankCost& rank = cost.ranks[rank_index];
    rank.tokens += share.tokens;
    phase_tokens[rank_index][phase] += static_cast<double>(share.tokens);
    rank.attention_s += share.attention_s;
    rank.exchange_s += share.exchange_s;
    activation[rank_index] += share.layer_activation_bytes;
    checkpoint[rank_index] += share.layer_checkpoint_bytes;
    buffer[rank_index] += share.buffer_bytes;
    recompute[rank_index] += share.recompute_s;
    recompute_exchange[rank_index] += share.recompute_exchange_s;
    input[rank_index] += share.layer_input_bytes;
    attention_recompute[rank_index] += share.attention_recompute_s;
    attention_recompute_exchange[rank_index] += share.attention_recompute_exchange_s;
  };
  for (const Placement& placement : plan.placements) {
    double sent = 0;
    const Sequence& sequence = *by_id.at(placement.sequence_id);
    if (cache != nullptr) {
      EvaluationCache::Entry& entry = cached_terms(sequence, placement, *cache);
      list_calls(sequence, placement, &entry);
      for (size_t k = 0; k < entry.shares.size(); ++k) {
        const int64_t rank_index = placement.ranks[k];
        add_share(entry.shares[k], rank_index, phase_of(placement));
        if (rank_index != sequence.source_rank) {
          sent += 2.0 * kRouteBytesPerToken * static_cast<double>(entry.shares[k].tokens);
        }
        for (auto [call, segments] : entry.calls[k]) {
          if (call[3] == kOwnTag) call[3] = sequence.id;
          calls.push_back({rank_index, call, segments});
        }
      }
      cost.exchange_bytes += entry.exchange_bytes + sent;
      continue;
    }
    add_attention_calls(sequence, placement, &calls);
    for (const RankShare& share : shares_and_bytes(sequence, placement, &sent)) {
      add_share(share, share.rank, phase_of(placement));
    }
    cost.exchange_bytes += sent;
  }
  // By rank (counting sort), then each rank's calls by key.
  std::vector<size_t> rank_begin(static_cast<size_t>(num_ranks) + 1, 0);
  for (const RankCall& call : calls) ++rank_begin[call.rank + 1];
  for (int64_t i = 0; i < num_ranks; ++i) rank_begin[i + 1] += rank_begin[i];
  std::vector<RankCall> by_rank(calls.size());
  {
    std::vector<size_t> next(rank_begin.begin(), rank_begin.end() - 1);
    for (const RankCall& call : calls) by_rank[next[call.rank]++] = call;
  }
  const double capacity = memory_capacity_bytes();
  std::vector<std::pair<int64_t, double>> streamed;  // a rank's cross-attention calls: work, s
  for (int64_t i = 0; i < num_ranks; ++i) {
    RankCost& rank = cost.ranks[i];
    rank.linear_s = linear_time_s(rank.tokens);
    const double layers = static_cast<double>(model_.num_layers);
    const auto first = by_rank.begin() + static_cast<std::ptrdiff_t>(rank_begin[i]);
    const auto last = by_rank.begin() + static_cast<std::ptrdiff_t>(rank_begin[i + 1]);
    std::sort(first, last, [](const RankCall& a, const RankCall& b) { return a.key < b.key; });
    int64_t distinct_calls = 0;
    streamed.clear();
    const std::array<bool, kRaggedKinds> ragged = ragged_tables(first, last);
    for (auto it = first; it != last;) {
      const CallKey& key = it->key;
      int64_t segments = 0;
      for (; it != last && it->key == key; ++it) segments += it->segments;
      const double heads = static_cast<double>(key[2]);
      const double call_heads = static_cast<double>(segments) * heads;
      const double lq = static_cast<double>(key[0]), lk = static_cast<double>(key[1]);
      const int kind = ragged_kind(key);
      if (kind >= 0 && ragged[kind]) {
        // One ragged call runs every segment at the per-head tables' rate (0.89-1.05 of one
        // dense call of the same FLOPs on the twelve packs of bench/attention_engine.py, within
        // the tables' own error; bench/results/ragged_pricing_h200_202612.md): none of the
        // excess the shares priced.
        rank.call_s -= layers * call_heads * call_excess_per_head_s(lq, lk, heads);
        continue;
      }
      ++distinct_calls;
      if (segments > 1) {  // the shares priced each segment as a call of its own
        rank.call_s +=
            layers * call_heads *
            (call_excess_per_head_s(lq, lk, call_heads) - call_excess_per_head_s(lq, lk, heads));
      }
      if (key[3] == kCrossTag && profile_.attention_streams > 1) {
        const double seconds = layers * call_heads *
                               (head_forward_s(lq, lk) + head_backward_s(lq, lk) +
                                call_excess_per_head_s(lq, lk, call_heads));
        streamed.push_back({segments * key[0] * key[1] * key[2], seconds});
      }
    }
    // The cross-attention table runs its calls on the profile's streams (runtime/attention.py
    // cross_attention: coalesced_attention at the device's count); self- and joint attention of
    // the distributed step run one call after another (forward_into / backward_into on one
    // stream), as do ring steps, so only this table's calls overlap.
    if (streamed.size() > 1) {
      // most work first, as coalesced.SegmentTable.calls orders them (ties: key order)
      std::stable_sort(streamed.begin(), streamed.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      std::vector<int64_t> works;
      std::vector<double> seconds;
      double serial_s = 0;
      for (const auto& [work, call_s] : streamed) {
        works.push_back(work);
        seconds.push_back(call_s);
        serial_s += call_s;
      }
      rank.stream_s = streamed_calls_s(works, seconds, profile_.attention_streams,
                                       profile_.attention_stream_overlap) -
                      serial_s;
      rank.call_s += rank.stream_s;
    }
    // A ragged table is one call to the host too: in the step program on one H200 it issued in
    // 1.2-2.0 ms forward + backward, where the groups took 1.9 ms + 0.38 ms per dense call
    // (bench/results/ragged_pricing_h200_202612.md).
    rank.attention_calls = distinct_calls + std::count(ragged.begin(), ragged.end(), true);
    if (rank.tokens > 0) {
      rank.launch_floor_s =
          layers *
          (launch_s_per_layer_ + launch_s_per_call_ * static_cast<double>(rank.attention_calls));
    }
    // Checkpoint every layer, none, or (adaptive) the fewest whose peak fits, keeping their
    // attention outputs; where even that does not fit, the fewest of them that recompute their
    // attention too (full recompute) so that it fits; a rank that fits nowhere recomputes all.
    const int64_t num_layers = model_.num_layers;
    // The shares' buffers hold attention_phase_bytes_ for every token; only the largest phase's
    // exist at once (the planners' additive sizing keeps them all: it errs above, never below).
    if (attention_phase_bytes_ > 0) {
      const std::array<double, 3>& phases = phase_tokens[i];
      const double outside_largest =
          phases[0] + phases[1] + phases[2] - std::max({phases[0], phases[1], phases[2]});
      buffer[i] = std::max(0.0, buffer[i] - attention_phase_bytes_ * outside_largest);
    }
    const auto peak = [&](int64_t k, int64_t f) {
      return rank_peak_bytes(activation[i], checkpoint[i], input[i], buffer[i], k, f,
                             rank.tokens);
    };
    // The first count in [first, last) whose peak fits, else `last`. A peak that cannot grow
    // with the count (each layer it covers keeps no more bytes) is bisected, else scanned.
    const auto fewest_fitting = [&](int64_t first, int64_t last, bool monotone, auto&& peak_of) {
      if (!monotone) {
        for (int64_t count = first; count < last; ++count) {
          if (peak_of(count) <= capacity) return count;
        }
        return last;
      }
      int64_t low = first, high = last;  // the answer lies in [low, high]
      while (low < high) {
        const int64_t middle = low + (high - low) / 2;
        if (peak_of(middle) <= capacity) {
          high = middle;
        } else {
          low = middle + 1;
        }
      }
      return low;
    };
    int64_t k = options_.activation_checkpointing ? num_layers : 0, f = 0;
    if (options_.activation_checkpointing) {
      if (options_.adaptive_checkpointing) {
        k = fewest_fitting(0, num_layers, checkpoint[i] <= activation[i],
                           [&](int64_t fewer) { return peak(fewer, 0); });
      }
      if (k == num_layers && peak(k, 0) > capacity) {
        f = fewest_fitting(1, num_layers, input[i] <= checkpoint[i],
                           [&](int64_t full) { return peak(k, full); });
      }
    }
    rank.checkpointed_layers = k;
    rank.full_recompute_layers = f;
  }
  // The recompute of a layer sends q, k, v again where the plan has a Ulysses placement, and
  // that all-to-all spans the world (runtime/attention.py): every rank must then recompute the
  // same layers (and run the same of them in full), the most any rank needs.
  const bool world_exchange =
      std::any_of(plan.placements.begin(), plan.placements.end(),
                  [](const Placement& p) { return p.ulysses_degree > 1; });
  int64_t most_checkpointed = 0, most_full = 0;
  for (const RankCost& rank : cost.ranks) {
    most_checkpointed = std::max(most_checkpointed, rank.checkpointed_layers);
    most_full = std::max(most_full, rank.full_recompute_layers);
  }
  for (int64_t i = 0; i < num_ranks; ++i) {
    RankCost& rank = cost.ranks[i];
    if (world_exchange) {
      rank.checkpointed_layers = most_checkpointed;
      rank.full_recompute_layers = most_full;
    }
    const int64_t k = rank.checkpointed_layers, f = rank.full_recompute_layers;
    rank.peak_bytes =
        rank_peak_bytes(activation[i], checkpoint[i], input[i], buffer[i], k, f, rank.tokens);
    // Layers that keep their activations skip the recompute; full ones recompute attention too.
    if (options_.activation_checkpointing) {
      const double layers = static_cast<double>(model_.num_layers);
      const double skipped = static_cast<double>(model_.num_layers - k) / layers;
      const double full = static_cast<double>(f) / layers;
      rank.linear_s -= skipped * linear_recompute_s(rank.tokens);
      rank.attention_s += full * attention_recompute[i] - skipped * recompute[i];
      rank.exchange_s +=
          full * attention_recompute_exchange[i] - skipped * recompute_exchange[i];
    }
    rank.time_s = std::max(rank.linear_s + rank.attention_s + rank.call_s + rank.exchange_s,
                           rank.launch_floor_s);
    cost.makespan_s = std::max(cost.makespan_s, rank.time_s);
    cost.peak_bytes = std::max(cost.peak_bytes, rank.peak_bytes);
    if (rank.peak_bytes > capacity) cost.fits = false;
  }
  return cost;
}

namespace {

// Lower envelope of an attention time per unit area: inf over x in [1, X] of seconds(x) / x^2,
// where seconds(x) is one head's pass over an x-by-x block. Between knots the log-log table is a
// power law, so the infimum over [1, X] is the minimum over the knots up to the first one at or
// past X (or the value at X beyond the last knot).
class AreaEnvelope {
 public:
  template <class PerHeadSeconds>
  AreaEnvelope(const Table& table, PerHeadSeconds seconds) {
    const auto per_area = [seconds](double x) { return seconds(x) / (x * x); };
    knots_.push_back(1.0);
    for (double x : table.x) {
      if (x > 1.0) knots_.push_back(x);
    }
    for (double x : knots_) {
      const double value = per_area(x);
      prefix_min_.push_back(prefix_min_.empty() ? value : std::min(prefix_min_.back(), value));
    }
    tail_ = [per_area](double x) { return per_area(x); };
  }

  double operator()(double at) const {
    const size_t i =
        static_cast<size_t>(std::upper_bound(knots_.begin(), knots_.end(), at) - knots_.begin());
    // knots_[i - 1] <= at < knots_[i]
    if (i < knots_.size()) return prefix_min_[i];
    return std::min(prefix_min_.back(), tail_(std::max(at, 1.0)));
  }

 private:
  std::vector<double> knots_;
  std::vector<double> prefix_min_;
  std::function<double(double)> tail_;
};

}  // namespace

// makespan_lower_bound's whole-share refinement (below): only while (distinct lengths) x ranks
// is at most this; how far above the fluid bound it looks; its multipliers, per T.
constexpr double kExclusiveShareWork = 8192;
constexpr int64_t kExclusiveShareRanks = 64;
constexpr double kExclusiveShareReach = 1.25;
constexpr int kExclusiveShareClasses = 4;
constexpr double kExclusiveShareMultipliers[] = {0.0,  0.02, 0.05, 0.1, 0.15, 0.2,
                                                 0.25, 0.3,  0.4,  0.5, 0.7,  1.0};

// The candidate search behind makespan_lower_bound; see the derivation in cost_model.h.
struct LowerBoundSearch {
  struct Result {
    bool fits = true;
    double bottleneck_s = 0;
    double rank_seconds = 0;
    double least_share_s = std::numeric_limits<double>::infinity();  // additive, least rank
  };

  explicit LowerBoundSearch(const CostModel& model)
      : cost(model),
        num_ranks(model.cluster().num_ranks()),
        gpus_per_node(model.cluster().gpus_per_node),
        num_heads(model.model().num_heads),
        capacity_bytes(model.memory_capacity_bytes()),
        min_per_token_s(model.min_linear_time_per_token_s()),
        layers(static_cast<double>(model.model().num_layers)),
        forward_envelope(model.profile().attention_forward_s_per_head,
                         [&model](double x) { return model.head_forward_s(x, x); }),
        backward_envelope(model.profile().attention_backward_s_per_head,
                          [&model](double x) { return model.head_backward_s(x, x); }) {}

  int64_t max_degree(int64_t unit_tokens) const { return std::min(num_ranks, unit_tokens); }

  // Every rank type of the shape (block class x next block class x chunk/head class) once, with
  // the most favourable links any rank set of this shape can have: a Ulysses group within one
  // node iff u <= gpus_per_node, a ring within one node iff r <= gpus_per_node.
  Result evaluate(const CostModel::Shape& shape) const {
    const int64_t u = shape.ulysses_degree;
    const int64_t r = shape.ring_degree;
    const bool ulysses_intra = u <= gpus_per_node;
    const bool ring_intra = r <= gpus_per_node;
    struct BlockType {
      int block_class, next_class;
      int64_t count;
    };
    BlockType types[4];
    int num_types = 0;
    const int64_t big = shape.num_big_blocks;
    if (big == 0) {
      types[num_types++] = {0, 0, r};
    } else {
      types[num_types++] = {1, 1, big - 1};
      types[num_types++] = {1, 0, 1};
      types[num_types++] = {0, 0, r - big - 1};
      types[num_types++] = {0, 1, 1};
    }
    Result result;
    ExcessMemo memo;
    for (int t = 0; t < num_types; ++t) {
      const BlockType& type = types[t];
      if (type.count <= 0) continue;
      const int64_t block = shape.block_tokens(type.block_class);
      // Chunk k is big iff k < block % u, head group k is big iff k < H % u: three ranges of k.
      const int64_t big_chunks = block % u;
      const int64_t big_heads = num_heads % u;
      const int64_t bounds[4] = {0, std::min(big_chunks, big_heads),
                                 std::max(big_chunks, big_heads), u};
      for (int range = 0; range < 3; ++range) {
        const int64_t ranks_in_range = bounds[range + 1] - bounds[range];
        if (ranks_in_range <= 0) continue;
        const int64_t k = bounds[range];
        const int64_t chunk = block / u + (k < big_chunks ? 1 : 0);
        const int64_t heads = num_heads / u + (k < big_heads ? 1 : 0);
        const CostModel::RankTerms terms = cost.rank_terms(shape, type.block_class, type.next_class,
                                                           chunk, heads, ulysses_intra, ring_intra);
        // The call excess this share's segments pay at least (they can only be grouped with
        // equal segments of other sequences) and the launch floor of its own calls.
        int64_t own_calls = 0;
        const double excess_s = least_call_excess_s(shape, type.block_class, chunk, heads,
                                                    &own_calls, &memo);
        const double time_s = static_cast<double>(chunk) * min_per_token_s + terms.attention_s +
                              terms.exchange_s + excess_s;
        const double launch_s =
            layers * (cost.launch_s_per_layer_ +
                      cost.launch_s_per_call_ * static_cast<double>(own_calls));
        // The fit test evaluate() applies to a rank holding only this share, recomputing every
        // layer in full (the least memory): the planners' additive sizing is stricter and would
        // exclude plans evaluate() accepts, so the bound would not hold for them.
        const int64_t checkpointed_layers =
            cost.options().activation_checkpointing ? cost.model().num_layers : 0;
        if (cost.rank_peak_bytes(terms.layer_activation_bytes, terms.layer_checkpoint_bytes,
                                 terms.layer_input_bytes, terms.buffer_bytes, checkpointed_layers,
                                 checkpointed_layers, chunk) > capacity_bytes) {
          result.fits = false;
        }
        result.bottleneck_s = std::max(result.bottleneck_s, std::max(time_s, launch_s));
        result.least_share_s = std::min(result.least_share_s, time_s);
        result.rank_seconds += static_cast<double>(type.count * ranks_in_range) * time_s;
      }
    }
    return result;
  }

  // The fewest seconds of call excess (evaluate's attention beyond the per-head tables, all
  // layers) that one rank's share of `shape` pays, and the number of distinct calls it adds to its
  // rank (so the rank's launch floor is at least that of these calls). A ring step's segment is
  // a call of its own (its key holds the sequence and the step), so it pays its excess exactly.
  // A self-attention segment without ring (key: length, length, heads) or a cross-attention
  // segment (chunk, text, all heads) joins equal segments of other sequences: at most one per
  // sequence of the same length (text length), so its call has between its own heads and that
  // many times as many, and it pays at least the smallest excess per head over that range.
  // Per shape, the excesses already found (rank types repeat them): a ring step's by head class,
  // query and key block class; cross-attention's by chunk length. NaN: not yet.
  struct ExcessMemo {
    double ring[2][2][2];
    int64_t cross_chunk[4] = {-1, -1, -1, -1};
    double cross_s[4] = {0, 0, 0, 0};
    ExcessMemo() {
      for (auto& by_q : ring) {
        for (auto& by_k : by_q) by_k[0] = by_k[1] = std::numeric_limits<double>::quiet_NaN();
      }
    }
  };

  double least_call_excess_s(const CostModel::Shape& shape, int block_class, int64_t chunk,
                             int64_t heads, int64_t* calls, ExcessMemo* memo) const {
    const double h = static_cast<double>(heads);
    const int64_t r = shape.ring_degree;
    const bool cross = !cost.model().joint_attention && shape.text_tokens > 0 && chunk > 0;
    *calls = (r == 1 ? 1 : r) + (cross ? 1 : 0);
    if (cost.call_log_lengths_.empty()) return 0;
    // A ragged table (profile.attention_ragged) pays no excess, and every segment but a ring
    // step's may be in one; its one call still counts at least once in the launch floor.
    const bool ragged = cost.profile_.attention_ragged;
    const double block = static_cast<double>(shape.block_tokens(block_class));
    double layer_s = 0;
    if (r == 1) {
      if (!ragged) {
        layer_s += h * least_excess_per_head_s(block, block, h,
                                               h * group_of(self_groups, shape.unit_tokens));
      }
    } else {
      const int64_t head_class =
          std::clamp<int64_t>(heads - num_heads / shape.ulysses_degree, 0, 1);
      for (int c = 0; c < 2; ++c) {
        const double count = static_cast<double>(shape.block_count(c));
        if (count == 0) continue;
        double& excess = memo->ring[head_class][block_class][c];
        if (std::isnan(excess)) {
          const double key_block = static_cast<double>(shape.block_tokens(c));
          excess = least_excess_per_head_s(block, key_block, h, h);
        }
        layer_s += count * h * excess;
      }
    }
    if (cross && !ragged) {
      int slot = 0;
      while (slot < 3 && memo->cross_chunk[slot] != chunk && memo->cross_chunk[slot] >= 0) ++slot;
      if (memo->cross_chunk[slot] != chunk) {
        const double all_heads = static_cast<double>(num_heads);
        memo->cross_chunk[slot] = chunk;
        memo->cross_s[slot] =
            all_heads * least_excess_per_head_s(
                            static_cast<double>(chunk), static_cast<double>(shape.text_tokens),
                            all_heads, all_heads * group_of(cross_groups, shape.text_tokens));
      }
      // the cross-attention table's streams may save this share of it (rank_terms)
      layer_s += (1.0 - cost.stream_gain_bound_) * memo->cross_s[slot];
    }
    return static_cast<double>(cost.model().num_layers) * layer_s;
  }

  static double group_of(const std::unordered_map<int64_t, int64_t>& groups, int64_t key) {
    const auto it = groups.find(key);
    return it == groups.end() ? 1.0 : static_cast<double>(std::max<int64_t>(1, it->second));
  }

  // A lower bound on call_excess_per_head_s(lq, lk, c) over call heads c in [low, high]: the
  // call tables' log slowdown is piecewise linear in log heads with breaks at the tables' knots,
  // so its least value over the range is at an end or a knot inside; forward and backward are
  // minimised apart.
  double least_excess_per_head_s(double lq, double lk, double low, double high) const {
    // Shapes of one sequence repeat these arguments a lot (and each costs dozens of table
    // lookups): memoised for the whole bound.
    const std::array<double, 4> key{lq, lk, low, high};
    const auto known = excess_memo.find(key);
    if (known != excess_memo.end()) return known->second;
    double& value = excess_memo[key];
    if (high <= low) return value = cost.call_excess_per_head_s(lq, lk, low);
    const double length = std::sqrt(lq * lk);
    double least_forward = std::numeric_limits<double>::infinity();
    double least_backward = least_forward;
    auto at = [&](double heads) {
      least_forward = std::min(least_forward, cost.call_log_slowdown(cost.call_forward_, length,
                                                                     heads));
      least_backward = std::min(least_backward, cost.call_log_slowdown(cost.call_backward_,
                                                                       length, heads));
    };
    at(low);
    at(high);
    if (call_knots.empty()) {  // every table's knots (heads), once
      for (const auto* tables : {&cost.call_forward_, &cost.call_backward_}) {
        for (const CostModel::LogTable& table : *tables) {
          call_knots.insert(call_knots.end(), table.log_x.begin(), table.log_x.end());
        }
      }
      std::sort(call_knots.begin(), call_knots.end());
      call_knots.erase(std::unique(call_knots.begin(), call_knots.end()), call_knots.end());
    }
    const double log_low = std::log(low), log_high = std::log(high);
    for (double log_x : call_knots) {
      if (log_x > log_low && log_x < log_high) at(std::exp(log_x));
    }
    return value = cost.head_forward_s(lq, lk) *
                       std::max(0.0, std::expm1(least_forward)) +
                   cost.head_backward_s(lq, lk) * std::max(0.0, std::expm1(least_backward));
  }

  // A lower bound on linear_time_s(m) / m over 1 <= m <= max_tokens: the per-token layers at the
  // fastest GEMM rates the profile reaches up to that many tokens (min_linear_time_per_token_s
  // takes them over every token count).
  double per_token_s_up_to(double max_tokens) const {
    const ModelSpec& model = cost.model();
    const HardwareProfile& profile = cost.profile();
    auto best_rate = [&](const CostModel::LogTable& table, double fallback) {
      if (table.empty()) return fallback;
      const double log_m = std::log(std::max(1.0, max_tokens));
      double best = table.log_held(log_m);
      for (size_t i = 0; i < table.log_x.size(); ++i) {
        if (i == 0 || table.log_x[i] <= log_m) best = std::max(best, table.log_y[i]);
      }
      return std::exp(best);
    };
    const double flops = cost.forward_flops_per_token_;
    const double d = static_cast<double>(model.width);
    const double bpe = static_cast<double>(cost.options().bytes_per_element);
    const double forward_passes = cost.options().activation_checkpointing ? 2.0 : 1.0;
    return static_cast<double>(model.num_layers) *
           (flops * forward_passes / best_rate(cost.matmul_forward_, profile.matmul_flops_per_s) +
            2.0 * flops / best_rate(cost.matmul_backward_, profile.matmul_flops_per_s) +
            kElementwiseBytesPerTokenWidth * d * bpe * (forward_passes + 1.0) /
                profile.memory_bytes_per_s);
  }

  // A lower bound on linear_time_s(m) / m for every rank of a plan of makespan `makespan_s`: such
  // a rank's per-token layers take at most makespan_s, so it holds at most makespan_s / (the
  // least per-token time) tokens, which bounds the GEMM rates it can reach (twice refined).
  double per_token_s_within(double makespan_s) const {
    double rate_s = min_per_token_s;
    for (int step = 0; step < 3; ++step) rate_s = per_token_s_up_to(makespan_s / rate_s);
    return std::max(rate_s, min_per_token_s);
  }

  Result evaluate(int64_t unit_tokens, int64_t text_tokens, int64_t u, int64_t r) const {
    return evaluate(cost.make_shape(unit_tokens, text_tokens, u, r, /*price_calls=*/false));
  }

  // A lower bound on the rank-seconds of every shape with ring degree >= r (u >= 1): per-token
  // layers at the best rate, attention areas at the envelope of blocks no longer than ceil(L/r),
  // text projections and ring latencies on at least r ranks. Non-decreasing in r.
  double rank_seconds_bound(int64_t unit_tokens, int64_t text_tokens, int64_t r) const {
    const ModelSpec& model = cost.model();
    const Cluster& cluster = cost.cluster();
    const double tokens = static_cast<double>(unit_tokens);
    const double heads = static_cast<double>(num_heads);
    const double layers = static_cast<double>(model.num_layers);
    const double longest_block = std::ceil(tokens / static_cast<double>(r));
    double bound = tokens * min_per_token_s;
    bound += layers * heads * tokens * tokens *
             (forward_envelope(longest_block) + backward_envelope(longest_block));
    if (!model.joint_attention && text_tokens > 0) {
      const double text = static_cast<double>(text_tokens);
      const double longest_pair = std::sqrt(longest_block * text);
      bound +=
          layers * heads * tokens * text *
              (forward_envelope(longest_pair) + backward_envelope(longest_pair)) +
          static_cast<double>(r) * layers * cost.text_projection_s(text_tokens);
    }
    if (r > 1) {
      const double latency_s =
          r <= gpus_per_node ? std::min(cluster.intra_node_latency_s, cluster.inter_node_latency_s)
                             : cluster.inter_node_latency_s;
      // ring steps of the forward and the backward (the recompute keeps the ring's outputs)
      bound += static_cast<double>(r * (r - 1)) * layers * 2.0 * latency_s;
    }
    return bound;
  }

  // Smallest total rank-seconds of a sequence over all fitting shapes (all shapes when
  // respect_memory is false).
  double min_rank_seconds(int64_t unit_tokens, int64_t text_tokens, bool respect_memory) const {
    const int64_t max_p = max_degree(unit_tokens);
    const double text_projection_s =
        static_cast<double>(cost.model().num_layers) * cost.text_projection_s(text_tokens);
    double best = std::numeric_limits<double>::infinity();
    for (int64_t r = 1; r <= max_p; ++r) {
      const double bound = rank_seconds_bound(unit_tokens, text_tokens, r);
      if (bound >= best) break;
      CostModel::Shape shape =
          cost.make_shape(unit_tokens, text_tokens, 1, r, /*price_calls=*/false);
      for (int64_t u = 1; u <= std::min(num_heads, max_p / r); ++u) {
        // More Ulysses ranks only add text projections to the bound.
        if (bound + static_cast<double>((u - 1) * r) * text_projection_s >= best) break;
        shape.ulysses_degree = u;
        const Result result = evaluate(shape);
        if (respect_memory && !result.fits) continue;
        best = std::min(best, result.rank_seconds);
      }
    }
    return best;
  }

  // Every shape of a sequence (fitting or not) with its degree.
  std::vector<std::pair<Result, int64_t>> every_shape(int64_t unit_tokens,
                                                      int64_t text_tokens) const {
    std::vector<std::pair<Result, int64_t>> shapes;
    const int64_t max_p = max_degree(unit_tokens);
    for (int64_t r = 1; r <= max_p; ++r) {
      CostModel::Shape shape =
          cost.make_shape(unit_tokens, text_tokens, 1, r, /*price_calls=*/false);
      for (int64_t u = 1; u <= std::min(num_heads, max_p / r); ++u) {
        shape.ulysses_degree = u;
        shapes.push_back({evaluate(shape), u * r});
      }
    }
    return shapes;
  }

  // Smallest bottleneck-rank time of a sequence over all fitting shapes, and its shape.
  double min_bottleneck_s(int64_t unit_tokens, int64_t text_tokens, bool respect_memory,
                          int64_t* best_u, int64_t* best_r) const {
    const int64_t max_p = max_degree(unit_tokens);
    double best = std::numeric_limits<double>::infinity();
    for (int64_t r = 1; r <= max_p; ++r) {
      CostModel::Shape shape =
          cost.make_shape(unit_tokens, text_tokens, 1, r, /*price_calls=*/false);
      for (int64_t u = 1; u <= std::min(num_heads, max_p / r); ++u) {
        shape.ulysses_degree = u;
        const Result result = evaluate(shape);
        if (respect_memory && !result.fits) continue;
        if (result.bottleneck_s < best) {
          best = result.bottleneck_s;
          *best_u = u;
          *best_r = r;
        }
      }
    }
    return best;
  }

  // Every fitting shape's (bottleneck, rank-seconds), sorted by bottleneck, rank-seconds replaced
  // by their prefix minimum: min_rank_seconds under a bottleneck cap is one binary search. Shapes
  // that cannot lower that minimum for any cap >= cut_s are skipped: the search stops at the
  // first ring degree whose rank_seconds_bound reaches the best rank-seconds seen with a
  // bottleneck <= cut_s.
  std::vector<std::pair<double, double>> frontier(int64_t unit_tokens, int64_t text_tokens,
                                                  double cut_s, bool respect_memory) const {
    const int64_t max_p = max_degree(unit_tokens);
    std::vector<std::pair<double, double>> points;
    double seconds_cut = std::numeric_limits<double>::infinity();
    for (int64_t r = 1; r <= max_p; ++r) {
      if (rank_seconds_bound(unit_tokens, text_tokens, r) >= seconds_cut) break;
      CostModel::Shape shape =
          cost.make_shape(unit_tokens, text_tokens, 1, r, /*price_calls=*/false);
      for (int64_t u = 1; u <= std::min(num_heads, max_p / r); ++u) {
        shape.ulysses_degree = u;
        const Result result = evaluate(shape);
        if (respect_memory && !result.fits) continue;
        points.push_back({result.bottleneck_s, result.rank_seconds});
        if (result.bottleneck_s <= cut_s) {
          seconds_cut = std::min(seconds_cut, result.rank_seconds);
        }
      }
    }
    std::sort(points.begin(), points.end());
    for (size_t i = 1; i < points.size(); ++i) {
      points[i].second = std::min(points[i].second, points[i - 1].second);
    }
    return points;
  }

  const CostModel& cost;
  int64_t num_ranks, gpus_per_node, num_heads;
  double capacity_bytes, min_per_token_s;
  double layers;
  // Sequences of the batch per unit length and per text length: how many equal segments one
  // call can group at most (least_call_excess_s).
  std::unordered_map<int64_t, int64_t> self_groups, cross_groups;
  mutable std::map<std::array<double, 4>, double> excess_memo;  // least_excess_per_head_s's
  mutable std::vector<double> call_knots;                       // log heads, sorted, unique
  AreaEnvelope forward_envelope, backward_envelope;
};

double makespan_lower_bound(const Batch& batch, const CostModel& cost_model) {
  LowerBoundSearch search(cost_model);
  const ModelSpec& model = cost_model.model();
  double total_unit_tokens = 0;
  for (const Sequence& sequence : batch.sequences) {
    const int64_t unit = attended_tokens(model, sequence.num_tokens, sequence.text_tokens);
    if (unit <= 0) continue;
    total_unit_tokens += static_cast<double>(unit);
    ++search.self_groups[unit];
    ++search.cross_groups[sequence.text_tokens];
  }
  // Shapes depend on (unit tokens, text tokens) only; buckets repeat them a lot.
  std::vector<std::pair<int64_t, int64_t>> keys;
  keys.reserve(batch.sequences.size());
  for (const Sequence& sequence : batch.sequences) {
    keys.emplace_back(attended_tokens(model, sequence.num_tokens, sequence.text_tokens),
                      sequence.text_tokens);
  }
  std::map<std::pair<int64_t, int64_t>, double> rank_seconds;
  double total_rank_seconds = 0;
  for (const auto& key : keys) {
    if (key.first <= 0) continue;
    auto [it, inserted] = rank_seconds.try_emplace(key, 0.0);
    if (inserted) {
      double value = search.min_rank_seconds(key.first, key.second, true);
      // A sequence that fits nowhere has no plan at all; keep the bound finite without memory.
      if (!std::isfinite(value)) value = search.min_rank_seconds(key.first, key.second, false);
      it->second = value;
    }
    total_rank_seconds += it->second;
  }

  // Bottleneck term: longest first; a sequence whose time under the current maximum's best shape
  // is already below that maximum cannot raise it.
  std::sort(keys.begin(), keys.end(), std::greater<>());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  double max_bottleneck_s = 0;
  int64_t max_u = 0, max_r = 0;
  for (const auto& [unit_tokens, text_tokens] : keys) {
    if (unit_tokens <= 0) continue;
    if (max_u > 0 && max_u * max_r <= search.max_degree(unit_tokens)) {
      const LowerBoundSearch::Result result =
          search.evaluate(unit_tokens, text_tokens, max_u, max_r);
      if (result.fits && result.bottleneck_s <= max_bottleneck_s) continue;
    }
    int64_t u = 0, r = 0;
    double value = search.min_bottleneck_s(unit_tokens, text_tokens, true, &u, &r);
    if (!std::isfinite(value))
      value = search.min_bottleneck_s(unit_tokens, text_tokens, false, &u, &r);
    if (value > max_bottleneck_s) {
      max_bottleneck_s = value;
      max_u = u;
      max_r = r;
    }
  }
  const double num_ranks = static_cast<double>(search.num_ranks);
  const double simple_s = std::max(max_bottleneck_s, total_rank_seconds / num_ranks);

  // Tighter: in a plan of makespan T every sequence takes a shape whose bottleneck is <= T, and
  // the rank-seconds of all sequences fit into num_ranks x T. So the makespan is above every T
  // with sum_i (min rank-seconds of sequence i over shapes with bottleneck <= T) > num_ranks x T;
  // the left side falls and the right side rises with T, so bisection finds the largest such T.
  std::map<std::pair<int64_t, int64_t>, int64_t> counts;
  for (const auto& [key, value] : rank_seconds) counts[key] = 0;
  for (const Sequence& sequence : batch.sequences) {
    const int64_t unit = attended_tokens(model, sequence.num_tokens, sequence.text_tokens);
    if (unit > 0) ++counts[{unit, sequence.text_tokens}];
  }
  struct Frontier {
    double count;
    std::vector<std::pair<double, double>> points;
  };
  std::vector<Frontier> frontiers;
  for (const auto& [key, count] : counts) {
    std::vector<std::pair<double, double>> points =
        search.frontier(key.first, key.second, simple_s, true);
    if (points.empty()) points = search.frontier(key.first, key.second, simple_s, false);
    frontiers.push_back({static_cast<double>(count), std::move(points)});
  }
  // Every rank's per-token layers run at most as fast as a rank of the makespan's token count
  // allows: the frontiers charged them at the fastest rate of any count, so add the difference
  // (shares of a sequence hold its unit tokens in total, whatever the shape). Adaptive
  // checkpointing may skip their recompute: then the fastest rate stays.
  const CostOptions& options = cost_model.options();
  const bool per_token_cap =
      !(options.activation_checkpointing && options.adaptive_checkpointing);
  auto overflows = [&](double makespan_s) {  // whether no plan can have this makespan
    double total = 0;
    if (per_token_cap) {
      total += (search.per_token_s_within(makespan_s) - search.min_per_token_s) * total_unit_tokens;
    }
    for (const Frontier& f : frontiers) {
      const auto it = std::upper_bound(
          f.points.begin(), f.points.end(),
          std::make_pair(makespan_s, std::numeric_limits<double>::infinity()));
      if (it == f.points.begin()) return true;  // no shape is fast enough
      total += f.count * std::prev(it)->second;
    }
    return total > num_ranks * makespan_s;
  };
  double low_s = simple_s;  // a valid bound; overflows(low_s) or not
  if (overflows(low_s)) {
    double high_s = std::max(low_s, total_rank_seconds / num_ranks) * 2;
    while (overflows(high_s)) high_s *= 2;
    for (int step = 0; step < 60 && high_s - low_s > 1e-9 * high_s; ++step) {
      const double middle_s = 0.5 * (low_s + high_s);
      (overflows(middle_s) ? low_s : high_s) = middle_s;
    }
  }
  if (search.num_ranks > kExclusiveShareRanks ||
      static_cast<double>(counts.size()) * num_ranks > kExclusiveShareWork) {
    return low_s;
  }

  // Whole shares: a rank of a plan of makespan T holds shares whose times sum to at most T, so
  // for any dual feasible function u of bin packing (u_k(x) = floor((k + 1) x) / k: the u of
  // fractions summing to <= 1 sum to <= 1), sum over all shares of u(share / T) <= num_ranks;
  // for u_1, no rank holds two shares above T / 2. With that constraint, picking shapes of least
  // total rank-seconds is a knapsack; its Lagrangian relaxation (a multiplier >= 0 per unit,
  // minus it per rank of the cluster) is below the knapsack's optimum, so T is impossible when it
  // still exceeds num_ranks x T. A shape's shares are charged at its least share (u grows).
  // Every shape counts here (the frontiers above keep only those of least rank-seconds), so
  // only for small clusters and batches. Every T so found is a bound by itself (a plan of
  // makespan T' meets these conditions at every T >= T'), monotone or not.
  struct Point {
    double bottleneck_s, rank_seconds, least_share_s;
    double degree;
  };
  struct Candidates {
    double count;
    std::vector<Point> points;
  };
  std::vector<Candidates> candidates;
  for (const auto& [key, count] : counts) {
    Candidates entry{static_cast<double>(count), {}};
    for (const bool respect_memory : {true, false}) {
      for (const auto& [result, degree] : search.every_shape(key.first, key.second)) {
        if (respect_memory && !result.fits) continue;
        entry.points.push_back({result.bottleneck_s, result.rank_seconds, result.least_share_s,
                                static_cast<double>(degree)});
      }
      if (!entry.points.empty()) break;  // a sequence that fits nowhere counts every shape
    }
    candidates.push_back(std::move(entry));
  }
  auto excluded = [&](double makespan_s) {  // whether no plan has a makespan <= this
    double adjust = 0;
    if (per_token_cap) {
      adjust = (search.per_token_s_within(makespan_s) - search.min_per_token_s) * total_unit_tokens;
    }
    for (int k = 1; k <= kExclusiveShareClasses; ++k) {
      for (const double multiplier : kExclusiveShareMultipliers) {
        const double price_s = multiplier * makespan_s;  // per unit of a rank's capacity
        double total = adjust - price_s * num_ranks;
        for (const Candidates& entry : candidates) {
          double best = std::numeric_limits<double>::infinity();
          for (const Point& point : entry.points) {
            if (point.bottleneck_s > makespan_s) continue;
            // The dual feasible function u_k(x) = floor((k + 1) x) / k of the share's fraction
            // of T (a hair lower where (k + 1) x is whole, where u_k is x itself).
            const double fraction = point.least_share_s / makespan_s;
            const double used =
                std::floor((k + 1) * fraction - 1e-9) / static_cast<double>(k);
            best = std::min(best,
                            point.rank_seconds + price_s * point.degree * std::max(0.0, used));
          }
          if (!std::isfinite(best)) return true;
          total += entry.count * best;
        }
        if (total > num_ranks * makespan_s) return true;
      }
    }
    return false;
  };
  double high_s = low_s * kExclusiveShareReach;
  if (excluded(high_s)) return high_s;
  double best_s = low_s;
  for (int step = 0; step < 40 && high_s - best_s > 1e-9 * high_s; ++step) {
    const double middle_s = 0.5 * (best_s + high_s);
    (excluded(middle_s) ? best_s : high_s) = middle_s;
  }
  return best_s;
}

}  // namespace zellige
