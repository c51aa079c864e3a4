// dp-tokens: what bucketed loaders do. Every sequence stays whole on one rank; ranks are balanced
// by token count, greedy, longest first (REFERENCE.md). Ranks without memory room are skipped.
#include <algorithm>
#include <numeric>
#include <queue>
#include <utility>

#include "rank_loads.h"
#include "zellige/planners.h"

namespace zellige {

Plan plan_dp_tokens(const Batch& batch, const CostModel& cost_model) {
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  std::vector<int64_t> order(num_sequences);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return batch.sequences[a].num_tokens > batch.sequences[b].num_tokens;
  });

  planners::RankLoads loads(cost_model);
  // (tokens, rank), fewest tokens first, ties to the lowest rank.
  using Entry = std::pair<int64_t, int64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> by_tokens;
  for (int64_t rank = 0; rank < loads.num_ranks(); ++rank) by_tokens.push({0, rank});

  Plan plan = planners::empty_plan("dp-tokens", cost_model);
  plan.placements.resize(num_sequences);
  std::vector<Entry> full;  // ranks without room for the current sequence
  for (int64_t index : order) {
    const Sequence& sequence = batch.sequences[index];
    bool placed = false;
    while (!by_tokens.empty()) {
      const int64_t rank = by_tokens.top().second;
      by_tokens.pop();
      Placement placement = make_placement(sequence.id, Strategy::kLocal, {rank});
      const std::vector<RankShare> shares = cost_model.shares(sequence, placement);
      if (!loads.fits(shares)) {
        full.push_back({loads.tokens(rank), rank});
        continue;
      }
      loads.add(shares);
      by_tokens.push({loads.tokens(rank), rank});
      plan.placements[index] = std::move(placement);
      placed = true;
      break;
    }
    for (const Entry& entry : full) by_tokens.push(entry);
    full.clear();
    if (!placed) {
      throw PlanMemoryError("dp-tokens: " + planners::describe_sequence(sequence) +
                            " fits on no rank: every rank is out of memory (" +
                            planners::format_gib(loads.capacity_bytes()) + " per rank)");
    }
  }
  return plan;
}

}  // namespace zellige
