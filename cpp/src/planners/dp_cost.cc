// dp-cost: whole sequences balanced by the cost model's time, longest-processing-time first
// (REFERENCE.md): each sequence goes to the least-loaded rank that has memory room for it.
#include <algorithm>
#include <numeric>
#include <queue>
#include <utility>

#include "rank_loads.h"
#include "zellige/planners.h"

namespace zellige {

Plan plan_dp_cost(const Batch& batch, const CostModel& cost_model) {
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  // The sequence alone on one rank; rank 0 stands for any rank (a local placement sends nothing).
  std::vector<double> local_time_s(num_sequences);
  for (int64_t i = 0; i < num_sequences; ++i) {
    const Sequence& sequence = batch.sequences[i];
    local_time_s[i] = planners::placement_time_s(
        cost_model,
        cost_model.shares(sequence, make_placement(sequence.id, Strategy::kLocal, {0})));
  }
  std::vector<int64_t> order(num_sequences);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return local_time_s[a] > local_time_s[b]; });

  planners::RankLoads loads(cost_model);
  // (time, rank), least loaded first, ties to the lowest rank.
  using Entry = std::pair<double, int64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> by_time;
  for (int64_t rank = 0; rank < loads.num_ranks(); ++rank) by_time.push({loads.time_s(rank), rank});

  Plan plan = planners::empty_plan("dp-cost", cost_model);
  plan.placements.resize(num_sequences);
  std::vector<Entry> full;  // ranks without room for the current sequence
  for (int64_t index : order) {
    const Sequence& sequence = batch.sequences[index];
    bool placed = false;
    while (!by_time.empty()) {
      const Entry entry = by_time.top();
      by_time.pop();
      Placement placement = make_placement(sequence.id, Strategy::kLocal, {entry.second});
      const std::vector<RankShare> shares = cost_model.shares(sequence, placement);
      if (!loads.fits(shares)) {
        full.push_back(entry);
        continue;
      }
      loads.add(shares);
      by_time.push({loads.time_s(entry.second), entry.second});
      plan.placements[index] = std::move(placement);
      placed = true;
      break;
    }
    for (const Entry& entry : full) by_time.push(entry);
    full.clear();
    if (!placed) {
      throw PlanMemoryError("dp-cost: " + planners::describe_sequence(sequence) +
                            " fits on no rank: every rank is out of memory (" +
                            planners::format_gib(loads.capacity_bytes()) + " per rank)");
    }
  }
  return plan;
}

}  // namespace zellige
