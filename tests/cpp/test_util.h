// Helpers shared by the C++ tests: the seeded profile, tiny batches and the brute-force oracle.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "zellige/cost_model.h"
#include "zellige/model_spec.h"
#include "zellige/plan.h"
#include "zellige/profile.h"
#include "zellige/workload.h"

namespace zellige::test_util {

// The seeded H200 tables of src/zellige/profiles/h200.json, rebuilt from their TFLOP/s.
inline HardwareProfile seeded_profile() {
  HardwareProfile profile = analytic_profile("test H200", 750e12, 640e12, 4.2e12);
  const std::vector<double> lengths = {256, 1024, 4096, 16384, 65536, 131072};
  const std::vector<double> forward_tflops = {450, 540, 610, 630, 650, 656};
  const std::vector<double> backward_tflops = {250, 300, 550, 555, 560, 564};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const double flops = 4.0 * lengths[i] * lengths[i] * 128.0;
    profile.attention_forward_s_per_head.x.push_back(lengths[i]);
    profile.attention_forward_s_per_head.y.push_back(flops / (forward_tflops[i] * 1e12));
    profile.attention_backward_s_per_head.x.push_back(lengths[i]);
    profile.attention_backward_s_per_head.y.push_back(2.5 * flops / (backward_tflops[i] * 1e12));
  }
  profile.attention_forward_s_per_head.source = "seeded";
  profile.attention_backward_s_per_head.source = "seeded";
  profile.matmul_forward_flops_per_s = {
      {256, 1024, 4096, 32768}, {300e12, 500e12, 620e12, 660e12}, "seeded"};
  profile.matmul_backward_flops_per_s = profile.matmul_forward_flops_per_s;
  profile.runtime_reserved_bytes = int64_t{3} << 30;
  profile.validate();
  return profile;
}

// `profile` with launch-floor rows for one model: the activation and checkpoint rows at 0 (the
// model's own estimate), `per_layer_s` per layer and `per_call_s` per attention call.
inline HardwareProfile with_launch_rows(HardwareProfile profile, const std::string& model,
                                        double per_layer_s, double per_call_s) {
  profile.memory_models = {model};
  profile.activation_bytes_per_token_layer = {0};
  profile.checkpoint_bytes_per_token_layer = {0};
  profile.launch_s_per_layer = {per_layer_s};
  profile.launch_s_per_attention_call = {per_call_s};
  profile.validate();
  return profile;
}

// A preset on `gpus` GPUs under the seeded profile.
inline CostModel make_model(const std::string& model, int64_t gpus, int64_t gpus_per_node,
                            bool checkpointing = true) {
  CostOptions options;
  options.activation_checkpointing = checkpointing;
  return CostModel(model_preset(model), seeded_profile(), make_cluster(gpus, gpus_per_node),
                   options);
}

// Ranks first, first + 1, ..., first + count - 1.
inline std::vector<int64_t> iota_ranks(int64_t first, int64_t count) {
  std::vector<int64_t> ranks(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) ranks[i] = first + i;
  return ranks;
}

// Video sequences 0, 1, ... of the given lengths, all on source rank 0.
inline Batch batch_of(const std::vector<int64_t>& lengths, int64_t text_tokens = 0) {
  Batch batch;
  for (size_t i = 0; i < lengths.size(); ++i) {
    batch.sequences.push_back(
        sequence_from_tokens(static_cast<int64_t>(i), "video", lengths[i], text_tokens, 0));
  }
  return batch;
}

// Every placement of one sequence on a tiny cluster: every rank subset (in increasing order)
// under every strategy whose degrees are legal, over at most `unit_tokens` ranks.
inline std::vector<Placement> all_placements(int64_t sequence_id, int64_t num_ranks,
                                             int64_t num_heads, int64_t unit_tokens) {
  std::vector<Placement> result;
  for (int64_t mask = 1; mask < (int64_t{1} << num_ranks); ++mask) {
    std::vector<int64_t> ranks;
    for (int64_t rank = 0; rank < num_ranks; ++rank) {
      if (mask & (int64_t{1} << rank)) ranks.push_back(rank);
    }
    const int64_t p = static_cast<int64_t>(ranks.size());
    if (p > unit_tokens) continue;
    if (p == 1) {
      result.push_back(make_placement(sequence_id, Strategy::kLocal, ranks));
      continue;
    }
    if (p <= num_heads) result.push_back(make_placement(sequence_id, Strategy::kUlysses, ranks));
    result.push_back(make_placement(sequence_id, Strategy::kRing, ranks));
    for (int64_t u = 2; u <= std::min(num_heads, p / 2); ++u) {
      if (p % u == 0) result.push_back(make_placement(sequence_id, Strategy::kHybrid, ranks, u));
    }
  }
  return result;
}

// The best makespan of any plan that fits (infinity when none does).
inline double brute_force_makespan(const Batch& batch, const CostModel& cost_model) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  std::vector<std::vector<Placement>> options;
  for (const Sequence& sequence : batch.sequences) {
    options.push_back(all_placements(
        sequence.id, num_ranks, cost_model.model().num_heads,
        attended_tokens(cost_model.model(), sequence.num_tokens, sequence.text_tokens)));
  }
  Plan plan;
  plan.num_ranks = num_ranks;
  plan.placements.resize(batch.sequences.size());
  double best = std::numeric_limits<double>::infinity();
  std::function<void(size_t)> recurse = [&](size_t i) {
    if (i == options.size()) {
      const PlanCost cost = cost_model.evaluate(batch, plan);
      if (cost.fits) best = std::min(best, cost.makespan_s);
      return;
    }
    for (const Placement& placement : options[i]) {
      plan.placements[i] = placement;
      recurse(i + 1);
    }
  };
  recurse(0);
  return best;
}

}  // namespace zellige::test_util
