// megatron-dcp: Megatron-Core's dynamic context parallelism ("default_dynamic_cp" scheduler of its
// sequence-packing data schedule, 2026), re-stated over Zellige's cost model. docs/planner.md
// describes it and where this differs; the algorithm, in our words:
//  - The knob M (Megatron's max_seqlen_per_dp_cp_rank): tokens one rank may hold in a
//    micro-batch. A sequence of L tokens needs degree max(1, 2^ceil(log2(L / M))); degrees are
//    powers of two below the GPU count N, or N itself (Megatron builds one communicator per
//    power of two and one for the whole data x context group, which may be a non-power of two).
//  - One micro-batch: sequences longest first. The longest opens a group at its needed degree on
//    ranks 0..d-1. Every later sequence tries each degree from its needed one, doubling up to N:
//    every existing group of that size whose ranks keep <= M tokens, and a new group on the next
//    free ranks; it takes the option with the lowest projected makespan of the micro-batch (the
//    first in that scan order on ties), unless that exceeds a cap of 5% over "a rank holding M
//    tokens against the longest sequence"; no option -> the sequence waits for the next
//    micro-batch. So a sequence shards beyond its needed degree only when that lowers the
//    critical path. Then empty ranks are filled: the first group of the smallest size doubles
//    (at most to N), the groups after it moving right; when no group can, the micro-batch is
//    redone as one group of all N ranks packed longest first up to M tokens per rank.
//  - Micro-batches repeat until every sequence is placed.
// Over our cost model: a sequence's work at degree d is its busiest rank's time as ring attention
// (Megatron's default p2p CP) on d consecutive ranks, instead of L^2 / d, with the per-token
// layers at the rate of a rank holding the batch's mean tokens (so that it adds up over a rank's
// sequences); a group's load is the sum of its sequences' work. Megatron leaves M to the user and runs micro-batches between
// barriers; a Zellige plan is one step, so the micro-batches' placements are united (memory adds;
// a sequence whose group has no room in the union waits for a later micro-batch) and M is chosen
// per batch, as a user tuning it would: the memory limit, and the longest sequence over 1, 2, 4,
// ... ranks until its share is below the mean rank load; the plan with the lowest rank time wins.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <utility>

#include "rank_loads.h"
#include "registry.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

constexpr double kCapSlack = 0.05;  // Megatron's workload cap: 5% over tallest x M

Placement ring_placement(int64_t sequence_id, int64_t first_rank, int64_t size) {
  std::vector<int64_t> ranks = planners::consecutive_ranks(first_rank, size);
  return size == 1 ? make_placement(sequence_id, Strategy::kLocal, std::move(ranks))
                   : make_placement(sequence_id, Strategy::kRing, std::move(ranks));
}

// The longest sequence (latent tokens, with `text_tokens` of text) one rank holds within memory.
int64_t max_tokens_per_rank(const CostModel& cost_model, int64_t text_tokens) {
  const double room_bytes = cost_model.memory_capacity_bytes() - cost_model.fixed_bytes();
  auto fits = [&](int64_t num_tokens) {
    Sequence probe;
    probe.num_tokens = num_tokens;
    probe.text_tokens = text_tokens;
    probe.grid_w = num_tokens;
    const Placement local = make_placement(0, Strategy::kLocal, {0});
    return planners::placement_memory_bytes(cost_model.shares(probe, local)) <= room_bytes;
  };
  if (!fits(1)) return 0;
  int64_t low = 1, high = 2;  // fits(low), and high is to be tested
  while (high < (int64_t{1} << 40) && fits(high)) low = high, high *= 2;
  while (high - low > 1) {
    const int64_t middle = low + (high - low) / 2;
    (fits(middle) ? low : high) = middle;
  }
  return low;
}

// Groups of one size in creation order, as a segment tree of (min load, min tokens per rank), so
// "the first group that stays under X with room for Y tokens" and "the least loaded group with
// room" take O(log groups) in the usual case.
class GroupTree {
 public:
  explicit GroupTree(int64_t capacity) {
    while (leaves_ < capacity) leaves_ *= 2;
    load_.assign(2 * leaves_, kInf);
    tokens_.assign(2 * leaves_, kInf);
  }
  int64_t size() const { return static_cast<int64_t>(groups_.size()); }
  int64_t group(int64_t leaf) const { return groups_[leaf]; }
  int64_t push(int64_t group) {
    groups_.push_back(group);
    return size() - 1;
  }
  void set(int64_t leaf, double load, double tokens) {
    int64_t node = leaf + leaves_;
    load_[node] = load, tokens_[node] = tokens;
    // Once a node's minima are unchanged, so are its ancestors'.
    for (node /= 2; node >= 1; node /= 2) {
      const double least_load = std::min(load_[2 * node], load_[2 * node + 1]);
      const double least_tokens = std::min(tokens_[2 * node], tokens_[2 * node + 1]);
      if (least_load == load_[node] && least_tokens == tokens_[node]) break;
      load_[node] = least_load, tokens_[node] = least_tokens;
    }
  }
  // The first leaf with load <= max_load and tokens <= max_tokens, or -1.
  int64_t first_fit(double max_load, double max_tokens) const {
    return first_fit(1, max_load, max_tokens);
  }
  // The first leaf of least load among those with tokens <= max_tokens, or -1.
  int64_t least_loaded(double max_tokens) const {
    int64_t best = -1;
    double best_load = kInf;
    least_loaded(1, 0, leaves_, max_tokens, &best, &best_load);
    return best;
  }

 private:
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  int64_t first_fit(int64_t node, double max_load, double max_tokens) const {
    if (load_[node] > max_load || tokens_[node] > max_tokens) return -1;
    if (node >= leaves_) return node - leaves_;
    const int64_t left = first_fit(2 * node, max_load, max_tokens);
    return left >= 0 ? left : first_fit(2 * node + 1, max_load, max_tokens);
  }
  // Branch and bound for the least (load, leaf) among leaves with tokens <= max_tokens: the child
  // of lower load first, so that the bound tightens early; a subtree is skipped when its least
  // load, or its first leaf at an equal load, cannot beat the best so far.
  void least_loaded(int64_t node, int64_t first_leaf, int64_t width, double max_tokens,
                    int64_t* best, double* best_load) const {
    if (tokens_[node] > max_tokens || load_[node] > *best_load ||
        (load_[node] == *best_load && first_leaf > *best)) {
      return;
    }
    if (node >= leaves_) {
      *best = first_leaf, *best_load = load_[node];
      return;
    }
    const int64_t half = width / 2;
    if (load_[2 * node + 1] < load_[2 * node]) {
      least_loaded(2 * node + 1, first_leaf + half, half, max_tokens, best, best_load);
      least_loaded(2 * node, first_leaf, half, max_tokens, best, best_load);
    } else {
      least_loaded(2 * node, first_leaf, half, max_tokens, best, best_load);
      least_loaded(2 * node + 1, first_leaf + half, half, max_tokens, best, best_load);
    }
  }

  int64_t leaves_ = 1;
  std::vector<double> load_, tokens_;
  std::vector<int64_t> groups_;
};

struct Group {
  int64_t size = 0;
  int64_t first_rank = 0;
  double load_s = 0;  // sum of the samples' work at this size, on every member (until the fill)
  double tokens_per_rank = 0;    // sum of L / size
  std::vector<int64_t> samples;  // batch indices, in placement order
  int64_t leaf = 0;              // in the micro-batch's tree of its size
};

class MegatronDcp {
 public:
  MegatronDcp(const Batch& batch, const CostModel& cost_model, EvaluationCache* cache)
      : batch_(batch),
        cost_model_(cost_model),
        cache_(cache != nullptr ? cache : &own_cache_),
        num_ranks_(cost_model.cluster().num_ranks()),
        gpus_per_node_(cost_model.cluster().gpus_per_node) {}

  Plan run();

 private:
  // The needed degree of sequence i under knob M (tokens), memory included.
  int64_t needed_degree(int64_t i, double max_tokens);
  // Busiest-rank time of sequence i alone as ring attention on `degree` consecutive ranks.
  double work_s(int64_t i, int64_t degree);
  // (ranks, share): a run of alike ranks (CostModel::share_runs).
  using Run = std::pair<int64_t, RankShare>;
  // Sequence i's shares as a ring of `size` consecutive ranks from `first_rank` (memoised); valid
  // until the next call.
  std::span<const Run> ring_runs(int64_t i, int64_t first_rank, int64_t size);
  int64_t memory_degree(int64_t i);
  // Degrees are powers of two or the GPU count: slot log2(degree), or one past the last power.
  size_t degree_slot(int64_t degree) const {
    assert((degree & (degree - 1)) == 0 || degree == num_ranks_);
    const int log2_degree = 63 - __builtin_clzll(static_cast<uint64_t>(degree));
    return static_cast<size_t>(log2_degree + ((degree & (degree - 1)) != 0 ? 1 : 0));
  }
  // Longest first, ties in the given order.
  void sort_by_length(std::vector<int64_t>* indices) const {
    std::stable_sort(indices->begin(), indices->end(), [&](int64_t a, int64_t b) {
      return tokens_[a] > tokens_[b];
    });
  }
  // One micro-batch over `pending` (longest first): its groups; the rest goes to `leftovers`,
  // then pending[*tail_begin...] (left to the caller, not copied: it is refused as a whole).
  std::vector<Group> micro_batch(std::span<const int64_t> pending, double max_tokens,
                                 std::vector<int64_t>* leftovers, size_t* tail_begin);
  bool fill_empty_ranks(std::vector<Group>& groups);
  // The whole schedule under knob M; nullopt when a micro-batch places nothing within memory.
  // Per sequence, the group it runs in: (first rank, size).
  using Layout = std::vector<std::pair<int64_t, int64_t>>;
  // `by_length`: every sequence, longest first (stable), the first micro-batch's order. Also
  // nullopt as soon as a rank's time is sure to end above `abort_above_s` (RankLoads'
  // time_floor_s): that schedule cannot be the best knob's.
  std::optional<Layout> schedule(double max_tokens, const std::vector<int64_t>& by_length,
                                 double abort_above_s, double* rank_time_s);

  const Batch& batch_;
  const CostModel& cost_model_;
  EvaluationCache own_cache_;  // when the caller passes none: shapes repeat across the knobs
  EvaluationCache* cache_;
  // cost_model.shares (memory degrees, single ranks; schedule's rings take ring_runs), through
  // the cache for groups of at most one node; wider rings uncached, since the cache also lists
  // every position's attention calls (same values either way).
  std::vector<RankShare> shares(const Sequence& sequence, const Placement& placement) {
    return placement.ranks.size() <= static_cast<size_t>(cost_model_.cluster().gpus_per_node)
               ? cost_model_.shares(sequence, placement, *cache_)
               : cost_model_.shares(sequence, placement);
  }
  const int64_t num_ranks_;
  const int64_t gpus_per_node_;
  // Ring shares per (lengths index, size slot, first rank's offset in its node), as runs of
  // alike positions (CostModel::share_runs): a ring's shares depend on its lengths, its size and
  // its ranks' node pattern, which the first rank's place in its node fixes. Arrays, not a hash
  // map, for the lookup per placed sequence: per (lengths index, size slot) the first of its
  // offsets' entries in ring_runs_at_ (-1: none yet); per entry, its runs' (first index, count)
  // in run_pool_ (count 0: not priced yet).
  std::vector<int32_t> ring_block_;
  std::vector<std::pair<uint32_t, uint32_t>> ring_runs_at_;
  std::vector<Run> run_pool_;
  Placement ring_probe_;  // ring_runs' scratch
  // Per sequence: its lengths' index (first appearance order) and its latent tokens, read in
  // length order: compact arrays rather than the batch's sequences or a row per sequence.
  std::vector<int32_t> length_key_;
  std::vector<double> tokens_;
  // The same per lengths index and degree slot (NaN: not looked up yet), without the map's search.
  std::vector<double> work_of_lengths_s_;
  size_t work_slots_ = 0;
  std::vector<int64_t> memory_degree_;  // per lengths index; 0: not computed yet
  // micro_batch's: per lengths index, the micro-batch (its stamp) that refused those lengths.
  std::vector<int64_t> refused_stamp_;
  int64_t micro_batch_stamp_ = 0;
  // schedule's: per lengths index, its sequences not yet placed; and how many indices have some.
  std::vector<int64_t> unplaced_;
  int64_t unplaced_keys_ = 0;
  // Per lengths index, its share alone on one rank, as one run (no ranks: not priced yet).
  std::vector<Run> local_share_;
  // The per-token layers' time per token on a rank holding the batch's mean tokens per rank:
  // alone, a short sequence runs its GEMMs at a small-batch rate it does not have once packed.
  double linear_s_per_token_ = 0;
};

double MegatronDcp::work_s(int64_t i, int64_t degree) {
  const size_t slot = static_cast<size_t>(length_key_[i]) * work_slots_ + degree_slot(degree);
  if (!std::isnan(work_of_lengths_s_[slot])) return work_of_lengths_s_[slot];
  const Sequence& sequence = batch_.sequences[i];
  if (degree == 1) {
    return work_of_lengths_s_[slot] = cost_model_.busiest_share_s(
               sequence, ring_placement(sequence.id, 0, 1), linear_s_per_token_);
  }
  // busiest_share_s of the ring on ranks 0..degree-1, from the runs schedule places it with
  // (the same shares in the same order): each ring shape is priced once for both.
  double busiest_s = 0;
  for (const auto& [count, share] : ring_runs(i, 0, degree)) {
    busiest_s = std::max(busiest_s, static_cast<double>(share.tokens) * linear_s_per_token_ +
                                        share.attention_s + share.exchange_s);
  }
  return work_of_lengths_s_[slot] = busiest_s;
}

std::span<const MegatronDcp::Run> MegatronDcp::ring_runs(int64_t i, int64_t first_rank,
                                                         int64_t size) {
  int32_t& block = ring_block_[static_cast<size_t>(length_key_[i]) * work_slots_ +
                               degree_slot(size)];
  if (block < 0) {
    block = static_cast<int32_t>(ring_runs_at_.size());
    ring_runs_at_.resize(ring_runs_at_.size() + static_cast<size_t>(gpus_per_node_), {0, 0});
  }
  std::pair<uint32_t, uint32_t>& at =
      ring_runs_at_[static_cast<size_t>(block) + static_cast<size_t>(first_rank % gpus_per_node_)];
  if (at.second == 0) {
    // ring_placement(id, first_rank, size), in a placement reused rather than allocated
    ring_probe_.sequence_id = batch_.sequences[i].id;
    ring_probe_.strategy = Strategy::kRing;
    ring_probe_.ranks.resize(size);
    std::iota(ring_probe_.ranks.begin(), ring_probe_.ranks.end(), first_rank);
    ring_probe_.ulysses_degree = 1;
    ring_probe_.ring_degree = size;
    const std::vector<Run> runs = cost_model_.share_runs(batch_.sequences[i], ring_probe_);
    at = {static_cast<uint32_t>(run_pool_.size()), static_cast<uint32_t>(runs.size())};
    run_pool_.insert(run_pool_.end(), runs.begin(), runs.end());
  }
  return {run_pool_.data() + at.first, at.second};
}

int64_t MegatronDcp::memory_degree(int64_t i) {
  int64_t& of_lengths = memory_degree_[length_key_[i]];
  if (of_lengths > 0) return of_lengths;
  const Sequence& sequence = batch_.sequences[i];
  const double room_bytes = cost_model_.memory_capacity_bytes() - cost_model_.fixed_bytes();
  int64_t degree = 1;
  while (planners::placement_memory_bytes(shares(
             sequence, ring_placement(sequence.id, 0, degree))) > room_bytes) {
    if (degree == num_ranks_) {
      throw PlanMemoryError("megatron-dcp: " + planners::describe_sequence(sequence) +
                            " does not fit in memory even as ring attention over all " +
                            std::to_string(num_ranks_) + " GPUs");
    }
    degree = std::min(degree * 2, num_ranks_);
  }
  return of_lengths = degree;
}

int64_t MegatronDcp::needed_degree(int64_t i, double max_tokens) {
  const double tokens = tokens_[i];
  int64_t degree = 1;
  while (static_cast<double>(degree) * max_tokens < tokens && degree < num_ranks_) degree *= 2;
  degree = std::max(degree, memory_degree(i));
  return std::min(degree, num_ranks_);  // beyond the largest power of two: the whole group
}

std::vector<Group> MegatronDcp::micro_batch(std::span<const int64_t> pending, double max_tokens,
                                            std::vector<int64_t>* leftovers, size_t* tail_begin) {
  *tail_begin = pending.size();
  std::vector<Group> groups;
  // By group size's slot (degree_slot): a vector, not a map, for the lookups per sequence.
  std::vector<std::optional<GroupTree>> trees(work_slots_);
  int64_t used_ranks = 0;
  double makespan_s = 0;  // of this micro-batch, in work units

  auto tree = [&](int64_t size) -> GroupTree& {
    std::optional<GroupTree>& slot = trees[degree_slot(size)];
    if (!slot) slot.emplace(num_ranks_ / size + 1);
    return *slot;
  };
  auto add = [&](int64_t g, int64_t i, double work) {
    Group& group = groups[g];
    group.load_s += work;
    group.tokens_per_rank += tokens_[i] / static_cast<double>(group.size);
    group.samples.push_back(i);
    tree(group.size).set(group.leaf, group.load_s, group.tokens_per_rank);
    makespan_s = std::max(makespan_s, group.load_s);
  };
  auto open = [&](int64_t size) {
    const int64_t g = static_cast<int64_t>(groups.size());
    groups.push_back({size, used_ranks, 0.0, 0.0, {}, 0});
    used_ranks += size;
    groups[g].leaf = tree(size).push(g);
    return g;
  };

  const int64_t tallest = pending.front();
  const int64_t first_degree = needed_degree(tallest, max_tokens);
  add(open(first_degree), tallest, work_s(tallest, first_degree));
  // Megatron's cap, tallest x M in L^2 units: the tallest's work at the (fractional) degree L / M.
  const double tallest_tokens = static_cast<double>(batch_.sequences[tallest].num_tokens);
  const double cap_s = (1.0 + kCapSlack) * work_s(tallest, first_degree) *
                       static_cast<double>(first_degree) * max_tokens / tallest_tokens;

  // A sequence that no group takes and none can open for is refused by the rest of this
  // micro-batch too, and so is every later one of its lengths (loads and the makespan only grow,
  // free ranks only shrink): those go to the leftovers unpriced, so that thousands of equal
  // sequences cost O(1) each per micro-batch (same groups).
  ++micro_batch_stamp_;
  int64_t refused_keys = 0;
  for (size_t k = 1; k < pending.size(); ++k) {
    const int64_t i = pending[k];
    if (refused_stamp_[length_key_[i]] == micro_batch_stamp_) {
      leftovers->push_back(i);
      continue;
    }
    const double tokens = tokens_[i];
    double best_s = std::numeric_limits<double>::infinity();
    int64_t best_group = -1, best_new = 0;
    for (int64_t degree = needed_degree(i, max_tokens); degree <= num_ranks_; degree *= 2) {
      const std::optional<GroupTree>& found = trees[degree_slot(degree)];
      const bool can_open = num_ranks_ - used_ranks >= degree;
      if (!found && !can_open) {  // no option of this size: skip its pricing
        if (degree == num_ranks_) break;
        continue;
      }
      const double work = work_s(i, degree);
      const double room = max_tokens - tokens / static_cast<double>(degree);
      auto consider = [&](double projected_s, int64_t group, int64_t new_size) {
        if (projected_s <= cap_s && projected_s < best_s) {
          best_s = projected_s, best_group = group, best_new = new_size;
        }
      };
      if (found) {
        const GroupTree& same = *found;
        // Adding to a group that stays under the makespan ties at the makespan: the first such
        // group wins; otherwise the least loaded one.
        int64_t leaf = same.first_fit(makespan_s - work, room);
        if (leaf < 0) leaf = same.least_loaded(room);
        if (leaf >= 0) {
          const int64_t g = same.group(leaf);
          consider(std::max(makespan_s, groups[g].load_s + work), g, 0);
        }
      }
      if (can_open) consider(std::max(makespan_s, work), -1, degree);
      if (best_s <= makespan_s) break;  // nothing later in the scan can be strictly lower
      if (degree == num_ranks_) break;
    }
    if (best_group < 0 && best_new == 0) {
      refused_stamp_[length_key_[i]] = micro_batch_stamp_;
      leftovers->push_back(i);
      // Every lengths still unplaced refused: the rest of pending is refused as a whole.
      if (++refused_keys == unplaced_keys_) {
        *tail_begin = k + 1;
        break;
      }
      continue;
    }
    const int64_t g = best_group >= 0 ? best_group : open(best_new);
    add(g, i, work_s(i, groups[g].size));
  }

  if (!fill_empty_ranks(groups)) {
    // One group of all ranks, packed longest first while every rank keeps <= M tokens.
    groups.assign(1, Group{num_ranks_, 0, 0.0, 0.0, {}, 0});
    leftovers->clear();
    *tail_begin = pending.size();
    for (int64_t i : pending) {
      const double share = static_cast<double>(batch_.sequences[i].num_tokens) /
                           static_cast<double>(num_ranks_);
      if (groups[0].tokens_per_rank + share <= max_tokens) {
        groups[0].tokens_per_rank += share;
        groups[0].samples.push_back(i);
      } else {
        leftovers->push_back(i);
      }
    }
    if (groups[0].samples.empty()) {  // Megatron asserts; place the longest anyway
      groups[0].samples.push_back(pending.front());
      leftovers->erase(leftovers->begin());
    }
  }
  return groups;
}

bool MegatronDcp::fill_empty_ranks(std::vector<Group>& groups) {
  int64_t used_ranks = 0;
  for (const Group& group : groups) used_ranks += group.size;
  // Group indices by size, each set in creation order: the first group of the smallest size is
  // the one that doubles.
  std::map<int64_t, std::set<int64_t>> by_size;
  for (size_t g = 0; g < groups.size(); ++g) by_size[groups[g].size].insert(g);
  while (used_ranks < num_ranks_) {
    if (by_size.empty()) return false;
    const auto smallest = by_size.begin();
    const int64_t grown = std::min(2 * smallest->first, num_ranks_);
    const int64_t extra = grown - smallest->first;
    if (extra > num_ranks_ - used_ranks) return false;
    const int64_t g = *smallest->second.begin();
    smallest->second.erase(smallest->second.begin());
    if (smallest->second.empty()) by_size.erase(smallest);
    // Its load at the new size is not re-priced: nothing reads a group's load after the fill,
    // and pricing ring shapes of up to every rank cost most of this planner's time at scale.
    groups[g].size = grown;
    by_size[grown].insert(g);
    used_ranks += extra;
  }
  // The groups after a grown one move right: each starts where the one before it ends.
  int64_t first_rank = 0;
  for (Group& group : groups) {
    group.first_rank = first_rank;
    first_rank += group.size;
  }
  return true;
}

std::optional<MegatronDcp::Layout> MegatronDcp::schedule(double max_tokens,
                                                         const std::vector<int64_t>& by_length,
                                                         double abort_above_s,
                                                         double* rank_time_s) {
  planners::RankLoads loads(cost_model_);  // totals only: shares() prices
  Layout layout(batch_.sequences.size());
  // Pending is buffer[begin...]: a micro-batch's leftovers are written just before the tail it
  // refused as a whole, so that the tail is not copied (thousands of equal sequences cost O(1)
  // per micro-batch, not O(pending)).
  std::vector<int64_t> buffer = by_length;
  size_t begin = 0;
  unplaced_.assign(memory_degree_.size(), 0);
  unplaced_keys_ = 0;
  for (int64_t i : buffer) unplaced_keys_ += unplaced_[length_key_[i]]++ == 0 ? 1 : 0;
  std::vector<int64_t> leftovers, refits;
  for (bool sorted = true; begin < buffer.size();) {
    if (!sorted) {
      std::stable_sort(buffer.begin() + static_cast<std::ptrdiff_t>(begin), buffer.end(),
                       [&](int64_t a, int64_t b) { return tokens_[a] > tokens_[b]; });
    }
    const std::span<const int64_t> pending(buffer.data() + begin, buffer.size() - begin);
    leftovers.clear();
    refits.clear();
    size_t tail_begin = 0;
    const std::vector<Group> groups = micro_batch(pending, max_tokens, &leftovers, &tail_begin);
    int64_t num_placed = 0;
    for (const Group& group : groups) {
      for (int64_t i : group.samples) {
        const Sequence& sequence = batch_.sequences[i];
        // Its shares as runs of alike ranks (CostModel::share_runs), from the group's first rank.
        std::span<const Run> runs;
        if (group.size == 1) {  // most sequences: the share of their lengths on one rank
          Run& local = local_share_[length_key_[i]];
          if (local.first == 0) {
            local = {1, shares(sequence, ring_placement(sequence.id, 0, 1)).front()};
          }
          runs = {&local, 1};
        } else {
          runs = ring_runs(i, group.first_rank, group.size);
        }
        bool fits = true;
        int64_t rank = group.first_rank;
        for (const auto& [count, share] : runs) {
          fits = fits && loads.fits(share, rank, count);
          rank += count;
        }
        if (!fits) {  // the union holds every micro-batch: try a later one
          refits.push_back(i);
          continue;
        }
        rank = group.first_rank;
        for (const auto& [count, share] : runs) {
          loads.add(share, rank, count);
          rank += count;
        }
        for (rank = group.first_rank; rank < group.first_rank + group.size; ++rank) {
          if (loads.time_floor_s(rank) > abort_above_s) return std::nullopt;
        }
        layout[i] = {group.first_rank, group.size};
        ++num_placed;
        if (--unplaced_[length_key_[i]] == 0) --unplaced_keys_;
      }
    }
    if (num_placed == 0) return std::nullopt;
    // The next pending: the leftovers, the tail, then the sequences that did not fit. The first
    // two keep pending's order (longest first); only the last can break it.
    const size_t tail_at = begin + tail_begin;
    assert(leftovers.size() <= tail_begin);
    begin = tail_at - leftovers.size();
    std::copy(leftovers.begin(), leftovers.end(),
              buffer.begin() + static_cast<std::ptrdiff_t>(begin));
    const size_t refits_at = buffer.size();
    buffer.insert(buffer.end(), refits.begin(), refits.end());
    const size_t check_from = std::max(begin, refits_at > 0 ? refits_at - 1 : 0);
    sorted = std::is_sorted(buffer.begin() + static_cast<std::ptrdiff_t>(check_from), buffer.end(),
                            [&](int64_t a, int64_t b) { return tokens_[a] > tokens_[b]; });
    if (begin > buffer.size() / 2) {  // drop the placed prefix once it is most of the buffer
      buffer.erase(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(begin));
      begin = 0;
    }
  }
  *rank_time_s = 0;
  for (int64_t rank = 0; rank < num_ranks_; ++rank) {
    *rank_time_s = std::max(*rank_time_s, loads.time_s(rank));
  }
  return layout;
}

Plan MegatronDcp::run() {
  const int64_t num_sequences = static_cast<int64_t>(batch_.sequences.size());
  length_key_.resize(num_sequences);
  tokens_.resize(num_sequences);
  std::map<std::pair<int64_t, int64_t>, int32_t> key_of_lengths;
  for (int64_t i = 0; i < num_sequences; ++i) {
    const Sequence& sequence = batch_.sequences[i];
    const auto [it, inserted] = key_of_lengths.try_emplace(
        {sequence.num_tokens, sequence.text_tokens}, static_cast<int32_t>(key_of_lengths.size()));
    length_key_[i] = it->second;
    tokens_[i] = static_cast<double>(sequence.num_tokens);
  }
  memory_degree_.assign(key_of_lengths.size(), 0);
  refused_stamp_.assign(key_of_lengths.size(), 0);
  local_share_.assign(key_of_lengths.size(), {0, RankShare{}});
  work_slots_ = static_cast<size_t>(63 - __builtin_clzll(static_cast<uint64_t>(num_ranks_))) + 2;
  work_of_lengths_s_.assign(key_of_lengths.size() * work_slots_,
                            std::numeric_limits<double>::quiet_NaN());
  ring_block_.assign(key_of_lengths.size() * work_slots_, -1);
  if (num_sequences == 0) return planners::empty_plan("megatron-dcp", cost_model_);
  int64_t max_text_tokens = 0, tallest = 0, total_tokens = 0;
  for (int64_t i = 0; i < num_sequences; ++i) {
    total_tokens += batch_.sequences[i].num_tokens;
    max_text_tokens = std::max(max_text_tokens, batch_.sequences[i].text_tokens);
    if (batch_.sequences[i].num_tokens > batch_.sequences[tallest].num_tokens) tallest = i;
  }
  const int64_t mean_tokens = std::max<int64_t>(1, total_tokens / num_ranks_);
  linear_s_per_token_ =
      cost_model_.linear_time_s(mean_tokens) / static_cast<double>(mean_tokens);
  const int64_t memory_tokens = max_tokens_per_rank(cost_model_, max_text_tokens);
  if (memory_tokens == 0) {
    throw PlanMemoryError("megatron-dcp: no rank has memory for even one token (" +
                          planners::format_gib(cost_model_.fixed_bytes()) + " fixed, " +
                          planners::format_gib(cost_model_.memory_capacity_bytes()) +
                          " available)");
  }
  for (int64_t i = 0; i < num_sequences; ++i) memory_degree(i);  // throws for a misfit

  // The knob M: the memory limit, then the tallest over 1, 2, 4, ... ranks while its share is
  // above the mean rank load (sharding it further cannot lower the makespan's bottleneck).
  double mean_load_s = 0;
  for (int64_t i = 0; i < num_sequences; ++i) mean_load_s += work_s(i, 1);
  mean_load_s /= static_cast<double>(num_ranks_);
  const double tallest_tokens = static_cast<double>(batch_.sequences[tallest].num_tokens);
  std::vector<double> knobs = {static_cast<double>(memory_tokens)};
  for (int64_t ranks = 1; ranks <= num_ranks_; ranks *= 2) {
    const double knob = std::ceil(tallest_tokens / static_cast<double>(ranks));
    if (knob < knobs.front()) knobs.push_back(knob);
    if (work_s(tallest, ranks) <= mean_load_s) break;
  }

  std::optional<Layout> best;
  double best_s = std::numeric_limits<double>::infinity();
  std::vector<int64_t> by_length(num_sequences);  // sorted once for every knob
  std::iota(by_length.begin(), by_length.end(), 0);
  sort_by_length(&by_length);
  // The knob of the lowest rank time wins, the first in `knobs` on a tie. They are scheduled
  // last first (sharding the tallest further usually wins) and each one stops as soon as it is
  // sure to end above the best so far, which it then cannot beat nor tie; so a knob scheduled
  // later (earlier in `knobs`) takes a tie.
  for (auto knob = knobs.rbegin(); knob != knobs.rend(); ++knob) {
    double rank_time_s = 0;
    std::optional<Layout> layout = schedule(*knob, by_length, best_s, &rank_time_s);
    if (layout && rank_time_s <= best_s) best = std::move(layout), best_s = rank_time_s;
  }
  if (!best) {
    throw PlanMemoryError("megatron-dcp: no micro-batch schedule fits in memory (" +
                          planners::format_gib(cost_model_.memory_capacity_bytes()) +
                          " per rank)");
  }
  Plan plan = planners::empty_plan("megatron-dcp", cost_model_);
  plan.placements.reserve(batch_.sequences.size());
  for (int64_t i = 0; i < num_sequences; ++i) {
    const auto [first_rank, size] = (*best)[i];
    plan.placements.push_back(ring_placement(batch_.sequences[i].id, first_rank, size));
  }
  return plan;
}

}  // namespace

Plan plan_megatron_dcp(const Batch& batch, const CostModel& cost_model) {
  return MegatronDcp(batch, cost_model, nullptr).run();
}

Plan planners::megatron_dcp(const Batch& batch, const CostModel& cost_model,
                            EvaluationCache* cache) {
  return MegatronDcp(batch, cost_model, cache).run();
}

}  // namespace zellige
