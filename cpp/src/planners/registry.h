// Private to the planners: run a policy by name, for zellige's baseline seeds.
#pragma once

#include <string>

#include "zellige/planners.h"

namespace zellige::planners {

// The named policy's placements (make_plan's parsing, without its checks, timing or prediction).
// Throws what the policy throws: std::invalid_argument, PlanMemoryError.
Plan run_policy(const std::string& planner, const Batch& batch, const CostModel& cost_model,
                const PlannerOptions& options);

}  // namespace zellige::planners
