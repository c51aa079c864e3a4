#include "zellige/simulator.h"

#include <unordered_map>

namespace zellige {

std::vector<TimelineSegment> simulate(const Batch& batch, const Plan& plan,
                                      const CostModel& cost_model) {
  // evaluate() validates the plan against the batch and the cluster.
  const PlanCost cost = cost_model.evaluate(batch, plan);
  std::unordered_map<int64_t, const Sequence*> by_id;
  for (const Sequence& sequence : batch.sequences) by_id[sequence.id] = &sequence;

  struct Entry {
    int64_t sequence_id;
    RankShare share;
  };
  std::vector<std::vector<Entry>> per_rank(cost.ranks.size());
  for (const Placement& placement : plan.placements) {
    for (const RankShare& share : cost_model.shares(*by_id.at(placement.sequence_id), placement)) {
      per_rank[share.rank].push_back({placement.sequence_id, share});
    }
  }

  std::vector<TimelineSegment> segments;
  const auto add = [&segments](int64_t rank, int64_t sequence_id, const char* phase,
                               double* clock_s, double duration_s) {
    if (duration_s <= 0) return;
    segments.push_back({rank, sequence_id, phase, *clock_s, *clock_s + duration_s});
    *clock_s += duration_s;
  };
  for (size_t rank = 0; rank < per_rank.size(); ++rank) {
    const RankCost& totals = cost.ranks[rank];
    double clock_s = 0;
    // The per-token layers run on all of the rank's tokens at once; split in proportion.
    for (const Entry& entry : per_rank[rank]) {
      const double fraction = totals.tokens > 0 ? static_cast<double>(entry.share.tokens) /
                                                      static_cast<double>(totals.tokens)
                                                : 0.0;
      add(static_cast<int64_t>(rank), entry.sequence_id, "linear", &clock_s,
          totals.linear_s * fraction);
    }
    // Shares price each segment as a call of its own; the rank's call_s gives back what running
    // equal segments as one call saves, spread over its attention in proportion.
    double attention_s = 0;
    for (const Entry& entry : per_rank[rank]) attention_s += entry.share.attention_s;
    const double call_scale = attention_s > 0 ? (attention_s + totals.call_s) / attention_s : 1.0;
    for (const Entry& entry : per_rank[rank]) {
      add(static_cast<int64_t>(rank), entry.sequence_id, "attention", &clock_s,
          entry.share.attention_s * call_scale);
      add(static_cast<int64_t>(rank), entry.sequence_id, "exchange", &clock_s,
          entry.share.exchange_s);
    }
    if (totals.launch_floor_s > clock_s) {
      add(static_cast<int64_t>(rank), -1, "launch", &clock_s, totals.launch_floor_s - clock_s);
    }
  }
  return segments;
}

}  // namespace zellige
