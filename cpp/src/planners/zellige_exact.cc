// Steps of the zellige planner priced exactly (CostModel::evaluate), for what the search's additive
// times cannot see: the recompute that memory forces on every rank once a plan exchanges q, k, v
// over the world (Ulysses), two sharded sequences that only a joint move pulls apart, and
// attention calls that merge when equal lengths share a rank.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "zellige_planner.h"

namespace zellige::planners::zellige_detail {

namespace {

double summed_s(const PlanCost& cost) {
  double total_s = 0;
  for (const RankCost& rank : cost.ranks) total_s += rank.time_s;
  return total_s;
}

// Lexicographic: a lower makespan, else the same makespan and less time summed over the ranks (a
// merge that does not relieve the busiest rank yet relieves another, so later steps can).
bool better_cost(const PlanCost& candidate, const PlanCost& current) {
  if (!candidate.fits) return false;
  if (candidate.makespan_s < current.makespan_s * (1 - kMinGain)) return true;
  if (candidate.makespan_s > current.makespan_s * (1 + kMinGain)) return false;
  return summed_s(candidate) < summed_s(current) * (1 - kMinGain);
}

}  // namespace

bool ZelligePlanner::ring_variant(const Plan& plan, const PlanCost& cost, Plan* variant) const {
  bool world_exchange = false;
  for (const Placement& placement : plan.placements) {
    world_exchange = world_exchange || placement.ulysses_degree > 1;
  }
  if (!world_exchange) return false;
  bool full_recompute = false;
  for (const RankCost& rank : cost.ranks) {
    full_recompute = full_recompute || rank.full_recompute_layers > 0;
  }
  if (!full_recompute) return false;
  *variant = plan;
  for (Placement& placement : variant->placements) {
    if (placement.ulysses_degree == 1) continue;
    placement = to_placement(placement.sequence_id,
                             Shape{Strategy::kRing, placement.degree(), 1}, placement.ranks);
  }
  return true;
}

bool ZelligePlanner::split_pair(const Plan& plan, const PlanCost& cost, Plan* split) const {
  std::vector<size_t> anchors;
  for (size_t i = 0; i < plan.placements.size(); ++i) {
    if (plan.placements[i].ranks.size() > 1) anchors.push_back(i);
  }
  if (anchors.size() < 2 || anchors.size() > kSplitAnchors) return false;
  std::vector<Shape> shapes;
  std::vector<int64_t> ranks;
  Plan trial = plan;
  double best_s = cost.makespan_s * (1 + kExactStartSlack);
  bool found = false;
  int64_t evaluations = exact_evaluations();
  for (size_t x = 0; x < anchors.size(); ++x) {
    for (size_t y = x + 1; y < anchors.size(); ++y) {
      const Placement& a = plan.placements[anchors[x]];
      const Placement& b = plan.placements[anchors[y]];
      ranks = a.ranks;
      ranks.insert(ranks.end(), b.ranks.begin(), b.ranks.end());
      std::sort(ranks.begin(), ranks.end());
      const auto shared = std::adjacent_find(ranks.begin(), ranks.end());
      if (shared == ranks.end()) continue;  // disjoint: each already has ranks of its own
      ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
      const int64_t half = static_cast<int64_t>(ranks.size()) / 2;
      if (half < 2 || 2 * half != static_cast<int64_t>(ranks.size())) continue;
      const std::vector<int64_t> low(ranks.begin(), ranks.begin() + half);
      const std::vector<int64_t> high(ranks.begin() + half, ranks.end());
      shapes_of_degree(half, num_heads_, gpus_per_node_, &shapes);
      for (const bool a_low : {true, false}) {
        for (const Shape& shape : shapes) {
          if (evaluations-- == 0) return found;
          trial.placements[anchors[x]] = to_placement(a.sequence_id, shape, a_low ? low : high);
          trial.placements[anchors[y]] = to_placement(b.sequence_id, shape, a_low ? high : low);
          const PlanCost trial_cost = cost_model_.evaluate(batch_, trial, cache_);
          if (trial_cost.fits && trial_cost.makespan_s < best_s) {
            best_s = trial_cost.makespan_s;
            *split = trial;
            found = true;
          }
        }
      }
      trial.placements[anchors[x]] = a;
      trial.placements[anchors[y]] = b;
    }
  }
  return found;
}

int64_t ZelligePlanner::widen(Plan* plan, PlanCost* cost) const {
  std::vector<Shape> shapes;
  std::vector<int64_t> hull;
  int64_t widened = 0, evaluations = exact_evaluations();
  for (size_t i = 0; i < plan->placements.size(); ++i) {
    const Placement placement = plan->placements[i];
    if (placement.ranks.size() < 2) continue;
    hull.clear();
    for (const int64_t rank : placement.ranks) {
      const int64_t first = rank - rank % gpus_per_node_;
      for (int64_t r = first; r < first + gpus_per_node_; ++r) hull.push_back(r);
    }
    std::sort(hull.begin(), hull.end());
    hull.erase(std::unique(hull.begin(), hull.end()), hull.end());
    if (hull.size() == placement.ranks.size()) continue;
    shapes_of_degree(static_cast<int64_t>(hull.size()), num_heads_, gpus_per_node_, &shapes);
    Placement best = placement;
    for (const Shape& shape : shapes) {
      if (evaluations-- == 0) break;
      plan->placements[i] = to_placement(placement.sequence_id, shape, hull);
      PlanCost trial_cost = cost_model_.evaluate(batch_, *plan, cache_);
      if (trial_cost.fits && summed_s(trial_cost) < summed_s(*cost) * (1 - kMinGain)) {
        *cost = std::move(trial_cost);
        best = plan->placements[i];
      }
    }
    plan->placements[i] = best;
    if (best.ranks != placement.ranks) ++widened;
  }
  return widened;
}

int64_t ZelligePlanner::coalesce(Plan* plan, PlanCost* cost, Undo* undo) {
  if (static_cast<int64_t>(plan->placements.size()) != num_sequences_ || !cost->fits) return 0;
  std::vector<int64_t> rank_of(num_sequences_, -1);  // local sequences' ranks
  std::vector<int32_t> key_total(num_sequences_, 0);  // by shape key: local sequences with it
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const Placement& placement = plan->placements[i];
    if (placement.sequence_id != batch_.sequences[i].id) return 0;  // not in batch order
    if (placement.ranks.size() != 1) continue;
    rank_of[i] = placement.ranks[0];
    ++key_total[shape_key_[i]];
  }
  std::vector<int32_t> on_busiest, movable, holders;
  const auto count_on_busiest = [&](int32_t key) {
    return std::count_if(on_busiest.begin(), on_busiest.end(),
                         [&](int32_t i) { return shape_key_[i] == key; });
  };
  std::vector<std::vector<int32_t>> locals;  // by rank, built once a step is possible
  std::vector<std::vector<int32_t>> members;  // by shape key: its local sequences
  struct Trial {
    int32_t sequence = -1, partner = -1;  // partner: -1 for a move
    int64_t rank = -1;
  };
  std::vector<Trial> trials;
  const int64_t most_evaluations = exact_evaluations();
  int64_t evaluations = 0, accepted = 0;
  for (int64_t round = 0; round < kCoalesceRounds && evaluations < most_evaluations; ++round) {
    int64_t busiest = 0;
    for (int64_t r = 1; r < num_ranks_; ++r) {
      if (cost->ranks[r].time_s > cost->ranks[busiest].time_s) busiest = r;
    }
    // Sequences alone with their key on the busiest rank whose key lives elsewhere too: moving
    // one out takes a call off the busiest rank and merges it where it lands. Largest first.
    on_busiest.clear();
    for (int64_t i = 0; i < num_sequences_; ++i) {
      if (rank_of[i] == busiest) on_busiest.push_back(static_cast<int32_t>(i));
    }
    movable.clear();
    for (const int32_t i : on_busiest) {
      if (key_total[shape_key_[i]] > 1 && count_on_busiest(shape_key_[i]) == 1) {
        movable.push_back(i);
      }
    }
    if (movable.empty()) break;
    std::sort(movable.begin(), movable.end(), [&](int32_t a, int32_t b) {
      return local_estimate_s_[a] > local_estimate_s_[b] ||
             (local_estimate_s_[a] == local_estimate_s_[b] && a < b);
    });
    if (locals.empty()) {
      locals.resize(num_ranks_);
      members.resize(num_sequences_);
      for (int64_t i = 0; i < num_sequences_; ++i) {
        if (rank_of[i] >= 0) members[shape_key_[i]].push_back(static_cast<int32_t>(i));
      }
    }
    for (auto& sequences : locals) sequences.clear();
    for (int64_t i = 0; i < num_sequences_; ++i) {
      if (rank_of[i] >= 0) locals[rank_of[i]].push_back(static_cast<int32_t>(i));
    }
    trials.clear();
    for (const int32_t i : movable) {
      holders.clear();
      for (const int32_t j : members[shape_key_[i]]) {
        if (rank_of[j] != busiest) holders.push_back(static_cast<int32_t>(rank_of[j]));
      }
      std::sort(holders.begin(), holders.end(), [&](int32_t a, int32_t b) {
        return cost->ranks[a].time_s < cost->ranks[b].time_s ||
               (cost->ranks[a].time_s == cost->ranks[b].time_s && a < b);
      });
      holders.erase(std::unique(holders.begin(), holders.end()), holders.end());
      if (holders.size() > kCoalesceHolders) holders.resize(kCoalesceHolders);
      for (const int32_t rank : holders) {
        trials.push_back({i, -1, rank});
        // Swaps with the holder's sequences whose key the busiest rank holds: both merge.
        int partners = 0;
        for (const int32_t j : locals[rank]) {
          if (partners == kCoalescePartners) break;
          if (shape_key_[j] == shape_key_[i] || count_on_busiest(shape_key_[j]) == 0) continue;
          trials.push_back({i, j, rank});
          ++partners;
        }
      }
    }
    Trial best_trial;
    PlanCost best_cost = *cost;
    for (const Trial& trial : trials) {
      if (evaluations == most_evaluations) break;
      plan->placements[trial.sequence].ranks[0] = trial.rank;
      if (trial.partner >= 0) plan->placements[trial.partner].ranks[0] = busiest;
      PlanCost trial_cost = cost_model_.evaluate(batch_, *plan, cache_);
      ++evaluations;
      if (better_cost(trial_cost, best_cost)) {
        best_cost = std::move(trial_cost);
        best_trial = trial;
      }
      plan->placements[trial.sequence].ranks[0] = busiest;
      if (trial.partner >= 0) plan->placements[trial.partner].ranks[0] = trial.rank;
    }
    if (best_trial.sequence < 0) break;
    if (undo != nullptr) {
      if (accepted == 0) undo->cost = *cost;
      undo->ranks.push_back({best_trial.sequence, busiest});
      if (best_trial.partner >= 0) undo->ranks.push_back({best_trial.partner, best_trial.rank});
    }
    plan->placements[best_trial.sequence].ranks[0] = best_trial.rank;
    rank_of[best_trial.sequence] = best_trial.rank;
    if (best_trial.partner >= 0) {
      plan->placements[best_trial.partner].ranks[0] = busiest;
      rank_of[best_trial.partner] = busiest;
    }
    *cost = std::move(best_cost);
    ++accepted;
  }
  return accepted;
}

}  // namespace zellige::planners::zellige_detail
