// The planner registry: parses planner names, checks that every sequence can fit at all, times
// the policy, validates its plan and attaches the cost model's prediction.
#include "zellige/planners.h"

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "planners/rank_loads.h"
#include "planners/registry.h"

namespace zellige {
namespace {

struct LengthsHash {
  size_t operator()(const std::pair<int64_t, int64_t>& lengths) const {
    return std::hash<int64_t>()(lengths.first * 1000003 + lengths.second);
  }
};

const char* const kAllowedForms =
    "dp-tokens, dp-cost, static-cp:C, knapformer:SPEC[:GAMMA], megatron-dcp, zellige";

[[noreturn]] void bad_name(const std::string& planner, const std::string& why) {
  throw std::invalid_argument("planner '" + planner + "': " + why + "; allowed: " + kAllowedForms);
}

// A positive decimal integer without sign, spaces or trailing characters.
int64_t parse_group_size(const std::string& planner, const std::string& text) {
  if (text.empty() || text.size() > 9 ||
      text.find_first_not_of("0123456789") != std::string::npos || std::stoll(text) <= 0) {
    bad_name(planner, "C must be a positive integer, got '" + text + "'");
  }
  return std::stoll(text);
}

double parse_gamma(const std::string& planner, const std::string& text) {
  size_t used = 0;
  double gamma = 0;
  try {
    gamma = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || !std::isfinite(gamma) || gamma < 0) {
    bad_name(planner, "GAMMA must be a finite number >= 0, got '" + text + "'");
  }
  return gamma;
}

// Parses `planner` into the policy call it names; throws before any planning for a bad name.
std::function<Plan()> parse_policy(const std::string& planner, const Batch& batch,
                                   const CostModel& cost_model, const PlannerOptions& options,
                                   EvaluationCache* cache) {
  if (planner == "dp-tokens") return [&, cache] { return planners::dp_tokens(batch, cost_model, cache); };
  if (planner == "dp-cost") return [&, cache] { return planners::dp_cost(batch, cost_model, cache); };
  if (planner == "megatron-dcp") {
    return [&, cache] { return planners::megatron_dcp(batch, cost_model, cache); };
  }
  if (planner == "zellige") {
    return [&, cache] { return planners::zellige(batch, cost_model, options, cache); };
  }
  const size_t colon = planner.find(':');
  const std::string family = planner.substr(0, colon);
  const std::string argument = colon == std::string::npos ? "" : planner.substr(colon + 1);
  if (family == "static-cp") {
    if (colon == std::string::npos) bad_name(planner, "static-cp needs a group size C");
    const int64_t group_size = parse_group_size(planner, argument);
    return [&, group_size, cache] {
      return planners::static_cp(batch, cost_model, group_size, cache);
    };
  }
  if (family == "knapformer") {
    if (argument.empty()) bad_name(planner, "knapformer needs a bag spec such as g4n8");
    const size_t gamma_colon = argument.find(':');
    const std::string spec = argument.substr(0, gamma_colon);
    const double gamma = gamma_colon == std::string::npos
                             ? 0.4
                             : parse_gamma(planner, argument.substr(gamma_colon + 1));
    return [&, spec, gamma] { return plan_knapformer(batch, cost_model, spec, gamma); };
  }
  bad_name(planner, "unknown planner");
}

// parse_policy, with the baselines on the cluster's homogeneous view: they know nothing of rank
// speeds and plan for the smallest rank memory (zellige plans on the cluster as it is). The
// evaluation cache serves both: a placement's shares do not depend on speeds or capacities.
std::function<Plan()> parse_planner(const std::string& planner, const Batch& batch,
                                    const CostModel& cost_model, const PlannerOptions& options,
                                    EvaluationCache* cache = nullptr) {
  if (planner == "zellige" || !cost_model.cluster().heterogeneous()) {
    return parse_policy(planner, batch, cost_model, options, cache);
  }
  auto view = std::make_shared<const CostModel>(cost_model.homogeneous_view());
  std::function<Plan()> run = parse_policy(planner, batch, *view, options, cache);
  return [view, run] { return run(); };
}

// The smallest per-rank memory over every placement shape of `sequence` on the lowest ranks
// (memory does not depend on which ranks, only on how many and how they split the sequence).
// Stops at the first shape within `capacity_bytes` when `stop_when_fits`.
double best_memory_bytes(const Sequence& sequence, const CostModel& cost_model,
                         double capacity_bytes, bool stop_when_fits) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  const int64_t num_heads = cost_model.model().num_heads;
  const double fixed_bytes = cost_model.fixed_bytes();
  double best_bytes = std::numeric_limits<double>::infinity();
  auto consider = [&](int64_t ulysses_degree, int64_t ring_degree) {
    const double bytes =
        fixed_bytes + cost_model.max_share_memory_bytes(sequence, ulysses_degree, ring_degree);
    best_bytes = std::min(best_bytes, bytes);
    return stop_when_fits && bytes <= capacity_bytes;
  };
  if (consider(1, 1)) return best_bytes;
  for (int64_t degree = 2; degree <= num_ranks; ++degree) {
    if (degree <= num_heads && consider(degree, 1)) return best_bytes;  // Ulysses
    if (consider(1, degree)) return best_bytes;                          // ring
    for (int64_t ulysses = 2; ulysses <= std::min(num_heads, degree / 2); ++ulysses) {
      if (degree % ulysses == 0 && consider(ulysses, degree / ulysses)) return best_bytes;
    }
  }
  return best_bytes;
}

}  // namespace

std::vector<std::string> planner_names() {
  return {"dp-tokens",    "dp-cost", "static-cp:C", "knapformer:SPEC[:GAMMA]",
          "megatron-dcp", "zellige"};
}

std::vector<std::string> covered_baselines(const Batch& batch, const CostModel& cost_model) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  const int64_t num_heads = cost_model.model().num_heads;
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  std::vector<std::string> names = {"dp-tokens", "dp-cost", "megatron-dcp"};
  for (int64_t size = 1; size <= num_ranks; ++size) {
    if (num_ranks % size != 0) continue;
    if (size > 2 * cost_model.cluster().gpus_per_node && size * num_sequences > kCoveredRankShares) {
      continue;
    }
    names.push_back("static-cp:" + std::to_string(size));
  }
  for (int64_t size = 1; size <= num_ranks; ++size) {
    if (num_ranks % size == 0 && num_heads % size == 0) {
      names.push_back("knapformer:g" + std::to_string(size) + "n" +
                      std::to_string(num_ranks / size));
    }
  }
  // Mixed specs: quarters of the cluster, each given one bag size (bag counts must be whole).
  if (num_ranks % 4 == 0) {
    const int64_t quarter = num_ranks / 4;
    const int64_t sizes[] = {1, 2, 4, 8};
    int64_t quarters[4] = {0, 0, 0, 0};  // per size
    for (quarters[0] = 0; quarters[0] <= 4; ++quarters[0]) {
      for (quarters[1] = 0; quarters[0] + quarters[1] <= 4; ++quarters[1]) {
        for (quarters[2] = 0; quarters[0] + quarters[1] + quarters[2] <= 4; ++quarters[2]) {
          quarters[3] = 4 - quarters[0] - quarters[1] - quarters[2];
          std::string spec;
          int terms = 0;
          bool valid = true;
          for (int t = 0; t < 4; ++t) {
            if (quarters[t] == 0) continue;
            const int64_t ranks = quarters[t] * quarter;
            if (ranks % sizes[t] != 0 || num_heads % sizes[t] != 0) valid = false;
            spec += (terms++ ? "+g" : "g") + std::to_string(sizes[t]) + "n" +
                    std::to_string(ranks / sizes[t]);
          }
          if (valid && terms >= 2) names.push_back("knapformer:" + spec);
        }
      }
    }
  }
  return names;
}

namespace planners {

Plan run_policy(const std::string& planner, const Batch& batch, const CostModel& cost_model,
                const PlannerOptions& options, EvaluationCache* cache) {
  return parse_planner(planner, batch, cost_model, options, cache)();
}

}  // namespace planners

void check_sequences_fit(const Batch& batch, const CostModel& cost_model) {
  // Every rank holds the training state; a sequence needs room on the ranks it goes to, at best
  // those with the most memory.
  const double smallest_capacity_bytes = cost_model.memory_capacity_bytes();
  const double capacity_bytes = cost_model.max_memory_capacity_bytes();
  // Said apart, since no placement helps: only more GPUs (a larger FSDP shard count) do.
  if (cost_model.fixed_bytes() > smallest_capacity_bytes) {
    throw PlanMemoryError(
        "the training state of " + cost_model.model().name + " alone does not fit in memory on " +
        std::to_string(cost_model.cluster().num_ranks()) + " GPUs: weights, gradients, optimizer " +
        "state (FSDP over all ranks) and runtime reserve need " +
        planners::format_gib(cost_model.fixed_bytes()) + " per rank, " +
        planners::format_gib(smallest_capacity_bytes) + " available; use more GPUs");
  }
  // Memory depends on the lengths only, and batches repeat them a lot.
  std::unordered_map<std::pair<int64_t, int64_t>, double, LengthsHash> best_bytes_of_lengths;
  for (const Sequence& sequence : batch.sequences) {
    const auto [it, inserted] =
        best_bytes_of_lengths.try_emplace({sequence.num_tokens, sequence.text_tokens}, 0.0);
    if (inserted) it->second = best_memory_bytes(sequence, cost_model, capacity_bytes, true);
    const double best_bytes = it->second;
    if (best_bytes > capacity_bytes) {
      throw PlanMemoryError(planners::describe_sequence(sequence) +
                            " does not fit in memory under any placement on " +
                            std::to_string(cost_model.cluster().num_ranks()) + " GPUs: needs " +
                            planners::format_gib(best_bytes) + " per rank at best, " +
                            planners::format_gib(capacity_bytes) + " available");
    }
  }
}

void predict(Plan& plan, const Batch& batch, const CostModel& cost_model) {
  EvaluationCache cache;  // same costs; placements of equal shapes are priced once
  planners::predict_with(plan, batch, cost_model, cache);
}

namespace planners {

void predict_with(Plan& plan, const Batch& batch, const CostModel& cost_model,
                  EvaluationCache& cache) {
  set_prediction(plan, cost_model.evaluate(batch, plan, cache));
}

void set_prediction(Plan& plan, const PlanCost& cost) {
  plan.predicted.makespan_s = cost.makespan_s;
  plan.predicted.rank_time_s.clear();
  plan.predicted.rank_peak_bytes.clear();
  plan.predicted.rank_checkpointed_layers.clear();
  plan.predicted.rank_full_recompute_layers.clear();
  for (const RankCost& rank : cost.ranks) {
    plan.predicted.rank_time_s.push_back(rank.time_s);
    plan.predicted.rank_peak_bytes.push_back(rank.peak_bytes);
    plan.predicted.rank_checkpointed_layers.push_back(rank.checkpointed_layers);
    plan.predicted.rank_full_recompute_layers.push_back(rank.full_recompute_layers);
  }
}

}  // namespace planners

Plan make_plan(const std::string& planner, const Batch& batch, const CostModel& cost_model,
               const PlannerOptions& options) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  // Shared by the policy (those that price shares) and the prediction below: bit-identical
  // numbers, but the shapes the policy priced are not priced again.
  EvaluationCache cache;
  const std::function<Plan()> run = parse_planner(planner, batch, cost_model, options, &cache);
  validate_batch(batch, num_ranks);
  check_sequences_fit(batch, cost_model);

  const auto start = std::chrono::steady_clock::now();
  Plan plan = run();
  const auto stop = std::chrono::steady_clock::now();
  plan.planner = planner;
  plan.plan_ms = std::chrono::duration<double, std::milli>(stop - start).count();

  validate_plan(plan, batch, num_ranks, cost_model.model().num_heads);
  // zellige evaluated its plan already (planners::zellige); the others get priced here.
  if (planner != "zellige") planners::predict_with(plan, batch, cost_model, cache);
  // A plan never leaves here out of memory: knapformer has no memory term, and the others only
  // estimate memory additively while choosing.
  for (int64_t rank = 0; rank < num_ranks; ++rank) {
    const double capacity_bytes = cost_model.memory_capacity_bytes(rank);
    const double peak_bytes = plan.predicted.rank_peak_bytes[rank];
    if (peak_bytes > capacity_bytes) {
      const bool knapformer = planner.rfind("knapformer", 0) == 0;
      throw PlanMemoryError(
          "planner '" + planner + "' puts " + planners::format_gib(peak_bytes) + " on rank " +
          std::to_string(rank) + ", above the " + planners::format_gib(capacity_bytes) +
          " of memory available" +
          (knapformer ? " (knapformer balances compute and ignores memory)" : ""));
    }
  }
  return plan;
}

}  // namespace zellige
