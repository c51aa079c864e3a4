// Internals shared by the cost model's files (cost_model.cc: one placement's shares;
// plan_cost.cc: a plan's attention calls and evaluate; lower_bound.cc: makespan_lower_bound).
// Private to cpp/src: the public contract is zellige/cost_model.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "zellige/cluster.h"
#include "zellige/cost_model.h"
#include "zellige/profile.h"

namespace zellige::cost_model_internal {

// A call key's tag (CostModel::CallKey) for cross-attention; -1 is a coalescable self-attention
// segment, >= 0 a ring step's sequence.
inline constexpr int64_t kCrossTag = -2;
inline constexpr double kRouteBytesPerToken = 512;  // latent features + ids, each direction
inline constexpr double kElementwiseBytesPerTokenWidth = 24;  // norms, modulation, residual, gates

inline double max_rate(const Table& table, double peak_flops_per_s) {
  if (table.empty()) return peak_flops_per_s;
  return *std::max_element(table.y.begin(), table.y.end());
}

inline bool same_node(const Cluster& cluster, const std::vector<int64_t>& ranks, int64_t first,
                      int64_t stride, int64_t count) {
  const int64_t node = cluster.node_of(ranks[first]);
  for (int64_t i = 1; i < count; ++i) {
    if (cluster.node_of(ranks[first + i * stride]) != node) return false;
  }
  return true;
}

}  // namespace zellige::cost_model_internal

namespace zellige {

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

}  // namespace zellige
