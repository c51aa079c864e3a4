// dp-tokens: what bucketed loaders do. Every sequence stays whole on one rank; ranks are balanced
// by token count, greedy, longest first (REFERENCE.md). Ranks without memory room are skipped.
#include "greedy.h"
#include "rank_loads.h"
#include "registry.h"
#include "zellige/planners.h"

namespace zellige {

Plan plan_dp_tokens(const Batch& batch, const CostModel& cost_model) {
  return planners::dp_tokens(batch, cost_model, nullptr);
}

Plan planners::dp_tokens(const Batch& batch, const CostModel& cost_model, EvaluationCache* cache) {
  std::vector<int64_t> num_tokens;
  for (const Sequence& sequence : batch.sequences) num_tokens.push_back(sequence.num_tokens);

  planners::RankLoads loads(cost_model, cache);
  Plan plan = planners::empty_plan("dp-tokens", cost_model);
  // Bins are ranks keyed by their token count.
  const Sequence* unplaced = planners::place_longest_first(
      batch, num_tokens, std::vector<int64_t>(loads.num_ranks(), 0),
      [](const Sequence& sequence, int64_t rank) {
        return make_placement(sequence.id, Strategy::kLocal, {rank});
      },
      [&](const Placement& placement) { return loads.tokens(placement.ranks[0]); }, loads, plan);
  if (unplaced != nullptr) {
    throw PlanMemoryError("dp-tokens: " + planners::describe_sequence(*unplaced) +
                          " fits on no rank: every rank is out of memory (" +
                          planners::format_gib(loads.capacity_bytes()) + " per rank)");
  }
  return plan;
}

}  // namespace zellige
