// static-cp(c): the DP x CP design of most video codebases (REFERENCE.md). The ranks form
// disjoint groups of c consecutive ranks (intra-node first); every sequence is sharded over a
// whole group; groups are balanced by cost, greedy, longest first.
//
// Sharding inside a group follows the USP rule of those codebases: Ulysses over the largest
// degree u that divides both c and the head count, ring over the remaining c / u (so c = 16 with
// 24 heads is "Ulysses 8 x ring 2"); u = c is plain Ulysses, u = 1 plain ring.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "greedy.h"
#include "rank_loads.h"
#include "registry.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

int64_t ulysses_degree_for(int64_t group_size, int64_t num_heads) {
  for (int64_t u = group_size; u > 1; --u) {
    if (group_size % u == 0 && num_heads % u == 0) return u;
  }
  return 1;
}

Placement group_placement(int64_t sequence_id, int64_t first_rank, int64_t group_size,
                          int64_t ulysses_degree) {
  std::vector<int64_t> ranks = planners::consecutive_ranks(first_rank, group_size);
  if (group_size == 1) return make_placement(sequence_id, Strategy::kLocal, std::move(ranks));
  if (ulysses_degree == group_size) {
    return make_placement(sequence_id, Strategy::kUlysses, std::move(ranks));
  }
  if (ulysses_degree == 1) return make_placement(sequence_id, Strategy::kRing, std::move(ranks));
  return make_placement(sequence_id, Strategy::kHybrid, std::move(ranks), ulysses_degree);
}

}  // namespace

Plan plan_static_cp(const Batch& batch, const CostModel& cost_model, int64_t group_size) {
  return planners::static_cp(batch, cost_model, group_size, nullptr);
}

Plan planners::static_cp(const Batch& batch, const CostModel& cost_model, int64_t group_size,
                         EvaluationCache* cache) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  if (group_size <= 0 || group_size > num_ranks || num_ranks % group_size != 0) {
    throw std::invalid_argument("static-cp:" + std::to_string(group_size) +
                                ": the group size must divide the " + std::to_string(num_ranks) +
                                " GPUs (allowed: a divisor of " + std::to_string(num_ranks) + ")");
  }
  const int64_t num_groups = num_ranks / group_size;
  const int64_t ulysses_degree = ulysses_degree_for(group_size, cost_model.model().num_heads);

  planners::RankLoads loads(cost_model, cache);
  // Cost of each sequence on group 0, for the longest-first order.
  std::vector<double> group_time_s;
  for (const Sequence& sequence : batch.sequences) {
    group_time_s.push_back(planners::placement_time_s(
        cost_model,
        loads.shares(sequence, group_placement(sequence.id, 0, group_size, ulysses_degree))));
  }

  Plan plan = planners::empty_plan("static-cp:" + std::to_string(group_size), cost_model);
  // Bins are groups keyed by their time, the time of their slowest rank.
  const Sequence* unplaced = planners::place_longest_first(
      batch, group_time_s, std::vector<double>(num_groups, 0.0),
      [&](const Sequence& sequence, int64_t group) {
        return group_placement(sequence.id, group * group_size, group_size, ulysses_degree);
      },
      [&](const Placement& placement) {
        double time_s = 0;
        for (int64_t rank : placement.ranks) time_s = std::max(time_s, loads.time_s(rank));
        return time_s;
      },
      loads, plan);
  if (unplaced != nullptr) {
    throw PlanMemoryError("static-cp:" + std::to_string(group_size) + ": " +
                          planners::describe_sequence(*unplaced) + " fits in no group of " +
                          std::to_string(group_size) + " GPUs: every group is out of memory (" +
                          planners::format_gib(loads.capacity_bytes()) + " per rank)");
  }
  return plan;
}

}  // namespace zellige
