// The zellige planner: anchors first, then fillers, then local search (docs/architecture.md).
//
// One construction aims at a target makespan T. Stage 1 gives every *anchor* (a sequence whose
// local time exceeds T, that does not fit one rank, or whose attention runs enough faster in
// shorter blocks that it costs fewer rank-seconds sharded) the smallest shape (degree, strategy)
// whose busiest share meets T (at least its most efficient degree), on the least-loaded ranks of
// one node (whole nodes, then part of one, beyond a node's size), widening the shape while those
// ranks, already holding other anchors' shares, would exceed T; rank sets of different anchors may
// overlap. Stage 2 packs the *fillers* whole, longest first, onto the first rank that stays within
// T and has the memory; a filler that fits nowhere is split over a few least-loaded ranks of one
// node if that stays within T, else goes to the least-loaded rank. A sweep over T (and, when
// anchors outnumber ranks, over shapes of half the target so that anchors can share ranks) keeps
// the best construction. Local search then lowers the busiest rank while it can: move or swap a
// filler, re-mould one of its anchors (another strategy, swap a rank, add one, drop it), shard
// one of its fillers, or, failing those, move a whole anchor to an aligned window or put two
// anchors on the union of their ranks (zellige_moves.cc). Every covered baseline (planners.h) is
// built too; the (up to four) most promising ones that fit are searched the same way, and so is
// a start of aligned bags when a few long sequences dominate (zellige_moves.cc). Where the fastest
// plan so far waits at its busiest rank's launch floor, a grouped start gives each length ranks of
// its own (one call per kind on a rank), and a plan at the batch's lower bound ends the planning
// there, no baseline built (none can be faster). The result is the
// fastest of all these plans under the exact CostModel::evaluate (memoised), so never slower
// than any covered baseline; within 0.5% of the fastest, the lowest peak memory wins
// (docs/planner.md).
//
// Rank time is additive over the sequences a rank holds except the per-token layers, which depend
// on the rank's token total (CostModel::linear_time_s), so every rank keeps its totals and every
// candidate move is priced from them. Memory is charged additively (sum of shares), as
// CostModel::evaluate does. On a cluster of unlike ranks, a rank's time is its nominal time
// divided by its speed (at_speed, in refresh_time and time_with, where every rank time is made)
// and its memory is checked against its own capacity (free_bytes(rank)).
//
// Private to the planner: its state (Solution), its construction (zellige_construct.cc), the
// floors that skip baselines (zellige_bounds.cc), local search (zellige_search.cc), the
// whole-anchor moves and extra starts (zellige_moves.cc) and the driver (zellige.cc) share this
// header.
#pragma once

#include <algorithm>
#include <bit>
#include <cassert>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "node_configurations.h"
#include "rank_loads.h"
#include "registry.h"
#include "zellige/planners.h"

namespace zellige::planners::zellige_detail {

using Clock = std::chrono::steady_clock;

// How a KnapFormer bag of `size` ranks holds `seq`: whole on one rank, else Ulysses over all of
// them. Its floor terms depend only on the size, so the bag's first rank may stand at 0.
inline Placement bag_placement(const Sequence& seq, int64_t size) {
  return make_placement(seq.id, size == 1 ? Strategy::kLocal : Strategy::kUlysses,
                        planners::consecutive_ranks(0, size));
}

inline constexpr double kInf = std::numeric_limits<double>::infinity();
// Baseline plans (besides the sweep's) that start a local search of their own.
inline constexpr size_t kBaselineStarts = 4;
// The KnapFormer gamma of the covered specs (make_plan's default: covered_baselines names none).
inline constexpr double kCoveredKnapformerGamma = 0.4;
// Among plans within this fraction of the fastest, the one with the lowest peak memory wins.
inline constexpr double kMemoryTieBreak = 0.005;
// A move must lower the busiest rank by more than this fraction, so float noise cannot cycle.
inline constexpr double kMinGain = 1e-9;
// Targets of the construction sweep, as multiples of the mean local load per rank, then relative
// steps around the best one.
inline constexpr double kTargetFactors[] = {1.0, 1.005, 1.01, 1.02, 1.035, 1.05, 1.08, 1.12, 1.2};
inline constexpr int kBisectionSteps = 10;
inline constexpr double kRefineSteps[] = {0.004, 0.002, 0.001};
// Anchor shapes of at most this fraction of the target, so that two anchors can share ranks.
inline constexpr double kSharedAnchorFraction = 0.5;
// Fillers that fit nowhere whole are split over at most this many ranks.
inline constexpr int64_t kMaxSplitDegree = 4;
// How many of the least-loaded ranks local search tries as partners of the busiest rank.
inline constexpr int kMovePartners = 3;
inline constexpr int kSwapPartners = 6;
inline constexpr int kRemouldPartners = 4;
// Re-mould and relocation try at most this many anchors of the busiest rank, those with its
// largest shares: a baseline start of small sequences in Ulysses bags holds hundreds of anchors
// per rank, each priced in several shapes per step. Not fewer: a start of a few dozen rank-wide
// anchors can gain from re-moulding a small one.
inline constexpr size_t kSearchAnchors = 64;
// Up to this many ranks, least_loaded scans them: cheaper than taking a wide anchor's excluded
// ranks off the tree one by one.
inline constexpr int64_t kScanRanks = 256;
inline constexpr size_t kPromoteFillers = 2;  // longest fillers of the busiest rank tried for sharding
// Whole-anchor moves (zellige_moves.cc): windows on this many least-loaded nodes (and the anchor's
// own), this many partner anchors, and at most this many such moves per anchor of a search.
inline constexpr int kWindowNodes = 4;
inline constexpr size_t kPairPartners = 8;
inline constexpr int64_t kAnchorMovesPerAnchor = 4;
// Equal-makespan memory steps (try_lower_memory): at most this many per search, each trying the
// fillers of the fullest rank on this many ranks of least memory.
inline constexpr int64_t kMemorySteps = 16;
// The exactly priced steps (zellige_exact.cc) evaluate whole plans: each step's evaluations are
// capped at kExactEvaluations, and at kExactWork placements priced in all (a few on batches of
// thousands of sequences, whose planning time has targets of its own).
inline constexpr int64_t kExactEvaluations = 64;
inline constexpr int64_t kExactWork = 16384;
// Co-location (coalesce): rounds, ranks tried per sequence and swap partners per rank.
inline constexpr int64_t kCoalesceRounds = 16;
inline constexpr size_t kCoalesceHolders = 2;
inline constexpr int kCoalescePartners = 2;
// split_pair: plans with at most this many sharded sequences.
inline constexpr size_t kSplitAnchors = 8;
// How much slower than the fastest plan a ring variant or a split may be priced and still start
// a search (which re-balances the local sequences around it).
inline constexpr double kExactStartSlack = 0.1;
inline constexpr size_t kMemoryPartners = 4;
// Anchor degree scans (degree_for, place_anchor_within) step by one up to this many ranks, then by
// degree / kDegreeScanSteps: one rank more changes a wide anchor's share by under 1%, and pricing
// or placing every degree up to thousands made a few huge sequences on thousands of ranks cost
// O(ranks^2) placements per construction (12 videos on 4096 GPUs: 97 s).
inline constexpr int64_t kDegreeScanSteps = 64;
inline int64_t next_scanned_degree(int64_t degree) {
  return degree + std::max<int64_t>(1, degree / kDegreeScanSteps);
}
// Whole-anchor moves (try_relocate): every degree up to a node, whole nodes beyond, and beyond 16
// nodes every (degree / 16)-th node count, so an anchor over thousands of ranks tries O(log)
// windows, not one per node.
inline constexpr int64_t kWindowScanSteps = 16;
inline int64_t next_window_degree(int64_t degree, int64_t gpus_per_node) {
  if (degree < gpus_per_node) return degree + 1;
  return degree + gpus_per_node * std::max<int64_t>(1, degree / (gpus_per_node * kWindowScanSteps));
}
// The bag start (zellige_moves.cc): sequences of at least this fraction of the mean load per rank
// go to bags; only while its refinement tries at most kBagWork windows (up to ~64 GPUs).
inline constexpr double kBagItemFraction = 0.25;
inline constexpr double kBagWork = 4e6;
inline constexpr int32_t kBagRun = 4;
// The configuration start (zellige_moves.cc): only while its exact solves take at most this many
// steps (caps x nodes x run length^2: 32 GPUs and a run of 18, ~0.2 M).
inline constexpr double kConfigurationWork = 2e6;
// ... and only for a run of at least this fraction of the batch's estimated work.
inline constexpr double kConfigurationRunShare = 0.3;
// A sequence of at least this fraction of the mean load per rank is sharded without need when
// that saves at least kEfficientShapeMinGain of its rank-seconds.
inline constexpr double kEfficientShapeMinLoad = 0.1;
inline constexpr double kEfficientShapeMinGain = 0.002;
inline constexpr double kEfficientShapeTolerance = 0.003;
inline constexpr double kEfficientShapeBucket = 0.02;  // relative width of a length bucket
// Interpolation grid of the per-token layers' time during the sweep (see linear_s).
inline constexpr int kStepsPerOctaveLog2 = 7;
inline constexpr int64_t kStepsPerOctave = int64_t{1} << kStepsPerOctaveLog2;
inline constexpr int64_t kInterpolateFrom = kStepsPerOctave * 2;

struct Shape {
  Strategy strategy = Strategy::kLocal;
  int64_t degree = 1;
  int64_t ulysses_degree = 1;
};

// Every shape of `degree` ranks the engine runs: Ulysses up to the head count, ring, and hybrids.
// A hybrid's Ulysses groups may span nodes (as static-cp's do): a sequence over hundreds of ranks
// is far faster with Ulysses over all heads across five nodes and a short ring than with a ring
// of 32 over 8-rank groups, whose per-step latency dominates (12 videos on 4096 GPUs: 1.8x). The
// cost model prices the inter-node exchange, so within a node stays the choice where it is faster.
inline void shapes_of_degree(int64_t degree, int64_t num_heads, int64_t gpus_per_node,
                      std::vector<Shape>* shapes) {
  shapes->clear();
  if (degree == 1) {
    shapes->push_back({Strategy::kLocal, 1, 1});
    return;
  }
  if (degree <= num_heads) shapes->push_back({Strategy::kUlysses, degree, degree});
  for (int64_t ulysses = 2; ulysses * 2 <= degree; ++ulysses) {
    if (degree % ulysses != 0 || ulysses > num_heads) continue;
    shapes->push_back({Strategy::kHybrid, degree, ulysses});
  }
  shapes->push_back({Strategy::kRing, degree, 1});
}

inline Placement to_placement(int64_t sequence_id, const Shape& shape, std::vector<int64_t> ranks) {
  Placement placement;
  placement.sequence_id = sequence_id;
  placement.strategy = shape.strategy;
  placement.ranks = std::move(ranks);
  placement.ulysses_degree = shape.ulysses_degree;
  placement.ring_degree = shape.degree / shape.ulysses_degree;
  return placement;
}

// The best shape of one sequence at one degree, priced on canonical ranks 0..degree-1: full nodes
// then one partial node, the same node pattern as the rank sets stage 1 picks.
struct ShapeChoice {
  bool evaluated = false;
  bool feasible = false;  // some shape of this degree fits an empty rank's memory
  Shape shape;
  double time_s = kInf;        // busiest share, per-token layers at the typical per-token rate
  double rank_seconds = kInf;  // summed over the shares, likewise
  double memory_bytes = 0;     // largest share
  std::vector<RankShare> shares;
};

struct AnchorPlacement {
  int32_t sequence = -1;
  Shape shape;
  std::vector<int64_t> ranks;
  std::vector<RankShare> shares;  // in `ranks` order
};

// One (partial) plan with its per-rank totals.
struct Solution {
  std::vector<int64_t> tokens;
  std::vector<double> other_s;  // attention + exchange
  std::vector<double> memory_bytes;
  std::vector<double> time_s;
  std::vector<int32_t> filler_rank;      // per sequence index; -1 for anchors
  std::vector<int32_t> anchor_slot;      // per sequence index; -1 for fillers
  std::vector<AnchorPlacement> anchors;  // the first num_anchors are in use; the rest are kept
  int32_t num_anchors = 0;               // for their buffers
  int64_t anchor_rank_slots = 0;         // sum of stage 1's anchor degrees
  std::vector<std::vector<int32_t>> rank_fillers;  // sequence indices
  std::vector<std::vector<int32_t>> rank_anchors;  // anchor slots
  double makespan_s = kInf;

  AnchorPlacement& new_anchor() {
    if (num_anchors == static_cast<int32_t>(anchors.size())) anchors.emplace_back();
    return anchors[num_anchors++];
  }

  void reset(int64_t num_ranks, int64_t num_sequences) {
    tokens.assign(num_ranks, 0);
    other_s.assign(num_ranks, 0.0);
    memory_bytes.assign(num_ranks, 0.0);
    time_s.assign(num_ranks, 0.0);
    filler_rank.assign(num_sequences, -1);
    anchor_slot.assign(num_sequences, -1);
    num_anchors = 0;
    anchor_rank_slots = 0;
    rank_fillers.resize(num_ranks);
    rank_anchors.resize(num_ranks);
    for (auto& fillers : rank_fillers) fillers.clear();
    for (auto& slots : rank_anchors) slots.clear();
    makespan_s = kInf;
  }
};

struct PairHash {
  size_t operator()(const std::pair<int64_t, int64_t>& key) const {
    return std::hash<int64_t>()(key.first * 1000003 + key.second);
  }
};

// A min-tree over values (rank times, or a per-node key): the first index whose value is at most a
// cut (first fit) and the index of the least value, in O(log size) each. Four children per node
// (their values side by side in memory): half the levels of a binary tree, and an update climbs
// them for every filler the sweep places.
class MinTree {
 public:
  void reset(const std::vector<double>& time_s) {
    leaves_ = 1;
    while (leaves_ < static_cast<int64_t>(time_s.size())) leaves_ *= kArity;
    min_s_.assign(2 * leaves_, kInf);
    argmin_.assign(2 * leaves_, 0);
    for (int64_t leaf = 0; leaf < leaves_; ++leaf) {
      min_s_[leaves_ + leaf] = leaf < static_cast<int64_t>(time_s.size()) ? time_s[leaf] : kInf;
      argmin_[leaves_ + leaf] = leaf;
    }
    // Level k holds nodes [4^k, 2 * 4^k); the rest of [4^k, 4^(k+1)) is unused.
    for (int64_t level = leaves_ / kArity; level >= 1; level /= kArity) {
      for (int64_t node = level; node < 2 * level; ++node) take(node, least_child(node));
    }
  }
  void update(int64_t rank, double time_s) {
    int64_t node = leaves_ + rank;
    const double old_s = min_s_[node];
    if (time_s == old_s) return;  // stage 1 re-keys a node's unchanged ranks too (resort_node)
    min_s_[node] = time_s;
    if (time_s >= old_s) {
      // A value that grows changes only the ancestors whose least value was this rank's (a
      // prefix of the path up): another rank's least value stays, and its index stays the lowest
      // (had this rank tied it from a lower index before, it would have been the argmin).
      for (node /= kArity; node >= 1 && argmin_[node] == rank; node /= kArity) {
        take(node, least_child(node));
      }
      return;
    }
    // Once a node's minimum and its index are unchanged, so are its ancestors'.
    for (node /= kArity; node >= 1; node /= kArity) {
      const int64_t child = least_child(node);
      if (min_s_[child] == min_s_[node] && argmin_[child] == argmin_[node]) break;
      take(node, child);
    }
  }
  // The lowest rank >= `from` whose time is at most `cut_s`, or -1: up from the leaf of `from`
  // to the first sibling to its right holding such a rank, then down to its leftmost one.
  int64_t first_at_most(double cut_s, int64_t from = 0) const {
    if (from >= leaves_) return -1;
    int64_t node = leaves_ + from;
    if (min_s_[node] <= cut_s) return from;
    // Invariant: no rank from `from` to the end of node's range is at most the cut.
    for (;;) {
      if (node == 1) return -1;
      int64_t sibling = node + 1;
      while (sibling % kArity != 0 && min_s_[sibling] > cut_s) ++sibling;
      if (sibling % kArity != 0) {
        node = sibling;
        break;
      }
      node /= kArity;
    }
    while (node < leaves_) {
      int64_t child = kArity * node;
      while (min_s_[child] > cut_s) ++child;  // the node's least value is at most the cut
      node = child;
    }
    return node - leaves_;
  }
  // The lowest index of the least value.
  int64_t argmin() const { return argmin_[1]; }
  double value(int64_t index) const { return min_s_[leaves_ + index]; }

 private:
  static constexpr int64_t kArity = 4;
  // The child holding the node's least value, the leftmost on ties: the lowest index of the
  // least value. Which child it is is data-dependent and unpredictable: indices computed
  // without a branch (times are never NaN, so "right below left" is "not left at most right");
  // the right pair wins only below the left.
  int64_t least_child(int64_t node) const {
    const int64_t first = kArity * node;
    const int64_t left = first + (min_s_[first + 1] < min_s_[first] ? 1 : 0);
    const int64_t right = first + 2 + (min_s_[first + 3] < min_s_[first + 2] ? 1 : 0);
    return min_s_[right] < min_s_[left] ? right : left;
  }
  void take(int64_t node, int64_t child) {
    min_s_[node] = min_s_[child];
    argmin_[node] = argmin_[child];
  }

  int64_t leaves_ = 1;
  // Per node, its least value and the lowest index holding it, in two arrays so that a node's
  // four children's values share half a cache line: [1] root, [leaves_ + rank] leaves; padding
  // leaves are infinite.
  std::vector<double> min_s_;
  std::vector<int64_t> argmin_;
};

inline void erase_value(std::vector<int32_t>* values, int32_t value) {
  auto it = std::find(values->begin(), values->end(), value);
  assert(it != values->end());
  *it = values->back();
  values->pop_back();
}

class ZelligePlanner {
 public:
  ZelligePlanner(const Batch& batch, const CostModel& cost_model, const PlannerOptions& options,
                 EvaluationCache& cache)
      : batch_(batch),
        cost_model_(cost_model),
        options_(options),
        num_ranks_(cost_model.cluster().num_ranks()),
        gpus_per_node_(cost_model.cluster().gpus_per_node),
        num_nodes_(cost_model.cluster().num_nodes),
        num_heads_(cost_model.model().num_heads),
        num_sequences_(static_cast<int64_t>(batch.sequences.size())),
        cache_(cache) {}

  Plan run();
  // Local search alone from `start` (planners::zellige_search, for tests of the moves).
  Plan search_only(const Plan& start, bool whole_anchor_moves);
  // Co-location alone from `start` (planners::zellige_coalesce, for its tests).
  Plan coalesce_only(const Plan& start, int64_t* steps);
  // bags_floor alone of the covered KnapFormer baseline `spec` (planners::zellige_bags_floor).
  double bags_floor_only(const std::string& spec, Plan* plan, double* recompute_floor_s);

 private:
  // Per-token layers' time: exact in local search and final pricing; during the construction
  // sweep, interpolated between exact values at 128 points per octave (computed on first use),
  // because the cost model's table lookups (log + pow) would dominate planning time. The
  // interpolation's relative error is ~1e-6, up to ~1e-3 right at a knot of the GEMM table.
  double linear_s(int64_t tokens) const {
    if (tokens <= 0) return 0.0;
    if (exact_ || tokens < kInterpolateFrom) return exact_linear_s(tokens);
    // The hot path of the sweep, kept small: both knots known (else linear_knots_s).
    const int octave = 63 - __builtin_clzll(static_cast<uint64_t>(tokens));
    const int shift = octave - kStepsPerOctaveLog2;
    const int64_t low = tokens >> shift << shift;
    const size_t index =
        static_cast<size_t>(shift) * kStepsPerOctave + ((low >> shift) & (kStepsPerOctave - 1));
    if (index + 1 >= linear_grid_s_.size()) return linear_knots_s(tokens);
    const double low_s = linear_grid_s_[index];
    if (low_s < 0) return linear_knots_s(tokens);
    if (tokens == low) return low_s;
    const double high_s = linear_grid_s_[index + 1];
    if (high_s < 0) return linear_knots_s(tokens);
    // Times 2^-shift, exactly what dividing by 2^shift gives (both round the same real number).
    const double inverse_step = std::bit_cast<double>(static_cast<uint64_t>(1023 - shift) << 52);
    return low_s + (high_s - low_s) * static_cast<double>(tokens - low) * inverse_step;
  }
  // linear_s's interpolation with its knots computed (on first use) where they are not yet.
  [[gnu::noinline]] double linear_knots_s(int64_t tokens) const {
    const int octave = 63 - __builtin_clzll(static_cast<uint64_t>(tokens));
    const int shift = octave - kStepsPerOctaveLog2;
    const int64_t low = tokens >> shift << shift;
    const size_t index =
        static_cast<size_t>(shift) * kStepsPerOctave + ((low >> shift) & (kStepsPerOctave - 1));
    if (index + 1 >= linear_grid_s_.size()) linear_grid_s_.resize(index + 2, -1.0);
    double& low_s = linear_grid_s_[index];
    double& high_s = linear_grid_s_[index + 1];
    if (low_s < 0) low_s = cost_model_.linear_time_s(low);
    if (tokens == low) return low_s;
    if (high_s < 0) high_s = cost_model_.linear_time_s(low + (int64_t{1} << shift));
    return low_s + (high_s - low_s) * static_cast<double>(tokens - low) /
                       static_cast<double>(int64_t{1} << shift);
  }
  // cost_model_.linear_time_s, memoised: local search prices the same rank totals again and
  // again (hundreds of thousands of calls at 4096 GPUs, each a log and a pow); same values.
  // Open addressing (a power-of-two table, linear probing, at most half full): a lookup is a
  // multiply and a probe or two, where std::unordered_map divides by a prime and chases a node.
  [[gnu::noinline]] double exact_linear_s(int64_t tokens) const {
    if (exact_linear_s_.empty()) exact_linear_s_.assign(1024, {-1, 0.0});
    size_t slot = linear_memo_slot(tokens);
    if (exact_linear_s_[slot].first == tokens) return exact_linear_s_[slot].second;
    const double time_s = cost_model_.linear_time_s(tokens);
    if (2 * (exact_linear_count_ + 1) > exact_linear_s_.size()) {
      std::vector<std::pair<int64_t, double>> old(2 * exact_linear_s_.size(), {-1, 0.0});
      old.swap(exact_linear_s_);
      for (const auto& entry : old) {
        if (entry.first >= 0) exact_linear_s_[linear_memo_slot(entry.first)] = entry;
      }
      slot = linear_memo_slot(tokens);
    }
    exact_linear_s_[slot] = {tokens, time_s};
    ++exact_linear_count_;
    return time_s;
  }
  // The slot holding `tokens` in exact_linear_s_, or the empty one where it would go.
  size_t linear_memo_slot(int64_t tokens) const {
    const size_t mask = exact_linear_s_.size() - 1;
    size_t slot = static_cast<size_t>((static_cast<uint64_t>(tokens) * 0x9E3779B97F4A7C15ull) >> 40) & mask;
    while (exact_linear_s_[slot].first != tokens && exact_linear_s_[slot].first >= 0) {
      slot = (slot + 1) & mask;
    }
    return slot;
  }
  // cost_model_.shares, memoised by node pattern (wide_shares): local search prices the same
  // shapes over and over and keeps few of them, so not through the evaluation cache, whose
  // entries also price every attention call (what evaluate reads; degree^2 of them beyond a
  // node). Position k is on ranks[k]; the `rank` fields are not `ranks` (a memo's shares, not
  // copied). Valid until the next call.
  const std::vector<RankShare>& small_shares(const Sequence& sequence, const Shape& shape,
                                             const std::vector<int64_t>& ranks) {
    return wide_shares(sequence, shape, ranks);
  }
  // A wide placement's shares: those of the first placement priced with the same lengths, shape
  // and node pattern (which positions share a node: all that shares read of the ranks). The
  // placement is built only when it must be priced.
  const std::vector<RankShare>& wide_shares(const Sequence& sequence, const Shape& shape,
                                            const std::vector<int64_t>& ranks);
  // `shares` (small_shares's) with their ranks set to `ranks`, into `out`.
  static void place_shares(const std::vector<RankShare>& shares, const std::vector<int64_t>& ranks,
                           std::vector<RankShare>* out) {
    *out = shares;
    for (size_t k = 0; k < ranks.size(); ++k) (*out)[k].rank = ranks[k];
  }
  double time_with(const Solution& s, int64_t rank, int64_t delta_tokens,
                   double delta_other_s) const {
    return at_speed(rank, linear_s(s.tokens[rank] + delta_tokens) + s.other_s[rank] +
                              delta_other_s);
  }
  void refresh_time(Solution* s, int64_t rank) const {
    s->time_s[rank] = at_speed(rank, linear_s(s->tokens[rank]) + s->other_s[rank]);
    if (s == searched_) {
      least_time_.update(rank, s->time_s[rank]);
      most_time_.update(rank, -s->time_s[rank]);
    }
  }
  // Seconds of `rank` for work of `nominal_s` on the profile's device (CostModel::evaluate).
  double at_speed(int64_t rank, double nominal_s) const {
    return speeds_.empty() ? nominal_s : nominal_s / speeds_[rank];
  }
  // Memory capacity minus the fixed bytes of `rank`.
  double free_bytes(int64_t rank) const {
    return rank_free_bytes_.empty() ? free_bytes_ : rank_free_bytes_[rank];
  }
  double estimate_s(const RankShare& share) const {
    return rate_s_per_token_ * static_cast<double>(share.tokens) + share.attention_s +
           share.exchange_s;
  }
  int64_t node_of(int64_t rank) const { return rank / gpus_per_node_; }
  // Ranks ordered by node, then id: hybrid Ulysses groups (consecutive ranks) stay in a node.
  void sort_ranks(std::vector<int64_t>* ranks) const { std::sort(ranks->begin(), ranks->end()); }

  void prepare();
  // `terms_nonnegative` (optional): whether, for this mixed KnapFormer spec, every floor term
  // (per-token layers at their fastest rate) that a sequence can add to a bag's rank is >= 0.
  double floor_bound(const std::string& baseline, bool* terms_nonnegative = nullptr);
  bool knapformer_floor_above(const planners::KnapformerBags& bags, int64_t sequence,
                              double limit_s);
  bool aligned_group(int64_t size, int64_t first_rank) const;
  double bags_floor(const planners::KnapformerBags& bags, double* recompute_floor_s = nullptr);
  double group_floor_rank_seconds(int32_t sequence, int64_t group_size);
  double least_floor_share_s(int32_t sequence, int64_t size);
  const ShapeChoice& shape_at(int32_t sequence, int64_t degree);
  int64_t degree_for(int32_t sequence, double target_s);
  // Stops early, with a makespan above `stop_above_s`, once a rank's time exceeds it (a rank's
  // time only grows in stage 2: see times_only_grow).
  void construct(double target_s, double share_fraction, Solution* s,
                 double stop_above_s = kInf);
  bool times_only_grow();
  double select_anchor_ranks(int32_t sequence, int64_t degree, const Solution& s,
                             std::vector<int64_t>* ranks);
  int nodes_from_trees(int64_t full_nodes, int64_t partial, double memory_bytes,
                       int64_t* best_node);
  // Records `sequence` as an anchor of its best shape of `degree` on `ranks` (shares added).
  void add_anchor(int32_t sequence, int64_t degree, const std::vector<int64_t>& ranks, Solution* s);
  // add_anchor, then the anchor stage's per-node orders of its ranks brought up to date.
  void commit_anchor(int32_t sequence, int64_t degree, const std::vector<int64_t>& ranks,
                     Solution* s);
  bool place_anchor(int32_t sequence, int64_t degree, Solution* s);
  bool place_anchor_within(int32_t sequence, double share_s, double target_s, Solution* s);
  // `estimate_s`: the sequence's local estimate (ordered_'s copy).
  bool split_filler(int32_t sequence, double estimate_s, double target_s, Solution* s);
  void sort_split_nodes();
  void resort_node(const Solution& s, int64_t node);
  void add_filler(Solution* s, int32_t sequence, int64_t rank) const;
  // The same with the sequence's local share given (the sweep reads it from ordered_, in order,
  // rather than from the per-sequence vectors at random).
  void add_filler(Solution* s, int32_t sequence, int64_t rank, int64_t tokens, double other_s,
                  double memory_bytes) const;
  void remove_filler(Solution* s, int32_t sequence) const;
  void add_anchor_shares(Solution* s, int32_t slot) const;
  void remove_anchor_shares(Solution* s, int32_t slot) const;
  void finish(Solution* s) const;
  void import_plan(const Plan& plan, Solution* s);
  Plan to_plan(const Solution& s) const;

  int64_t local_search(Solution* s, Clock::time_point deadline);
  void least_loaded(const Solution& s, int count, const std::vector<char>* excluded,
                    std::vector<int64_t>* ranks) const;
  // `rank`'s fillers, the first of each shape key in rank order: fillers of one key price alike,
  // so in a search that keeps only a strictly better move, the later ones never win.
  const std::vector<int32_t>& fillers_by_key(const Solution& s, int64_t rank);
  bool try_move(Solution* s, int64_t busiest);
  bool try_swap(Solution* s, int64_t busiest);
  bool try_remould(Solution* s, int64_t busiest);
  // The anchor slots of `busiest` that re-mould and relocation try (kSearchAnchors), one per
  // group of alike anchors.
  const std::vector<int32_t>& searched_anchors(const Solution& s, int64_t busiest);
  bool try_promote(Solution* s, int64_t busiest);
  // zellige_moves.cc
  void least_loaded_nodes(const Solution& s, int count, std::vector<int64_t>* nodes);
  void window_nodes(const std::vector<int64_t>& least, const AnchorPlacement& anchor,
                    std::vector<int64_t>* nodes) const;
  bool try_relocate(Solution* s, int64_t busiest);
  bool try_pair(Solution* s, int64_t busiest);
  bool try_lower_memory(Solution* s);
  bool bag_start(bool busiest_only, int32_t max_run, Plan* plan);
  bool grouped_start(Plan* plan);
  // zellige_exact.cc
  // The plan with every Ulysses or hybrid placement run as a ring over its ranks, when the plan
  // exchanges over the world and memory forces full recompute somewhere (`cost`: its exact
  // price): then each rank recomputes only what its own memory needs.
  bool ring_variant(const Plan& plan, const PlanCost& cost, Plan* variant) const;
  // Two sequences sharded over overlapping ranks put each on one half of their union (what the
  // search's single-anchor moves cannot reach when either move alone overloads the other half),
  // every shape of half the degree, priced exactly: the best within kExactStartSlack of `cost`'s
  // makespan (a start for a search that then re-balances the local sequences).
  bool split_pair(const Plan& plan, const PlanCost& cost, Plan* split) const;
  // Each sharded sequence over part of some node's ranks tried over all ranks of the nodes it
  // touches (every shape of that degree), kept where the ranks' summed exact time (`cost`)
  // drops: less work in all, for a search that then re-balances the local sequences around it.
  // Returns how many were widened.
  int64_t widen(Plan* plan, PlanCost* cost) const;
  // The evaluations one exactly priced step may make (kExactEvaluations, kExactWork).
  int64_t exact_evaluations() const {
    return std::clamp<int64_t>(kExactWork / std::max<int64_t>(1, num_sequences_), 4,
                               kExactEvaluations);
  }
  // Co-location for coalescing: moves and swaps of local sequences that put one next to its
  // equal lengths on another rank (their calls merge), priced exactly, kept while the makespan
  // (then the summed rank time) drops. `cost`: the plan's exact price, updated. Returns the
  // steps kept; `undo` (optional) gets what restores the plan it started from.
  struct Undo {
    PlanCost cost;                                  // the starting plan's
    std::vector<std::pair<int32_t, int64_t>> ranks;  // sequence, its rank before (in step order)
  };
  int64_t coalesce(Plan* plan, PlanCost* cost, Undo* undo = nullptr);
  bool configuration_start(double upper_s, Plan* plan);
  // The busiest time of the ranks a change touches (infinite when one runs out of memory), exact
  // below `above_s`; once it reaches `above_s`, any value at or above it (callers keep a change
  // only when it is below their best).
  // `new_ranks` (optional): the ranks of `new_shares` by position, in place of their own.
  // The time of `rank` alone once `old_shares` are traded for `new_shares` (on `new_ranks` by
  // position), summed as price_change sums it: price_change is at least this.
  double rank_time_after(const Solution& s, int64_t rank, const std::vector<RankShare>& old_shares,
                         const std::vector<RankShare>& new_shares,
                         const std::vector<int64_t>& new_ranks) const;
  double price_change(const Solution& s, const std::vector<RankShare>& old_shares,
                      const std::vector<RankShare>& new_shares, double above_s,
                      const std::vector<int64_t>* new_ranks = nullptr);

  const Batch& batch_;
  const CostModel& cost_model_;
  const PlannerOptions& options_;
  const int64_t num_ranks_, gpus_per_node_, num_nodes_, num_heads_, num_sequences_;

  bool exact_ = true;
  // Memoised shares and exact evaluation of this batch; make_plan prices the result with it.
  EvaluationCache& cache_;
  mutable std::vector<double> linear_grid_s_;  // -1: not computed yet
  // exact_linear_s's memo: (tokens, time) per slot, tokens -1 where empty.
  mutable std::vector<std::pair<int64_t, double>> exact_linear_s_;
  mutable size_t exact_linear_count_ = 0;
  int times_only_grow_ = -1;                   // its memo: -1 not checked yet, 0 no, 1 yes
  int64_t total_tokens_ = 0;
  double rate_s_per_token_ = 0;                // per-token layers at the mean token count per rank
  // Memory capacity minus the fixed bytes: of the rank with the least (what every rank has), of
  // the one with the most, and per rank (empty: free_bytes_ on every rank).
  double free_bytes_ = 0, most_free_bytes_ = 0;
  std::vector<double> rank_free_bytes_;
  std::vector<double> speeds_;  // per rank (empty: every rank 1, the homogeneous cluster)
  double max_speed_ = 1;
  std::vector<int64_t> local_tokens_;
  std::vector<double> local_other_s_, local_memory_bytes_, local_estimate_s_;
  std::vector<int32_t> order_;             // sequence indices by local estimate, longest first
  // What the construction's two passes read of each sequence, in order_'s order: one sequential
  // array rather than a random access into each per-sequence vector (tens of thousands of them).
  struct Ordered {
    int32_t sequence = 0;
    int32_t shape_key = 0;
    int64_t tokens = 0;
    double other_s = 0, memory_bytes = 0, estimate_s = 0;
    bool efficient_whole = true;  // efficient_degree_ == 1
  };
  std::vector<Ordered> ordered_;
  std::vector<int64_t> efficient_degree_;  // fewest rank-seconds (1: whole on one rank)
  double mean_load_s_ = 0;                 // local estimates summed, per rank
  std::vector<int32_t> shape_key_;         // the first sequence of the batch with the same lengths
  std::vector<std::pair<int32_t, int64_t>> shape_key_counts_;  // each shape key, its sequences
  std::vector<std::vector<ShapeChoice>> shape_cache_;  // [shape key][degree], filled on demand

  // Scratch, reused across calls.
  std::vector<Shape> shapes_;
  std::vector<std::vector<int64_t>> node_ranks_by_time_;
  std::vector<std::pair<double, int64_t>> node_keys_;  // stage 1's scan beyond a node
  std::vector<int64_t> full_node_ids_;                 // the whole nodes it takes
  std::vector<double> popped_keys_s_;                  // nodes_from_trees: tree values set aside
  MinTree open_ranks_;                                 // stage 2: rank times
  // Local search: the solution it changes, and trees over its rank times and their negatives
  // (kept by refresh_time), so that the busiest rank and the least-loaded ones cost O(log ranks)
  // per step, not a pass over every rank.
  const Solution* searched_ = nullptr;
  mutable MinTree least_time_, most_time_;
  std::vector<double> negated_s_;
  mutable std::vector<int64_t> popped_ranks_;
  // Stage 2: the shape key of the last filler that fit none of the ranks it tried (-1: none),
  // those ranks, and the last rank its scan reached.
  int32_t failed_key_ = -1;
  // Stage 2: nodes a split looked at since their order was last set, and the rank times then.
  std::vector<char> split_pending_;
  std::vector<double> split_times_s_;
  std::vector<int64_t> failed_ranks_;
  int64_t failed_last_rank_ = -1;
  // Stage 1: per degree d, over nodes, the time of the node's d-th least-loaded rank; per node,
  // the most memory one of its ranks holds (both as of the node's last resort_node) and the
  // least free memory of its ranks (fixed).
  std::vector<MinTree> node_trees_;
  std::vector<double> node_most_bytes_, node_least_free_bytes_;
  std::vector<double> node_keys_s_;
  std::vector<int64_t> low_ranks_, candidate_ranks_, best_ranks_, touched_;
  std::vector<std::pair<double, int32_t>> partner_fillers_;
  std::vector<int32_t> fillers_by_key_;  // fillers_by_key's result
  std::vector<char> key_seen_;  // per shape key (a sequence index): all 0 between calls
  std::vector<int32_t> longest_fillers_;
  std::vector<int32_t> searched_slots_;
  std::vector<std::pair<double, int32_t>> anchor_shares_s_;
  std::vector<double> rank_seconds_;
  std::vector<char> member_;
  std::vector<int64_t> delta_tokens_;
  std::vector<double> delta_other_s_, delta_memory_bytes_;
  std::vector<RankShare> best_shares_, shares_scratch_;
  // wide_shares's memo: key (tokens, text tokens, strategy, Ulysses degree, then per run of
  // positions on one node its length and its node's first position), and how many shares it
  // holds (bounded).
  struct KeyHash {
    size_t operator()(const std::vector<int64_t>& key) const {
      uint64_t hash = 0xcbf29ce484222325ull;
      for (int64_t value : key) hash = (hash ^ static_cast<uint64_t>(value)) * 0x100000001b3ull;
      return static_cast<size_t>(hash);
    }
  };
  std::unordered_map<std::vector<int64_t>, std::vector<RankShare>, KeyHash> wide_shares_;
  int64_t wide_shares_held_ = 0;
  std::vector<int64_t> wide_key_, node_first_position_;  // node_first_position_: -1 between calls
  std::vector<int64_t> key_nodes_;  // the nodes wide_shares set in node_first_position_
  // zellige_moves.cc's scratch and budget.
  std::vector<double> node_load_s_;
  std::vector<int64_t> window_nodes_, least_nodes_;
  std::vector<int32_t> partner_slots_;
  std::vector<char> slot_seen_;  // try_pair's, per anchor slot: all 0 between calls
  // try_relocate's pricing of one anchor's windows (relocation_price): per rank, the position of
  // its share in the anchor (-1: none); the anchor's ranks by id with their time without it, and
  // the running maxima of those times from the left and from the right.
  std::vector<int32_t> old_position_;
  std::vector<std::pair<int64_t, double>> vacated_s_;
  std::vector<double> vacated_prefix_max_s_, vacated_suffix_max_s_;
  void prepare_relocation(const Solution& s, const AnchorPlacement& anchor);
  void finish_relocation(const AnchorPlacement& anchor);
  // price_change(s, anchor.shares, new_shares, above_s)'s decision for `new_shares` (canonical:
  // their ranks are not read) moved to the consecutive ranks from `first_rank`: the same value
  // below `above_s`, and a value at or above it otherwise; O(1) for the anchor's ranks outside
  // the window.
  double relocation_price(const Solution& s, const AnchorPlacement& anchor,
                          const std::vector<RankShare>& new_shares, int64_t first_rank,
                          double above_s);
  // A floor of relocation_price for any shares of `degree` ranks that each hold at least
  // `share_tokens` tokens (every shape's least share holds unit_tokens / degree): those tokens
  // and no attention on the window's ranks (the per-token layers' time grows with the tokens).
  double relocation_floor(const Solution& s, const AnchorPlacement& anchor, int64_t share_tokens,
                          int64_t first_rank, int64_t degree, double above_s) const;
  // The most loaded of the anchor's ranks outside [first_rank, end_rank) without its share.
  double vacated_outside_s(int64_t first_rank, int64_t end_rank) const;
  std::vector<RankShare> candidate_shares_, pair_old_, pair_new_, best_pair_shares_;
  int64_t relocations_left_ = 0;
  std::vector<int32_t> bag_items_;
  std::vector<int64_t> memory_ranks_;
  std::vector<double> rank_load_s_;
  bool whole_anchor_moves_ = true;
  // floor_bound's memo: per group size, per shape key, the floor's rank-seconds (NaN: not yet).
  std::unordered_map<int64_t, std::vector<double>> group_floor_s_;
  // floor_bound's sums per set of sizes: the bound without KnapFormer's terms, and per size
  // index the rank-seconds of the sequences that cannot enter smaller (up) or larger (down) bags.
  struct SizesFloor {
    double bound_s = 0;
    std::vector<double> forced_up_s, forced_down_s;
    bool shares_nonnegative = false;
  };
  std::map<std::vector<int64_t>, SizesFloor> floor_of_sizes_;
  // bags_floor's memo: per bag size, per shape key, makespan_floor's terms by position.
  std::unordered_map<int64_t, std::vector<std::vector<CostModel::FloorTerm>>> bag_floor_terms_;
  std::vector<std::vector<std::vector<CostModel::FloorTerm>>*> bag_memos_;
  std::vector<int64_t> floor_tokens_;
  std::vector<double> floor_other_s_;
  CostModel::RecomputeTotals floor_memory_;  // bags_floor's recompute floor sums
  std::unordered_map<int64_t, std::vector<double>> least_share_s_;  // least_floor_share_s's memo
  std::vector<CostModel::FloorTerm> scratch_terms_;
  std::vector<double> partial_floor_s_;  // knapformer_floor_above's per-rank sums
  planners::KnapformerWork knapformer_work_;  // covered KnapFormer's (gamma 0.4); empty: not yet
  const planners::KnapformerWork& covered_knapformer_work() {
    if (knapformer_work_.work.empty()) {
      knapformer_work_ = planners::knapformer_work(batch_, cost_model_, kCoveredKnapformerGamma);
    }
    return knapformer_work_;
  }
};

}  // namespace zellige::planners::zellige_detail
