// Global-batch planning: one optimizer step's samples, far more than the cluster holds at once,
// cut into micro-batches (gradient accumulation) and each micro-batch placed by a planner.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zellige/cost_model.h"
#include "zellige/plan.h"
#include "zellige/planners.h"
#include "zellige/workload.h"

namespace zellige {

struct GlobalBatchOptions {
  uint64_t seed = 0;
  double time_limit_s = 10.0;  // handed to each micro-batch's planner
  // Seconds every micro-batch pays beyond its makespan that the cost model does not price: the
  // FSDP all-gathers and reduce-scatters a micro-batch repeats (the optimizer step runs once per
  // global batch, so it is the same for every K and left out). The launch floor is priced inside
  // each makespan already.
  double micro_batch_overhead_s = 0.0;
  // zellige tries 1.25 to 3 times the least micro-batch count its memory estimate allows, then
  // the least and this many more (docs/planner.md, "Global batches").
  int64_t extra_micro_batches = 2;
};

struct MicroBatch {
  Batch batch;  // its sequences, in the global batch's order
  Plan plan;    // their placements, predicted by the cost model, within memory
};

struct GlobalPlan {
  std::string planner;  // the global-batch policy asked for
  // The candidate that won: for zellige, "zellige:spread", "zellige:grouped", "zellige:one-step"
  // (the whole batch as one micro-batch, a step of one: docs/global-batch.md) or a baseline's
  // cut re-placed by zellige ("zellige:<baseline>"), or a baseline's own plan
  // ("<baseline>=<its inner planner>", e.g. "knapformer=knapformer:g4n8"); for a baseline, the
  // inner planner it ran.
  std::string chosen;
  std::vector<MicroBatch> micro_batches;
  double step_time_s = 0;  // sum of the micro-batches' makespans + K x micro_batch_overhead_s
  double plan_ms = 0;      // the whole call's wall time
};

// Global-batch policies, parsed by plan_global_batch (docs/global-batch.md):
//   "zellige"       two stages over micro-batches (heaviest spread first, then fill), each
//                   micro-batch placed by zellige; never slower than any baseline below
//   "megatron-dcp"  Megatron-Core dynamic CP: longest first, micro-batches cut by memory,
//                   each placed by megatron-dcp
//   "knapformer"    micro-batches cut in loader order by memory, each placed by knapformer with
//                   the best homogeneous bag spec for the whole global batch
//   "static-cp"     micro-batches cut in loader order by a token budget, each placed by
//                   static-cp:C with the best C for the whole global batch
//   "wlb-llm"       WLB-LLM: variable-length packing across micro-batches (heaviest first, to the
//                   least-loaded micro-batch with memory left), each placed by dp-cost
std::vector<std::string> global_batch_planner_names();
std::vector<std::string> global_batch_baseline_names();  // every name above but "zellige"

// Plans one global batch. Throws std::invalid_argument for an unknown name or an invalid batch,
// PlanMemoryError when some sequence fits on the cluster under no placement.
GlobalPlan plan_global_batch(const std::string& planner, const Batch& batch,
                             const CostModel& cost_model, const GlobalBatchOptions& options = {});

// Places the given micro-batches (sequence ids of `batch`, every sequence exactly once) with
// `planner` (a make_plan name) and totals the step: the oracle's and the baselines' building
// block. Throws PlanMemoryError when a micro-batch does not fit, std::invalid_argument when the
// ids do not cover the batch exactly once.
GlobalPlan place_micro_batches(const std::string& planner, const Batch& batch,
                               const std::vector<std::vector<int64_t>>& micro_batch_ids,
                               const CostModel& cost_model,
                               const GlobalBatchOptions& options = {});

}  // namespace zellige
