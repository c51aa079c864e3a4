// Private to the planners: run a policy by name, for zellige's baseline seeds.
#pragma once

#include <string>

#include "zellige/planners.h"

namespace zellige::planners {

// The named policy's placements (make_plan's parsing, without its checks, timing or prediction).
// Throws what the policy throws: std::invalid_argument, PlanMemoryError. `cache` (optional)
// memoises the policies' shares across calls on one batch (same plans).
Plan run_policy(const std::string& planner, const Batch& batch, const CostModel& cost_model,
                const PlannerOptions& options, EvaluationCache* cache = nullptr);

// The baselines that price shares, with that cache (their plan_* entry points pass none).
Plan dp_tokens(const Batch& batch, const CostModel& cost_model, EvaluationCache* cache);
Plan dp_cost(const Batch& batch, const CostModel& cost_model, EvaluationCache* cache);
Plan static_cp(const Batch& batch, const CostModel& cost_model, int64_t group_size,
               EvaluationCache* cache);
Plan megatron_dcp(const Batch& batch, const CostModel& cost_model, EvaluationCache* cache);

}  // namespace zellige::planners
