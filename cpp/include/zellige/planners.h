// Planners: pure functions from (batch, cost model, options) to a Plan.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "zellige/cost_model.h"
#include "zellige/plan.h"
#include "zellige/workload.h"

namespace zellige {

struct PlannerOptions {
  uint64_t seed = 0;
  double time_limit_s = 10.0;  // for planners that search (zellige local search caps itself)
};

// A planner found no placement of the batch within memory. The message names the sequence (or
// rank) and says memory. Bound to Python as zellige.PlanMemoryError (a ValueError).
class PlanMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Planner names, parsed by make_plan:
//   "dp-tokens", "dp-cost", "static-cp:C", "knapformer:SPEC[:GAMMA]" (SPEC like g4n8 or
//   g1n8+g2n4+g4n2+g8n1; GAMMA default 0.4), "megatron-dcp", "zellige".
// ("joint" is the MILP reference, in Python: zellige.joint.)
// Throws std::invalid_argument for an unknown or malformed name (listing the allowed forms), or
// a spec that does not fit the cluster; PlanMemoryError when the batch cannot be placed in memory.
// The returned plan is validated, carries the cost model's prediction and its own plan_ms.
Plan make_plan(const std::string& planner, const Batch& batch, const CostModel& cost_model,
               const PlannerOptions& options = {});

std::vector<std::string> planner_names();  // the forms above, for help texts

// The baseline plans `zellige` is never worse than on this batch and cluster (docs/planner.md):
// dp-tokens, dp-cost, megatron-dcp, static-cp:C for every C dividing the GPU count (groups beyond
// two nodes only while C x sequences <= kCoveredRankShares: such a plan alone holds that many
// shares), knapformer:gGnN (gamma 0.4) for every G dividing both the GPU count and the head
// count, and the mixed knapformer specs that give each quarter of the cluster one bag size among
// 1, 2, 4, 8 (GPU counts that are multiples of 4). zellige builds each of them and returns a plan
// whose makespan under CostModel::evaluate is at most that of every one of them that fits in
// memory.
inline constexpr int64_t kCoveredRankShares = int64_t{1} << 13;
std::vector<std::string> covered_baselines(const Batch& batch, const CostModel& cost_model);

// Fills plan.predicted from the cost model (and throws if the plan does not match the batch).
void predict(Plan& plan, const Batch& batch, const CostModel& cost_model);

// Each sequence that fits in memory under no placement on this cluster -> PlanMemoryError naming
// it. Called by make_plan before any planner runs.
void check_sequences_fit(const Batch& batch, const CostModel& cost_model);

// One policy per file in cpp/src/planners/; each returns placements only (make_plan predicts).
Plan plan_dp_tokens(const Batch& batch, const CostModel& cost_model);
Plan plan_dp_cost(const Batch& batch, const CostModel& cost_model);
Plan plan_static_cp(const Batch& batch, const CostModel& cost_model, int64_t group_size);
Plan plan_knapformer(const Batch& batch, const CostModel& cost_model, const std::string& spec,
                     double gamma);
Plan plan_megatron_dcp(const Batch& batch, const CostModel& cost_model);
Plan plan_zellige(const Batch& batch, const CostModel& cost_model, const PlannerOptions& options);

// Candidate placements of one sequence for the joint MILP (zellige.joint): every strategy at every
// degree 1..max_degree (0: the whole cluster) on node-aligned rank windows, at most
// `max_windows_per_shape` windows per (degree, strategy).
std::vector<Placement> candidate_placements(const Sequence& sequence, const CostModel& cost_model,
                                            int64_t max_windows_per_shape, int64_t max_degree = 0);

}  // namespace zellige
