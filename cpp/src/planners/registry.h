// Private to the planners: run a policy by name, for zellige's baseline seeds.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
// zellige with `cache`. Its plan comes with plan.predicted filled: zellige prices its finalists
// exactly (CostModel::evaluate with `cache`), so make_plan does not evaluate the plan again.
Plan zellige(const Batch& batch, const CostModel& cost_model, const PlannerOptions& options,
             EvaluationCache* cache);
// zellige's local search alone from `start` (a plan of the batch within memory), for tests of its
// moves; `whole_anchor_moves` false leaves out those of zellige_moves.cc.
Plan zellige_search(const Batch& batch, const CostModel& cost_model, const Plan& start,
                    bool whole_anchor_moves);
// zellige's co-location step alone (coalesce, zellige_exact.cc) from `start` (a plan of the
// batch in batch order, within memory); `steps` (optional): the moves and swaps it kept.
Plan zellige_coalesce(const Batch& batch, const CostModel& cost_model, const Plan& start,
                      int64_t* steps = nullptr);
// zellige's floors of the covered KnapFormer baseline `spec` from its bags alone (bags_floor,
// zellige_bounds.cc): the floor (-1 where a bag is not node-aligned) and `recompute_floor_s`,
// and in `plan` the plan those bags give, for tests against CostModel::makespan_floor.
double zellige_bags_floor(const Batch& batch, const CostModel& cost_model, const std::string& spec,
                          Plan* plan, double* recompute_floor_s);
// predict (planners.h) with the caller's cache.
void predict_with(Plan& plan, const Batch& batch, const CostModel& cost_model,
                  EvaluationCache& cache);
// plan.predicted from an exact evaluation of this plan (what predict_with fills).
void set_prediction(Plan& plan, const PlanCost& cost);

// KnapFormer in three steps, so that zellige can price its bags before building a plan.
// Every spec of one gamma shares the work per sequence and the heaviest-first order.
struct KnapformerWork {
  std::vector<double> work;   // per sequence, batch order
  double total_work = 0;
  std::vector<int64_t> order;  // heaviest first, ties in batch order
};
struct KnapformerBags {
  std::vector<int64_t> size, first_rank;  // per bag, layout order
  std::vector<int32_t> of_sequence;       // per sequence (batch order): its bag
  bool complete = true;                   // false: `stop` ended the assignment early
};
// Called after each sequence (batch index) is given its bag, heaviest first; returning true ends
// the assignment there (the bags are then incomplete: of_sequence is -1 for the rest).
using KnapformerStop = std::function<bool(const KnapformerBags& bags, int64_t sequence)>;
// Throws std::invalid_argument for a bad gamma (knapformer_work) or spec (knapformer_assign).
KnapformerWork knapformer_work(const Batch& batch, const CostModel& cost_model, double gamma);
KnapformerBags knapformer_assign(const Batch& batch, const CostModel& cost_model,
                                 const std::string& spec, const KnapformerWork& work,
                                 const KnapformerStop& stop = {});
Plan knapformer_plan(const Batch& batch, const CostModel& cost_model, const std::string& spec,
                     double gamma, const KnapformerBags& bags);

}  // namespace zellige::planners
