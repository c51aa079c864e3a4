// The zellige planner's driver: the sweep of construction targets, the searches from the sweep's
// plan and from baseline starts, and the exact comparison that picks the plan (zellige_planner.h
// describes the algorithm); also the planner's entry points and candidate_placements.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "registry.h"
#include "zellige/planners.h"
#include "zellige_planner.h"

namespace zellige::planners::zellige_detail {


// A number for the plan note, as "%g" prints it. No iostreams in the core: a std::ostringstream
// here died (SIGSEGV in its locale facets) in processes that had loaded torch first, on the H200
// machine's build; C stdio does not touch the C++ locale.
std::string shortest(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
}


Plan ZelligePlanner::run() {
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(std::max(0.0, options_.time_limit_s)));
  prepare();

  // The sweep: target infinity first (only memory and efficiency make anchors), then a grid of
  // targets just above the mean load (whether a construction meets its target is not monotone in
  // the target, so no bisection from there), bisection up to the best makespan when no grid target
  // was met, and finally finer steps around the best target.
  Solution best, current;
  exact_ = false;
  // A construction can run out of memory where another (or dp-cost) does not: it then counts as
  // infinitely slow, and the planner refuses only when every one of them failed.
  std::string memory_error;
  auto build = [&](double target_s, double share_fraction, Solution* s, double stop_above_s) {
    try {
      construct(target_s, share_fraction, s, stop_above_s);
    } catch (const PlanMemoryError& error) {
      if (memory_error.empty()) memory_error = error.what();
      s->makespan_s = kInf;
    }
  };
  build(kInf, 1.0, &best, kInf);
  double best_target_s = kInf;
  // A construction whose busiest rank exceeds both the target and the best makespan can neither
  // meet the target nor win: it stops there (construct).
  auto try_target = [&](double target_s) {
    build(target_s, 1.0, &current, std::max(target_s, best.makespan_s));
    bool met = current.makespan_s <= target_s;
    // More anchor shares than ranks: some anchors must share ranks, which only shapes of at most
    // half the target allow (e.g. two videos on three ranks instead of one on two).
    const bool crowded = current.anchor_rank_slots > num_ranks_;
    if (current.makespan_s < best.makespan_s) {
      std::swap(best, current);
      best_target_s = target_s;
    }
    if (crowded) {
      build(target_s, kSharedAnchorFraction, &current, std::max(target_s, best.makespan_s));
      met = met || current.makespan_s <= target_s;
      if (current.makespan_s < best.makespan_s) {
        std::swap(best, current);
        best_target_s = target_s;
      }
    }
    return met;
  };
  // Larger targets rarely help once two have been met.
  int num_met = 0;
  double highest_tried_s = 0;
  for (double factor : kTargetFactors) {
    const double target_s = factor * mean_load_s_;
    if (target_s >= best.makespan_s || num_met == 2) break;
    num_met += try_target(target_s) ? 1 : 0;
    highest_tried_s = target_s;
  }
  const bool any_met = num_met > 0;
  if (!any_met && std::isfinite(best.makespan_s)) {
    double low_s = highest_tried_s, high_s = best.makespan_s;
    for (int step = 0; step < kBisectionSteps && low_s < high_s * (1 - kRefineSteps[0]); ++step) {
      const double target_s = 0.5 * (low_s + high_s);
      if (try_target(target_s)) {
        high_s = std::min(target_s, best.makespan_s);
      } else {
        low_s = target_s;
      }
    }
  }
  if (std::isfinite(best_target_s)) {
    for (double step : kRefineSteps) {
      const double center_s = best_target_s;
      try_target(center_s * (1 - step));
      try_target(center_s * (1 + step));
    }
  }
  exact_ = true;
  if (std::isfinite(best.makespan_s)) finish(&best);
  const double constructed_s = best.makespan_s;

  // Local search from the sweep's plan, priced exactly at once: its makespan tells which
  // baselines need to be built at all (below).
  struct Finalist {
    std::string source;
    Plan plan;
    PlanCost cost;
  };
  std::vector<Finalist> finalists;
  int64_t steps = 0;
  auto search_from = [&](Solution* s, const std::string& source) {
    steps += local_search(s, deadline);
    finalists.push_back({source, to_plan(*s), {}});
  };
  double best_s = kInf, best_baseline_s = kInf;
  auto price_finalists = [&](size_t from) {
    for (size_t k = from; k < finalists.size(); ++k) {
      Finalist& finalist = finalists[k];
      finalist.cost = cost_model_.evaluate(batch_, finalist.plan, cache_);
      if (finalist.cost.fits) best_s = std::min(best_s, finalist.cost.makespan_s);
    }
  };
  if (std::isfinite(best.makespan_s)) search_from(&best, "sweep");
  // Unlike ranks: also the plan made as if the ranks were alike, and a search from it at their
  // speeds. The additive estimates leave out what evaluate adds on top (the launch floor of
  // fillers split over rings, recompute where memory is tight), which a sweep aimed at uneven
  // capacities can run into; this start keeps the result no worse than the speed-blind plan.
  if (cost_model_.cluster().heterogeneous()) {
    const CostModel view = cost_model_.homogeneous_view();
    Plan blind;
    try {
      blind = ZelligePlanner(batch_, view, options_, cache_).run();
    } catch (const PlanMemoryError&) {
      blind.placements.clear();
    }
    if (!blind.placements.empty()) {
      finalists.push_back({"speed-blind", blind, {}});
      import_plan(blind, &current);
      if (std::isfinite(current.makespan_s)) search_from(&current, "search:speed-blind");
    }
  }
  // A baseline start is searched only when its floor is below the sweep's searched makespan (an
  // additive one, close to the exact): otherwise it rarely ends better and costs a whole search.
  const double sweep_s = best.makespan_s;
  price_finalists(0);
  // Where the fastest plan so far is at its busiest rank's launch floor (many short sequences per
  // rank, each length a call of its own), the grouped start (zellige_moves.cc) gives each length
  // ranks of its own. A plan at the batch's lower bound cannot be beaten: then no baseline is
  // built nor searched (nor the bag and configuration starts).
  bool at_lower_bound = false;
  {
    const Finalist* fastest = nullptr;
    for (const Finalist& finalist : finalists) {
      if (finalist.cost.fits &&
          (fastest == nullptr || finalist.cost.makespan_s < fastest->cost.makespan_s)) {
        fastest = &finalist;
      }
    }
    bool launch_bound = false;
    if (fastest != nullptr) {
      for (const RankCost& rank : fastest->cost.ranks) {
        if (rank.time_s == fastest->cost.makespan_s && rank.launch_floor_s >= rank.time_s) {
          launch_bound = true;
        }
      }
    }
    Plan grouped;
    if (launch_bound && grouped_start(&grouped)) {
      finalists.push_back({"grouped", std::move(grouped), {}});
      price_finalists(finalists.size() - 1);
      at_lower_bound = best_s <= makespan_lower_bound(batch_, cost_model_);
    }
  }

  // Every covered baseline's plan (planners.h, covered_baselines): the best kBaselineStarts of
  // them start local searches of their own, and all of them whose floor is within the memory
  // tie-break window of the best plan enter the final exact comparison, so that zellige is never
  // worse than any of them. A baseline whose floor is at least the sweep's searched makespan and
  // above that window would be neither a start nor priced: when a cheap lower bound on its floor
  // (floor_bound) already says so, it is not built at all.
  struct Seed {
    std::string name;
    Plan plan;
    double floor_s = kInf;  // CostModel::makespan_floor: no plan's exact makespan is below it
    double recompute_floor_s = kInf;  // the same with the recompute memory forces: tighter
  };
  const double skip_above_s = std::max(sweep_s, best_s * (1 + kMemoryTieBreak));
  std::vector<Seed> seeds;
  int64_t skipped = 0;
  // dp-cost's index in seeds once built, kNoPlan where it ran out of memory.
  constexpr size_t kNoSeed = SIZE_MAX, kNoPlan = SIZE_MAX - 1;
  size_t dp_cost_seed = kNoSeed;
  const std::vector<std::string> baselines =
      at_lower_bound ? std::vector<std::string>{} : covered_baselines(batch_, cost_model_);
  for (const std::string& name : baselines) {
    bool terms_nonnegative = false;
    const double bound_s =
        std::isfinite(skip_above_s) ? floor_bound(name, &terms_nonnegative) : 0.0;
    if (bound_s > skip_above_s) {
      ++skipped;
      continue;
    }
    Seed seed;
    seed.name = name;
    // KnapFormer's bags are chosen without the cost model: price them first, build the plan
    // only if its floor leaves it a chance.
    if (name.rfind("knapformer:", 0) == 0) {
      const std::string spec = name.substr(11);
      // Its assignment stops once a rank's partial floor already exceeds the threshold.
      planners::KnapformerStop stop;
      if (terms_nonnegative) {
        partial_floor_s_.assign(num_ranks_, 0.0);
        // Only where bags_floor prices the bags too (every bag node-aligned: canonical terms).
        int aligned = -1;
        stop = [&, aligned](const planners::KnapformerBags& bags, int64_t sequence) mutable {
          if (aligned < 0) {
            aligned = 1;
            for (size_t b = 0; b < bags.size.size(); ++b) {
              if (!aligned_group(bags.size[b], bags.first_rank[b])) aligned = 0;
            }
          }
          return aligned == 1 && knapformer_floor_above(bags, sequence, skip_above_s);
        };
      }
      const planners::KnapformerBags bags =
          planners::knapformer_assign(batch_, cost_model_, spec, covered_knapformer_work(), stop);
      if (!bags.complete) {
        ++skipped;
        continue;
      }
      // No start (floor at or above the sweep's) and never priced (the recompute floor above
      // the tie-break window of best_s, which only falls): not built. Where the bags give them
      // (node-aligned), the floors are the plan's makespan_floor, bit for bit.
      double bags_recompute_s = kInf;
      const double bags_s = bags_floor(bags, &bags_recompute_s);
      if (bags_s > skip_above_s ||
          (bags_s >= sweep_s && bags_recompute_s > best_s * (1 + kMemoryTieBreak))) {
        ++skipped;
        continue;
      }
      seed.plan = planners::knapformer_plan(batch_, cost_model_, spec, kCoveredKnapformerGamma, bags);
      if (bags_s >= 0) {
        seed.floor_s = bags_s;
        seed.recompute_floor_s = bags_recompute_s;
      } else {
        seed.floor_s =
            cost_model_.makespan_floor(batch_, seed.plan, cache_, &seed.recompute_floor_s);
      }
      seeds.push_back(std::move(seed));
      continue;
    }
    // static-cp:1 is dp-cost (whole sequences, longest first onto the least-loaded rank, ranks
    // starting at time 0): the same placements, built once.
    if (name == "static-cp:1" && dp_cost_seed != kNoSeed) {
      if (dp_cost_seed == kNoPlan) continue;  // out of memory, as dp-cost
      const Seed& twin = seeds[dp_cost_seed];
      seed.plan = twin.plan;
      seed.plan.planner = name;
      seed.floor_s = twin.floor_s;
      seed.recompute_floor_s = twin.recompute_floor_s;
      seeds.push_back(std::move(seed));
      continue;
    }
    try {
      seed.plan = planners::run_policy(name, batch_, cost_model_, options_, &cache_);
    } catch (const PlanMemoryError&) {
      if (name == "dp-cost") dp_cost_seed = kNoPlan;
      continue;  // the baseline has no plan within memory: nothing to be worse than
    }
    seed.floor_s =
        cost_model_.makespan_floor(batch_, seed.plan, cache_, &seed.recompute_floor_s);
    if (name == "dp-cost") dp_cost_seed = seeds.size();
    seeds.push_back(std::move(seed));
  }
  std::stable_sort(seeds.begin(), seeds.end(),
                   [](const Seed& a, const Seed& b) { return a.floor_s < b.floor_s; });

  // Baselines often agree (dp-cost, static-cp:1 and megatron-dcp on many short sequences).
  auto same_placements = [](const Plan& a, const Plan& b) {
    if (a.num_ranks != b.num_ranks || a.placements.size() != b.placements.size()) return false;
    for (size_t k = 0; k < a.placements.size(); ++k) {
      const Placement& x = a.placements[k];
      const Placement& y = b.placements[k];
      if (x.sequence_id != y.sequence_id || x.strategy != y.strategy || x.ranks != y.ranks ||
          x.ulysses_degree != y.ulysses_degree || x.ring_degree != y.ring_degree) {
        return false;
      }
    }
    return true;
  };

  // Local search from the most promising baseline plans that fit. A start equal to one searched
  // already (same floor, same placements) would end where that search ended: it counts as a
  // start but is not searched again.
  const size_t first_baseline_start = finalists.size();
  size_t starts = 0;
  std::vector<const Seed*> searched_seeds;
  for (const Seed& seed : seeds) {
    if (starts == kBaselineStarts || seed.floor_s >= sweep_s) break;
    bool twin = false;
    for (const Seed* other : searched_seeds) {
      twin = twin || (other->floor_s == seed.floor_s && same_placements(other->plan, seed.plan));
    }
    if (twin) {
      ++starts;
      continue;
    }
    import_plan(seed.plan, &current);
    if (!std::isfinite(current.makespan_s)) continue;  // out of memory
    search_from(&current, "search:" + seed.name);
    searched_seeds.push_back(&seed);
    ++starts;
  }
  // The bag starts often coincide (a run of one and of kBagRun, busiest only or not): one equal
  // to a start searched already is not searched again.
  std::vector<Plan> bag_starts;
  for (const bool busiest_only : {true, false}) {
    if (at_lower_bound) break;
    for (const int32_t max_run : {int32_t{1}, kBagRun}) {
      Plan bags;
      if (!bag_start(busiest_only, max_run, &bags)) break;
      if (std::any_of(bag_starts.begin(), bag_starts.end(),
                      [&](const Plan& other) { return same_placements(other, bags); })) {
        continue;
      }
      import_plan(bags, &current);
      if (std::isfinite(current.makespan_s)) search_from(&current, "search:bags");
      bag_starts.push_back(std::move(bags));
    }
  }
  {
    Plan configurations;
    if (!at_lower_bound && configuration_start(sweep_s, &configurations)) {
      import_plan(configurations, &current);
      if (std::isfinite(current.makespan_s)) search_from(&current, "search:configurations");
    }
  }

  // The exact comparison (CostModel::evaluate, as `zellige compare` prices plans): the fastest
  // plan that fits; among plans within kMemoryTieBreak of it and no slower than any baseline, the
  // one with the lowest peak memory. A baseline whose makespan floor is above that window cannot
  // win and need not be priced exactly.
  price_finalists(first_baseline_start);
  int64_t priced = 0;
  // A plan equal to one priced already (same floor and placements; or a search's plan, which
  // a search that found no move leaves as its start) takes its cost.
  const size_t first_seed_finalist = finalists.size();
  std::vector<double> seed_floors_s;  // per finalist from first_seed_finalist on
  for (Seed& seed : seeds) {
    if (seed.floor_s > best_s * (1 + kMemoryTieBreak)) break;  // seeds are in floor order
    // Neither faster nor within the tie-break window either, by the floor with the recompute
    // that its ranks' memory forces (memory-tight batches, where the first floor is loose).
    if (seed.recompute_floor_s > best_s * (1 + kMemoryTieBreak)) continue;
    Finalist finalist{seed.name, std::move(seed.plan), {}};
    const Finalist* twin = nullptr;
    for (size_t k = first_baseline_start; k < finalists.size() && twin == nullptr; ++k) {
      const bool same_floor =
          k < first_seed_finalist || seed_floors_s[k - first_seed_finalist] == seed.floor_s;
      if (same_floor && finalists[k].cost.fits &&
          same_placements(finalists[k].plan, finalist.plan)) {
        twin = &finalists[k];
      }
    }
    if (twin != nullptr) {
      finalist.cost = twin->cost;
    } else {
      finalist.cost = cost_model_.evaluate(batch_, finalist.plan, cache_);
      ++priced;
    }
    if (!finalist.cost.fits) continue;
    best_s = std::min(best_s, finalist.cost.makespan_s);
    best_baseline_s = std::min(best_baseline_s, finalist.cost.makespan_s);
    finalists.push_back(std::move(finalist));
    seed_floors_s.push_back(seed.floor_s);
  }
  // Exactly priced steps from the fastest plan (zellige_exact.cc): its ring variant where the
  // world exchange makes every rank pay the recompute of the fullest, a search from two sharded
  // sequences split over their ranks' halves, and co-location of equal lengths so that their
  // attention calls merge.
  int64_t coalesced = 0;
  {
    size_t fastest = finalists.size();
    for (size_t k = 0; k < finalists.size(); ++k) {
      if (finalists[k].cost.fits &&
          (fastest == finalists.size() ||
           finalists[k].cost.makespan_s < finalists[fastest].cost.makespan_s)) {
        fastest = k;
      }
    }
    if (fastest < finalists.size()) {
      Plan ring;
      if (ring_variant(finalists[fastest].plan, finalists[fastest].cost, &ring)) {
        const std::string source = finalists[fastest].source;
        finalists.push_back({"ring:" + source, ring, {}});
        price_finalists(finalists.size() - 1);
        // Searched from only when priced close to the fastest plan as it is.
        const PlanCost& ring_cost = finalists.back().cost;
        const double close_s = finalists[fastest].cost.makespan_s * (1 + kExactStartSlack);
        const bool close = ring_cost.fits && ring_cost.makespan_s < close_s;
        if (close) import_plan(ring, &current);
        if (close && std::isfinite(current.makespan_s)) {
          search_from(&current, "search:ring:" + source);
          price_finalists(finalists.size() - 1);
        }
        for (size_t k = finalists.size() - 2; k < finalists.size(); ++k) {
          if (finalists[k].cost.fits &&
              finalists[k].cost.makespan_s < finalists[fastest].cost.makespan_s) {
            fastest = k;
          }
        }
      }
      Plan split;
      if (split_pair(finalists[fastest].plan, finalists[fastest].cost, &split)) {
        PlanCost split_cost = cost_model_.evaluate(batch_, split, cache_);
        widen(&split, &split_cost);
        import_plan(split, &current);
        if (std::isfinite(current.makespan_s)) {
          search_from(&current, "search:split:" + finalists[fastest].source);
          price_finalists(finalists.size() - 1);
          if (finalists.back().cost.fits &&
              finalists.back().cost.makespan_s < finalists[fastest].cost.makespan_s) {
            fastest = finalists.size() - 1;
          }
        }
      }
      // In place, then the starting plan restored beside it (without a copy when no step is
      // kept): both enter the memory tie-break.
      Undo undo;
      coalesced = coalesce(&finalists[fastest].plan, &finalists[fastest].cost, &undo);
      if (coalesced > 0) {
        Finalist grouped = finalists[fastest];
        grouped.source = "coalesced:" + grouped.source;
        best_s = std::min(best_s, grouped.cost.makespan_s);
        Finalist& start = finalists[fastest];
        for (auto it = undo.ranks.rbegin(); it != undo.ranks.rend(); ++it) {
          start.plan.placements[it->first].ranks[0] = it->second;
        }
        start.cost = std::move(undo.cost);
        finalists.push_back(std::move(grouped));
      }
    }
  }
  if (!std::isfinite(best_s)) {
    throw PlanMemoryError(memory_error.empty()
                              ? "no construction and no baseline found a plan within memory"
                              : memory_error);
  }
  const double cap_s = std::min(best_s * (1 + kMemoryTieBreak), best_baseline_s);
  Finalist* chosen = nullptr;
  for (Finalist& finalist : finalists) {
    if (!finalist.cost.fits || finalist.cost.makespan_s > cap_s) continue;
    if (chosen == nullptr || finalist.cost.peak_bytes < chosen->cost.peak_bytes ||
        (finalist.cost.peak_bytes == chosen->cost.peak_bytes &&
         finalist.cost.makespan_s < chosen->cost.makespan_s)) {
      chosen = &finalist;
    }
  }
  Plan plan = std::move(chosen->plan);  // the finalists end here
  planners::set_prediction(plan, chosen->cost);  // make_plan's prediction: priced already
  plan.planner = "zellige";
  plan.note = "anchors=" + std::to_string(best.num_anchors) +
              " target_s=" + shortest(best_target_s) + " constructed_s=" + shortest(constructed_s) +
              " search_steps=" + std::to_string(steps) + " baselines=" +
              std::to_string(seeds.size()) + " skipped=" + std::to_string(skipped) + " priced=" + std::to_string(priced) +
              " coalesced=" + std::to_string(coalesced) + " final=" + chosen->source +
              (chosen->cost.makespan_s > best_s ? " memory_tie_break" : "");
  plan.plan_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return plan;
}

Plan ZelligePlanner::search_only(const Plan& start, bool whole_anchor_moves) {
  prepare();
  whole_anchor_moves_ = whole_anchor_moves;
  Solution s;
  import_plan(start, &s);
  local_search(&s, Clock::now() + std::chrono::seconds(60));
  return to_plan(s);
}

Plan ZelligePlanner::coalesce_only(const Plan& start, int64_t* steps) {
  prepare();
  Plan plan = start;
  PlanCost cost = cost_model_.evaluate(batch_, plan, cache_);
  const int64_t kept = coalesce(&plan, &cost);
  if (steps != nullptr) *steps = kept;
  return plan;
}

double ZelligePlanner::bags_floor_only(const std::string& spec, Plan* plan,
                                       double* recompute_floor_s) {
  prepare();
  const planners::KnapformerBags bags =
      planners::knapformer_assign(batch_, cost_model_, spec, covered_knapformer_work());
  *plan = planners::knapformer_plan(batch_, cost_model_, spec, kCoveredKnapformerGamma, bags);
  return bags_floor(bags, recompute_floor_s);
}

Plan ZelligePlanner::to_plan(const Solution& s) const {
  Plan plan;
  plan.planner = "zellige";
  plan.num_ranks = num_ranks_;
  plan.placements.reserve(num_sequences_);
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const int64_t id = batch_.sequences[i].id;
    if (s.anchor_slot[i] >= 0) {
      const AnchorPlacement& anchor = s.anchors[s.anchor_slot[i]];
      plan.placements.push_back(to_placement(id, anchor.shape, anchor.ranks));
    } else {
      plan.placements.push_back(to_placement(id, Shape{}, {s.filler_rank[i]}));
    }
  }
  return plan;
}


}  // namespace zellige::planners::zellige_detail

namespace zellige {

using planners::zellige_detail::Shape;
using planners::zellige_detail::ZelligePlanner;
using planners::zellige_detail::shapes_of_degree;
using planners::zellige_detail::to_placement;


Plan plan_zellige(const Batch& batch, const CostModel& cost_model, const PlannerOptions& options) {
  EvaluationCache cache;
  return ZelligePlanner(batch, cost_model, options, cache).run();
}

namespace planners {

Plan zellige(const Batch& batch, const CostModel& cost_model, const PlannerOptions& options,
             EvaluationCache* cache) {
  if (cache == nullptr) return plan_zellige(batch, cost_model, options);
  return ZelligePlanner(batch, cost_model, options, *cache).run();
}

Plan zellige_search(const Batch& batch, const CostModel& cost_model, const Plan& start,
                    bool whole_anchor_moves) {
  EvaluationCache cache;
  const PlannerOptions options;
  return ZelligePlanner(batch, cost_model, options, cache).search_only(start, whole_anchor_moves);
}

Plan zellige_coalesce(const Batch& batch, const CostModel& cost_model, const Plan& start,
                      int64_t* steps) {
  EvaluationCache cache;
  const PlannerOptions options;
  return ZelligePlanner(batch, cost_model, options, cache).coalesce_only(start, steps);
}

double zellige_bags_floor(const Batch& batch, const CostModel& cost_model, const std::string& spec,
                          Plan* plan, double* recompute_floor_s) {
  EvaluationCache cache;
  const PlannerOptions options;
  return ZelligePlanner(batch, cost_model, options, cache)
      .bags_floor_only(spec, plan, recompute_floor_s);
}

}  // namespace planners

// Node-aligned windows of `degree` consecutive ranks, spread over nodes first so that a cap keeps
// variety: inside a node, offsets that are multiples of the degree come first; beyond a node,
// windows start (then end) on node boundaries.
std::vector<Placement> candidate_placements(const Sequence& sequence, const CostModel& cost_model,
                                            int64_t max_windows_per_shape, int64_t max_degree) {
  if (max_windows_per_shape <= 0) {
    throw std::invalid_argument("max_windows_per_shape must be positive, got " +
                                std::to_string(max_windows_per_shape));
  }
  const Cluster& cluster = cost_model.cluster();
  const int64_t num_ranks = cluster.num_ranks();
  const int64_t gpus_per_node = cluster.gpus_per_node;
  const int64_t num_nodes = cluster.num_nodes;
  std::vector<Placement> candidates;
  std::vector<int64_t> starts;
  std::vector<Shape> shapes;
  const int64_t last_degree = max_degree > 0 ? std::min(max_degree, num_ranks) : num_ranks;
  for (int64_t degree = 1; degree <= last_degree; ++degree) {
    starts.clear();
    if (degree <= gpus_per_node) {
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t offset = 0; offset + degree <= gpus_per_node; ++offset) {
          if ((offset % degree == 0) != (pass == 0)) continue;
          for (int64_t node = 0; node < num_nodes; ++node) {
            starts.push_back(node * gpus_per_node + offset);
          }
        }
      }
    } else {
      const int64_t span_nodes = (degree + gpus_per_node - 1) / gpus_per_node;
      for (int64_t node = 0; node + span_nodes <= num_nodes; ++node) {
        starts.push_back(node * gpus_per_node);
      }
      for (int64_t node = 0; node + span_nodes <= num_nodes; ++node) {
        const int64_t start = (node + span_nodes) * gpus_per_node - degree;
        if (start % gpus_per_node != 0) starts.push_back(start);
      }
    }
    if (static_cast<int64_t>(starts.size()) > max_windows_per_shape) {
      starts.resize(max_windows_per_shape);
    }
    shapes_of_degree(degree, cost_model.model().num_heads, gpus_per_node, &shapes);
    for (const Shape& shape : shapes) {
      for (int64_t start : starts) {
        std::vector<int64_t> ranks(degree);
        std::iota(ranks.begin(), ranks.end(), start);
        candidates.push_back(to_placement(sequence.id, shape, std::move(ranks)));
      }
    }
  }
  return candidates;
}

}  // namespace zellige
