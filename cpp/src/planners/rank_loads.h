// Private to the planners: running per-rank totals of a plan under construction, so greedy
// policies can ask "what would this rank's time / memory be if it also took this share?".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zellige/cost_model.h"
#include "zellige/plan.h"

namespace zellige::planners {

class RankLoads {
 public:
  // `cache` (optional) memoises shares() across the policies zellige runs on one batch.
  explicit RankLoads(const CostModel& cost_model, EvaluationCache* cache = nullptr);

  // cost_model.shares, through the cache when there is one (same values).
  std::vector<RankShare> shares(const Sequence& sequence, const Placement& placement) const {
    return cache_ != nullptr ? cost_model_.shares(sequence, placement, *cache_)
                             : cost_model_.shares(sequence, placement);
  }

  int64_t num_ranks() const { return static_cast<int64_t>(tokens_.size()); }
  // The cost model's rank time from this rank's totals (per-token layers are not additive).
  double time_s(int64_t rank) const;
  int64_t tokens(int64_t rank) const { return tokens_[rank]; }
  // A lower bound on time_s(rank), now and after any later add(): the per-token layers at the
  // cost model's best rate per token (min_linear_time_per_token_s, less 1e-9 for rounding), plus
  // attention and exchange, which add() only increases (shares' times are non-negative).
  double time_floor_s(int64_t rank) const {
    return static_cast<double>(tokens_[rank]) * least_s_per_token_ + attention_s_[rank] +
           exchange_s_[rank];
  }
  // Fixed bytes (weights, optimizer state, reserve) plus every share's memory on this rank.
  double peak_bytes(int64_t rank) const { return fixed_bytes_ + memory_bytes_[rank]; }
  double capacity_bytes() const { return capacity_bytes_; }

  // Whether every rank of `shares` stays within memory capacity after taking its share.
  bool fits(const std::vector<RankShare>& shares) const;
  // The largest time over the ranks of `shares` after they took their shares.
  double time_with_s(const std::vector<RankShare>& shares) const;
  void add(const std::vector<RankShare>& shares);
  // fits and add for `num_ranks` ranks from `first_rank` that take the same share (its rank
  // not read): a run of a ring's alike positions (CostModel::share_runs).
  bool fits(const RankShare& share, int64_t first_rank, int64_t num_ranks) const;
  void add(const RankShare& share, int64_t first_rank, int64_t num_ranks);
  void remove(const std::vector<RankShare>& shares);

 private:
  const CostModel& cost_model_;
  EvaluationCache* cache_;
  double fixed_bytes_;
  double capacity_bytes_;
  double least_s_per_token_;
  std::vector<int64_t> tokens_;
  std::vector<double> attention_s_;
  std::vector<double> exchange_s_;
  std::vector<double> memory_bytes_;
};

// Bytes as "12.3 GiB" for error messages.
std::string format_gib(double bytes);

// "sequence 7 (118800 tokens)" for error messages.
std::string describe_sequence(const Sequence& sequence);

// The largest time a placement costs any of its ranks, the sequence alone on empty ranks.
double placement_time_s(const CostModel& cost_model, const std::vector<RankShare>& shares);

// The largest memory a placement costs any of its ranks, the sequence alone (fixed bytes excluded).
double placement_memory_bytes(const std::vector<RankShare>& shares);

// A plan with the planner name and rank count set and no placements yet.
Plan empty_plan(const std::string& planner, const CostModel& cost_model);

// Ranks first, first + 1, ..., first + count - 1.
std::vector<int64_t> consecutive_ranks(int64_t first, int64_t count);

}  // namespace zellige::planners
