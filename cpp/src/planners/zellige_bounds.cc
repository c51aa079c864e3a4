// Lower bounds on the covered baselines' makespan floors, so that zellige builds only the
// baselines that could still win or tie (run: skip_above_s).
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "zellige_planner.h"

namespace zellige::planners::zellige_detail {

// What a sequence adds to makespan_floor's ranks, summed (CostModel::floor_rank_seconds), on one
// group of `group_size` consecutive node-aligned ranks under the USP rule of static-cp (Ulysses
// over the largest degree dividing the size and the head count, ring over the rest), which is
// also KnapFormer's Ulysses over a bag (its bag sizes divide the head count).
double ZelligePlanner::group_floor_rank_seconds(int32_t sequence, int64_t group_size) {
  std::vector<double>& memo = group_floor_s_[group_size];
  if (memo.empty()) memo.assign(num_sequences_, std::numeric_limits<double>::quiet_NaN());
  double& value = memo[shape_key_[sequence]];
  if (!std::isnan(value)) return value;
  int64_t ulysses = 1;
  for (int64_t u = group_size; u > 1; --u) {
    if (group_size % u == 0 && num_heads_ % u == 0) {
      ulysses = u;
      break;
    }
  }
  const Shape shape{group_size == 1          ? Strategy::kLocal
                    : ulysses == group_size ? Strategy::kUlysses
                    : ulysses == 1          ? Strategy::kRing
                                            : Strategy::kHybrid,
                    group_size, ulysses};
  std::vector<int64_t> ranks(group_size);
  std::iota(ranks.begin(), ranks.end(), 0);
  const Sequence& seq = batch_.sequences[sequence];
  value = cost_model_.floor_rank_seconds(seq, to_placement(seq.id, shape, std::move(ranks)), cache_);
  return value;
}

// The smallest floor term (makespan_floor's, per-token layers at their fastest rate) that a
// KnapFormer bag of `size` ranks (Ulysses) adds to one of its ranks for `sequence`.
double ZelligePlanner::least_floor_share_s(int32_t sequence, int64_t size) {
  std::vector<double>& memo = least_share_s_[size];
  if (memo.empty()) memo.assign(num_sequences_, std::numeric_limits<double>::quiet_NaN());
  double& value = memo[shape_key_[sequence]];
  if (!std::isnan(value)) return value;
  const Sequence& seq = batch_.sequences[sequence];
  cost_model_.floor_terms(seq, bag_placement(seq, size), cache_, &scratch_terms_);
  const double rate_s = cost_model_.min_floor_time_per_token_s();
  value = kInf;
  for (const CostModel::FloorTerm& term : scratch_terms_) {
    value = std::min(value,
                     rate_s * static_cast<double>(term.tokens) + term.added_s - term.skipped_s);
  }
  return value;
}

// A lower bound on makespan_floor of the named baseline's plan, without building it; 0 when
// there is none. Baselines that give every sequence one of a few group sizes on node-aligned
// groups (dp-tokens and dp-cost: 1; static-cp:C: C; knapformer: its bag sizes) charge each
// sequence at least its smallest floor rank-seconds over those sizes, and the busiest rank's
// floor is at least the mean over ranks. Whichever ranks the policy picks, this holds.
double ZelligePlanner::floor_bound(const std::string& baseline, bool* terms_nonnegative) {
  if (terms_nonnegative) *terms_nonnegative = false;
  std::vector<int64_t> sizes;
  auto aligned = [&](int64_t size, int64_t first_rank) { return aligned_group(size, first_rank); };
  bool knapformer = false;
  std::vector<int64_t> counts;  // KnapFormer: bags per size
  if (baseline == "dp-tokens" || baseline == "dp-cost") {
    sizes = {1};
  } else if (baseline.rfind("static-cp:", 0) == 0) {
    const int64_t size = std::stoll(baseline.substr(10));
    if (!aligned(size, 0)) return 0;
    sizes = {size};
  } else if (baseline.rfind("knapformer:", 0) == 0) {
    // Covered specs: terms gGnN joined by '+', by increasing G, bags laid out in that order.
    const std::string spec = baseline.substr(11);
    int64_t first_rank = 0;
    size_t begin = 0;
    while (begin < spec.size()) {
      const size_t end = std::min(spec.find('+', begin), spec.size());
      const size_t n = spec.find('n', begin);
      if (spec[begin] != 'g' || n == std::string::npos || n > end) return 0;
      const int64_t size = std::stoll(spec.substr(begin + 1, n - begin - 1));
      const int64_t count = std::stoll(spec.substr(n + 1, end - n - 1));
      if (size <= 0 || !aligned(size, first_rank)) return 0;
      sizes.push_back(size);
      counts.push_back(count);
      first_rank += size * count;
      begin = end + 1;
    }
    if (sizes.empty()) return 0;
    // Covered specs list their sizes increasing: the last is KnapFormer's fallback (largest).
    if (!std::is_sorted(sizes.begin(), sizes.end())) return 0;
    knapformer = sizes.size() > 1;
  } else {
    return 0;  // megatron-dcp: sizes chosen per group; always built
  }
  // The bound depends on the sizes only (dp-tokens, dp-cost, static-cp:1 and knapformer:g1nN
  // share one, static-cp:C and knapformer:gCnN another; only mixed KnapFormer specs have several).
  std::sort(sizes.begin(), sizes.end());  // KnapFormer's are sorted already (counts match)
  const auto [known, inserted] = floor_of_sizes_.try_emplace(sizes);
  SizesFloor& memo = known->second;
  const size_t num_sizes = sizes.size();
  if (inserted) {
    // The mean over ranks; and the busiest group: a group's busiest rank is at least the mean of
    // its ranks, so at least any one of its sequences' floor rank-seconds over the group size,
    // when no sequence's is negative.
    // KnapFormer with several bag sizes puts a sequence only into bags it is eligible for
    // (knapformer_assign: a bag of size g takes it when g ranks' share of the total work holds its
    // work and it has at least g tokens), or into the largest bags when none is: only those sizes
    // count for it. (With one size, every sequence gets that size anyway.)
    const planners::KnapformerWork* work = knapformer ? &covered_knapformer_work() : nullptr;
    const double capacity_per_gpu =
        knapformer ? work->total_work / static_cast<double>(num_ranks_) : 0.0;
    // KnapFormer's terms also bound it: the sequences eligible only for sizes >= G (or <= G) all
    // land on the ranks of those terms, whose busiest rank is at least their mean, provided no
    // other sequence's share could lower a rank's floor (every share's floor term >= 0).
    std::vector<double>& forced_up_s = memo.forced_up_s;
    std::vector<double>& forced_down_s = memo.forced_down_s;
    forced_up_s.assign(num_sizes, 0.0);
    forced_down_s.assign(num_sizes, 0.0);
    bool& shares_nonnegative = memo.shares_nonnegative;
    shares_nonnegative = knapformer;
    // The memos by size, looked up once here rather than once per sequence (made by a first call).
    if (num_sequences_ == 0) return 0;
    std::vector<std::vector<double>*> group_memos(num_sizes), share_memos(num_sizes);
    for (size_t t = 0; t < num_sizes; ++t) {
      group_floor_rank_seconds(0, sizes[t]);
      group_memos[t] = &group_floor_s_[sizes[t]];
      if (knapformer) {
        least_floor_share_s(0, sizes[t]);
        share_memos[t] = &least_share_s_[sizes[t]];
      }
    }
    auto rank_seconds_of = [&](int64_t i, size_t t) {
      const double value = (*group_memos[t])[shape_key_[i]];
      return std::isnan(value) ? group_floor_rank_seconds(static_cast<int32_t>(i), sizes[t])
                               : value;
    };
    auto least_share_of = [&](int64_t i, size_t t) {
      const double value = (*share_memos[t])[shape_key_[i]];
      return std::isnan(value) ? least_floor_share_s(static_cast<int32_t>(i), sizes[t]) : value;
    };
    // Everything below depends on a sequence's lengths only: once per shape key, times its count.
    double total_s = 0, largest_per_rank_s = 0, smallest_s = kInf;
    for (const auto& [i, count] : shape_key_counts_) {
      double least_s = kInf, least_per_rank_s = kInf;
      bool any_eligible = !knapformer;
      size_t lowest = num_sizes, highest = 0;  // eligible size indices
      for (size_t t = 0; t < num_sizes; ++t) {
        const int64_t size = sizes[t];
        if (knapformer && !(capacity_per_gpu * static_cast<double>(size) >= work->work[i] &&
                            batch_.sequences[i].num_tokens >= size)) {
          continue;
        }
        if (knapformer) {
          lowest = std::min(lowest, t);
          highest = t;
          shares_nonnegative = shares_nonnegative && least_share_of(i, t) >= 0;
        }
        any_eligible = true;
        const double rank_seconds = rank_seconds_of(i, t);
        least_s = std::min(least_s, rank_seconds);
        least_per_rank_s = std::min(least_per_rank_s, rank_seconds / static_cast<double>(size));
        smallest_s = std::min(smallest_s, rank_seconds);
      }
      if (!any_eligible) {  // the fallback: the largest bags
        const int64_t size = sizes.back();
        const double rank_seconds = rank_seconds_of(i, num_sizes - 1);
        least_s = rank_seconds;
        least_per_rank_s = rank_seconds / static_cast<double>(size);
        smallest_s = std::min(smallest_s, rank_seconds);
        lowest = highest = num_sizes - 1;
        shares_nonnegative = shares_nonnegative && least_share_of(i, num_sizes - 1) >= 0;
      }
      if (knapformer) {
        forced_up_s[lowest] += static_cast<double>(count) * least_s;
        forced_down_s[highest] += static_cast<double>(count) * least_s;
      }
      total_s += static_cast<double>(count) * least_s;
      largest_per_rank_s = std::max(largest_per_rank_s, least_per_rank_s);
    }
    memo.bound_s = total_s / static_cast<double>(num_ranks_);
    if (smallest_s >= 0) memo.bound_s = std::max(memo.bound_s, largest_per_rank_s);
  }  // inserted
  double bound_s = memo.bound_s;
  if (terms_nonnegative) *terms_nonnegative = knapformer && memo.shares_nonnegative;
  if (knapformer && memo.shares_nonnegative) {
    const std::vector<double>& forced_up_s = memo.forced_up_s;
    const std::vector<double>& forced_down_s = memo.forced_down_s;
    double up_s = 0, down_s = 0;
    int64_t up_ranks = 0, down_ranks = 0;
    for (size_t t = num_sizes; t-- > 1;) {  // sizes >= sizes[t]
      up_s += forced_up_s[t];
      up_ranks += sizes[t] * counts[t];
      bound_s = std::max(bound_s, up_s / static_cast<double>(up_ranks));
    }
    for (size_t t = 0; t + 1 < num_sizes; ++t) {  // sizes <= sizes[t]
      down_s += forced_down_s[t];
      down_ranks += sizes[t] * counts[t];
      bound_s = std::max(bound_s, down_s / static_cast<double>(down_ranks));
    }
  }
  // Every term bounds some rank's nominal floor; on unlike ranks that rank may be the fastest.
  // Summed in another order than makespan_floor's: keep clear of rounding.
  return bound_s / max_speed_ * (1 - 1e-9);
}

// KnapFormer's assignment, watched as it goes (knapformer_assign's stop; node-aligned bags): adds
// the floor terms of `sequence`'s bag to partial per-rank sums (per-token layers at their fastest rate) and says
// whether one exceeds `limit_s`. When no term a sequence can add is negative (floor_bound's
// terms_nonnegative), a rank's makespan_floor can only end at or above its partial sum, so the
// plan's floor exceeds the limit: bags_floor need not run, nor the rest of the assignment.
bool ZelligePlanner::knapformer_floor_above(const planners::KnapformerBags& bags,
                                            int64_t sequence, double limit_s) {
  const int64_t bag = bags.of_sequence[sequence];
  const int64_t size = bags.size[bag];
  std::vector<std::vector<CostModel::FloorTerm>>& memo = bag_floor_terms_[size];
  if (memo.empty()) memo.resize(num_sequences_);
  std::vector<CostModel::FloorTerm>& terms = memo[shape_key_[sequence]];
  if (terms.empty()) {
    const Sequence& seq = batch_.sequences[sequence];
    cost_model_.floor_terms(seq, bag_placement(seq, size), cache_, &terms);
  }
  const double rate_s = cost_model_.min_floor_time_per_token_s();
  bool above = false;
  for (size_t k = 0; k < terms.size(); ++k) {
    const int64_t rank = bags.first_rank[bag] + static_cast<int64_t>(k);
    double& sum_s = partial_floor_s_[rank];
    sum_s += rate_s * static_cast<double>(terms[k].tokens) + terms[k].added_s - terms[k].skipped_s;
    // Summed in another order than makespan_floor's: keep clear of rounding.
    above = above || at_speed(rank, sum_s) * (1 - 1e-9) > limit_s;
  }
  return above;
}

// Whether `size` consecutive ranks from `first_rank` have the node pattern of ranks 0..size-1.
bool ZelligePlanner::aligned_group(int64_t size, int64_t first_rank) const {
  if (size <= gpus_per_node_) return gpus_per_node_ % size == 0 && first_rank % size == 0;
  return size % gpus_per_node_ == 0 && first_rank % gpus_per_node_ == 0;
}

// makespan_floor of knapformer_plan(bags), bit for bit (the same terms added to the same ranks in
// the same order), without building the plan; -1 when a bag is not node-aligned. With
// `recompute_floor_s`, also makespan_floor's recompute floor of that plan, bit for bit.
double ZelligePlanner::bags_floor(const planners::KnapformerBags& bags,
                                  double* recompute_floor_s) {
  for (size_t b = 0; b < bags.size.size(); ++b) {
    if (!aligned_group(bags.size[b], bags.first_rank[b])) return -1;
  }
  floor_tokens_.assign(num_ranks_, 0);
  floor_other_s_.assign(num_ranks_, 0.0);
  const bool memory_terms = recompute_floor_s != nullptr;
  if (memory_terms) floor_memory_.reset(num_ranks_);
  // Per bag, its size's memo (one hash lookup per bag, none per sequence).
  bag_memos_.resize(bags.size.size());
  for (size_t b = 0; b < bags.size.size(); ++b) {
    std::vector<std::vector<CostModel::FloorTerm>>& memo = bag_floor_terms_[bags.size[b]];
    if (memo.empty()) memo.resize(num_sequences_);
    bag_memos_[b] = &memo;
  }
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const int64_t bag = bags.of_sequence[i];
    const int64_t size = bags.size[bag];
    std::vector<CostModel::FloorTerm>& terms = (*bag_memos_[bag])[shape_key_[i]];
    if (terms.empty()) {
      const Sequence& seq = batch_.sequences[i];
      cost_model_.floor_terms(seq, bag_placement(seq, size), cache_, &terms);
    }
    const int64_t first_rank = bags.first_rank[bag];
    for (size_t k = 0; k < terms.size(); ++k) {
      const int64_t rank = first_rank + static_cast<int64_t>(k);
      floor_tokens_[rank] += terms[k].tokens;
      floor_other_s_[rank] += terms[k].added_s;
      if (terms[k].skipped_s != 0) floor_other_s_[rank] -= terms[k].skipped_s;
      if (memory_terms) floor_memory_.add(rank, terms[k]);
    }
  }
  const double floor_s = cost_model_.floor_of_totals(floor_tokens_, floor_other_s_);
  if (memory_terms) {
    *recompute_floor_s = cost_model_.recompute_floor_of_totals(floor_tokens_, floor_other_s_,
                                                               floor_memory_, floor_s);
  }
  return floor_s;
}


}  // namespace zellige::planners::zellige_detail
