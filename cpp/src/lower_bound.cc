// makespan_lower_bound: the least makespan any plan of a batch can have under a cost model
// (the derivation is in zellige/cost_model.h).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cost_model_internal.h"
#include "zellige/cost_model.h"

namespace zellige {

using cost_model_internal::kElementwiseBytesPerTokenWidth;
using cost_model_internal::max_rate;

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
        capacity_bytes(model.max_memory_capacity_bytes()),  // a shape may use the largest ranks
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
  // Unlike ranks: everything below is in nominal seconds (the profile's device), of a makespan
  // M = T x the fastest speed. A rank of speed v runs at most v x T = (v / fastest) x M nominal
  // seconds in a plan of makespan T, so the cluster holds the rank-seconds of total speed /
  // fastest ranks of makespan M, and every bottleneck and per-token cap holds at M as on the
  // fastest rank. On like ranks: num_ranks, and M = T.
  const Cluster& cluster = cost_model.cluster();
  const double fastest = cluster.max_speed();
  const double num_ranks = cluster.total_speed() / fastest;
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
  // The whole-share refinement below packs equal bins: like ranks only.
  if (search.num_ranks > kExclusiveShareRanks ||
      static_cast<double>(counts.size()) * num_ranks > kExclusiveShareWork ||
      cluster.heterogeneous()) {
    return low_s / fastest;
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
