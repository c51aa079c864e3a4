// PLACEHOLDER until the two-stage planner lands (issue 3): keeps the registry linkable.
#include <stdexcept>

#include "zellige/planners.h"

namespace zellige {

Plan plan_zellige(const Batch&, const CostModel&, const PlannerOptions&) {
  throw std::invalid_argument("planner 'zellige' is not built yet");
}

std::vector<Placement> candidate_placements(const Sequence&, const CostModel&, int64_t) {
  throw std::invalid_argument("candidate_placements is not built yet");
}

}  // namespace zellige
