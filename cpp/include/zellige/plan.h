// Plans: one placement (strategy + ordered ranks) per sequence, plus what the cost model predicts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zellige/workload.h"

namespace zellige {

enum class Strategy { kLocal, kUlysses, kRing, kHybrid };

// A placement of one sequence. Token layout (the contract the plan compiler and runtime follow):
// the sequence is cut into ring_degree contiguous blocks (balanced: the first L % r blocks get one
// token more), each block into ulysses_degree contiguous chunks (balanced likewise); rank
// ranks[j * ulysses_degree + k] holds chunk k of block j. Heads split the same balanced way over
// the ulysses_degree ranks of a block (24 heads over 5 ranks: 5,5,5,5,4).
//   local:   1 rank,  u = r = 1
//   ulysses: p ranks, u = p, r = 1
//   ring:    p ranks, u = 1, r = p
//   hybrid:  u * r ranks (u >= 2, r >= 2)
struct Placement {
  int64_t sequence_id = 0;
  Strategy strategy = Strategy::kLocal;
  std::vector<int64_t> ranks;
  int64_t ulysses_degree = 1;
  int64_t ring_degree = 1;

  int64_t degree() const { return static_cast<int64_t>(ranks.size()); }
};

Placement make_placement(int64_t sequence_id, Strategy strategy, std::vector<int64_t> ranks,
                         int64_t ulysses_degree = 0);  // ulysses_degree: hybrid only

// "local", "ulysses", "ring", "hybrid(u,r)" <-> Strategy + degrees. Parsing ignores spaces, sets
// the degree that only the rank count knows (ulysses: u, ring: r) to 0 (make_placement derives
// it) and throws std::invalid_argument listing the allowed forms.
std::string strategy_name(const Placement& placement);
void parse_strategy(const std::string& name, Strategy* strategy, int64_t* ulysses_degree,
                    int64_t* ring_degree);

// Balanced split of `total` items into `parts` (first total % parts get one more); a part may be 0.
std::vector<int64_t> balanced_split(int64_t total, int64_t parts);

struct PlanPrediction {
  double makespan_s = 0;
  std::vector<double> rank_time_s;
  std::vector<double> rank_peak_bytes;
  std::vector<int64_t> rank_checkpointed_layers;  // the first this many layers recompute
  // the first this many of those recompute their attention too (empty: none)
  std::vector<int64_t> rank_full_recompute_layers;
};

struct Plan {
  std::string planner;
  int64_t num_ranks = 0;
  std::vector<Placement> placements;  // in batch order
  PlanPrediction predicted;
  double plan_ms = 0;  // the planner's own wall time
  std::string note;    // planner-specific facts (e.g. "mip_gap=0.0012"); may be empty
};

// Throws std::invalid_argument naming the offending sequence when: a sequence of the batch has no
// placement or more than one; a placement names an unknown sequence; ranks are empty, repeated or
// outside [0, num_ranks); the strategy's degrees do not match the rank count; a Ulysses degree
// exceeds num_heads (a rank would get no head). num_heads <= 0 skips the head check.
void validate_plan(const Plan& plan, const Batch& batch, int64_t num_ranks, int64_t num_heads);

}  // namespace zellige
