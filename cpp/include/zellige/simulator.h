// Simulator: the per-rank timeline of a plan (what `zellige show` draws), from the cost model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zellige/cost_model.h"
#include "zellige/plan.h"
#include "zellige/workload.h"

namespace zellige {

// One bar of the Gantt chart: on `rank`, sequence `sequence_id` spends [start_s, end_s) in
// `phase` ("linear", "attention", "exchange"), or, with sequence_id -1, "launch" (the rank waits
// for its host to issue its kernels, up to RankCost::launch_floor_s).
struct TimelineSegment {
  int64_t rank = 0;
  int64_t sequence_id = 0;
  std::string phase;
  double start_s = 0;
  double end_s = 0;
};

// Per rank: per-token layers of all its tokens first (split by sequence in proportion to tokens),
// then each sequence's attention (with the rank's call_s spread over it) and exchange in plan
// order, then the launch wait. Ends equal the cost model's rank times. Throws std::invalid_argument
// if the plan does not match the batch.
std::vector<TimelineSegment> simulate(const Batch& batch, const Plan& plan,
                                      const CostModel& cost_model);

}  // namespace zellige
