// dp-cost: whole sequences balanced by the cost model's time, longest-processing-time first
// (REFERENCE.md): each sequence goes to the least-loaded rank that has memory room for it.
#include "greedy.h"
#include "rank_loads.h"
#include "registry.h"
#include "zellige/planners.h"

namespace zellige {

Plan plan_dp_cost(const Batch& batch, const CostModel& cost_model) {
  return planners::dp_cost(batch, cost_model, nullptr);
}

Plan planners::dp_cost(const Batch& batch, const CostModel& cost_model, EvaluationCache* cache) {
  planners::RankLoads loads(cost_model, cache);
  // The sequence alone on one rank; rank 0 stands for any rank (a local placement sends nothing).
  std::vector<double> local_time_s;
  for (const Sequence& sequence : batch.sequences) {
    local_time_s.push_back(planners::placement_time_s(
        cost_model, loads.shares(sequence, make_placement(sequence.id, Strategy::kLocal, {0}))));
  }

  std::vector<double> rank_time_s;
  for (int64_t rank = 0; rank < loads.num_ranks(); ++rank)
    rank_time_s.push_back(loads.time_s(rank));
  Plan plan = planners::empty_plan("dp-cost", cost_model);
  // Bins are ranks keyed by their time.
  const Sequence* unplaced = planners::place_longest_first(
      batch, local_time_s, rank_time_s,
      [](const Sequence& sequence, int64_t rank) {
        return make_placement(sequence.id, Strategy::kLocal, {rank});
      },
      [&](const Placement& placement) { return loads.time_s(placement.ranks[0]); }, loads, plan);
  if (unplaced != nullptr) {
    throw PlanMemoryError("dp-cost: " + planners::describe_sequence(*unplaced) +
                          " fits on no rank: every rank is out of memory (" +
                          planners::format_gib(loads.capacity_bytes()) + " per rank)");
  }
  return plan;
}

}  // namespace zellige
