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
// anchors on the union of their ranks (zellige_moves.h). Every covered baseline (planners.h) is
// built too; the (up to four) most promising ones that fit are searched the same way, and so is
// a start of aligned bags when a few long sequences dominate (zellige_moves.h); the result is the
// fastest of all these plans under the exact CostModel::evaluate (memoised), so never slower
// than any covered baseline; within 0.5% of the fastest, the lowest peak memory wins
// (docs/planner.md).
//
// Rank time is additive over the sequences a rank holds except the per-token layers, which depend
// on the rank's token total (CostModel::linear_time_s), so every rank keeps its totals and every
// candidate move is priced from them. Memory is charged additively (sum of shares), as
// CostModel::evaluate does.
#include <algorithm>
#include <bit>
#include <cassert>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "node_configurations.h"
#include "rank_loads.h"
#include "registry.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

using Clock = std::chrono::steady_clock;

// A number for the plan note, as "%g" prints it. No iostreams in the core: a std::ostringstream
// here died (SIGSEGV in its locale facets) in processes that had loaded torch first, on the H200
// machine's build; C stdio does not touch the C++ locale.
std::string shortest(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  return text;
}

// How a KnapFormer bag of `size` ranks holds `seq`: whole on one rank, else Ulysses over all of
// them. Its floor terms depend only on the size, so the bag's first rank may stand at 0.
Placement bag_placement(const Sequence& seq, int64_t size) {
  return make_placement(seq.id, size == 1 ? Strategy::kLocal : Strategy::kUlysses,
                        planners::consecutive_ranks(0, size));
}

constexpr double kInf = std::numeric_limits<double>::infinity();
// Baseline plans (besides the sweep's) that start a local search of their own.
constexpr size_t kBaselineStarts = 4;
// The KnapFormer gamma of the covered specs (make_plan's default: covered_baselines names none).
constexpr double kCoveredKnapformerGamma = 0.4;
// Among plans within this fraction of the fastest, the one with the lowest peak memory wins.
constexpr double kMemoryTieBreak = 0.005;
// A move must lower the busiest rank by more than this fraction, so float noise cannot cycle.
constexpr double kMinGain = 1e-9;
// Targets of the construction sweep, as multiples of the mean local load per rank, then relative
// steps around the best one.
constexpr double kTargetFactors[] = {1.0, 1.005, 1.01, 1.02, 1.035, 1.05, 1.08, 1.12, 1.2};
constexpr int kBisectionSteps = 10;
constexpr double kRefineSteps[] = {0.004, 0.002, 0.001};
// Anchor shapes of at most this fraction of the target, so that two anchors can share ranks.
constexpr double kSharedAnchorFraction = 0.5;
// Fillers that fit nowhere whole are split over at most this many ranks.
constexpr int64_t kMaxSplitDegree = 4;
// How many of the least-loaded ranks local search tries as partners of the busiest rank.
constexpr int kMovePartners = 3;
constexpr int kSwapPartners = 6;
constexpr int kRemouldPartners = 4;
constexpr size_t kPromoteFillers = 2;  // longest fillers of the busiest rank tried for sharding
// Whole-anchor moves (zellige_moves.h): windows on this many least-loaded nodes (and the anchor's
// own), this many partner anchors, and at most this many such moves per anchor of a search.
constexpr int kWindowNodes = 4;
constexpr size_t kPairPartners = 8;
constexpr int64_t kAnchorMovesPerAnchor = 4;
// Equal-makespan memory steps (try_lower_memory): at most this many per search, each trying the
// fillers of the fullest rank on this many ranks of least memory.
constexpr int64_t kMemorySteps = 16;
constexpr size_t kMemoryPartners = 4;
// Anchor degree scans (degree_for, place_anchor_within) step by one up to this many ranks, then by
// degree / kDegreeScanSteps: one rank more changes a wide anchor's share by under 1%, and pricing
// or placing every degree up to thousands made a few huge sequences on thousands of ranks cost
// O(ranks^2) placements per construction (12 videos on 4096 GPUs: 97 s).
constexpr int64_t kDegreeScanSteps = 64;
int64_t next_scanned_degree(int64_t degree) {
  return degree + std::max<int64_t>(1, degree / kDegreeScanSteps);
}
// Whole-anchor moves (try_relocate): every degree up to a node, whole nodes beyond, and beyond 16
// nodes every (degree / 16)-th node count, so an anchor over thousands of ranks tries O(log)
// windows, not one per node.
constexpr int64_t kWindowScanSteps = 16;
int64_t next_window_degree(int64_t degree, int64_t gpus_per_node) {
  if (degree < gpus_per_node) return degree + 1;
  return degree + gpus_per_node * std::max<int64_t>(1, degree / (gpus_per_node * kWindowScanSteps));
}
// The bag start (zellige_moves.h): sequences of at least this fraction of the mean load per rank
// go to bags; only while its refinement tries at most kBagWork windows (up to ~64 GPUs).
constexpr double kBagItemFraction = 0.25;
constexpr double kBagWork = 4e6;
constexpr int32_t kBagRun = 4;
// The configuration start (zellige_moves.h): only while its exact solves take at most this many
// steps (caps x nodes x run length^2: 32 GPUs and a run of 18, ~0.2 M).
constexpr double kConfigurationWork = 2e6;
// ... and only for a run of at least this fraction of the batch's estimated work.
constexpr double kConfigurationRunShare = 0.3;
// A sequence of at least this fraction of the mean load per rank is sharded without need when
// that saves at least kEfficientShapeMinGain of its rank-seconds.
constexpr double kEfficientShapeMinLoad = 0.1;
constexpr double kEfficientShapeMinGain = 0.002;
constexpr double kEfficientShapeTolerance = 0.003;
constexpr double kEfficientShapeBucket = 0.02;  // relative width of a length bucket
// Interpolation grid of the per-token layers' time during the sweep (see linear_s).
constexpr int kStepsPerOctaveLog2 = 7;
constexpr int64_t kStepsPerOctave = int64_t{1} << kStepsPerOctaveLog2;
constexpr int64_t kInterpolateFrom = kStepsPerOctave * 2;

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
void shapes_of_degree(int64_t degree, int64_t num_heads, int64_t gpus_per_node,
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

Placement to_placement(int64_t sequence_id, const Shape& shape, std::vector<int64_t> ranks) {
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

void erase_value(std::vector<int32_t>* values, int32_t value) {
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
  // cost_model_.shares, through the evaluation cache for placements of at most a node (local
  // search prices the same small shapes over and over; same values), directly for wider ones,
  // whose cache entries would list degree^2 attention calls.
  std::vector<RankShare> small_shares(const Sequence& sequence, const Placement& placement) {
    return placement.degree() <= gpus_per_node_ ? cost_model_.shares(sequence, placement, cache_)
                                                : cost_model_.shares(sequence, placement);
  }
  double time_with(const Solution& s, int64_t rank, int64_t delta_tokens,
                   double delta_other_s) const {
    return linear_s(s.tokens[rank] + delta_tokens) + s.other_s[rank] + delta_other_s;
  }
  void refresh_time(Solution* s, int64_t rank) const {
    s->time_s[rank] = linear_s(s->tokens[rank]) + s->other_s[rank];
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
  double bags_floor(const planners::KnapformerBags& bags);
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
  bool try_move(Solution* s, int64_t busiest);
  bool try_swap(Solution* s, int64_t busiest);
  bool try_remould(Solution* s, int64_t busiest);
  bool try_promote(Solution* s, int64_t busiest);
  // zellige_moves.h
  void window_nodes(const Solution& s, const AnchorPlacement& anchor, int count,
                    std::vector<int64_t>* nodes);
  bool try_relocate(Solution* s, int64_t busiest);
  bool try_pair(Solution* s, int64_t busiest);
  bool try_lower_memory(Solution* s);
  bool bag_start(bool busiest_only, int32_t max_run, Plan* plan);
  bool configuration_start(double upper_s, Plan* plan);
  // The busiest time of the ranks a change touches (infinite when one runs out of memory), exact
  // below `above_s`; once it reaches `above_s`, any value at or above it (callers keep a change
  // only when it is below their best).
  double price_change(const Solution& s, const std::vector<RankShare>& old_shares,
                      const std::vector<RankShare>& new_shares, double above_s);

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
  double free_bytes_ = 0;                      // memory capacity minus the fixed bytes, per rank
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
  MinTree open_ranks_;                                 // stage 2: rank times
  // Stage 2: the shape key of the last filler that fit none of the ranks it tried (-1: none),
  // those ranks, and the last rank its scan reached.
  int32_t failed_key_ = -1;
  // Stage 2: nodes a split looked at since their order was last set, and the rank times then.
  std::vector<char> split_pending_;
  std::vector<double> split_times_s_;
  std::vector<int64_t> failed_ranks_;
  int64_t failed_last_rank_ = -1;
  // Stage 1: per degree d, over nodes, the time of the node's d-th least-loaded rank.
  std::vector<MinTree> node_trees_;
  std::vector<double> node_keys_s_;
  std::vector<int64_t> low_ranks_, candidate_ranks_, best_ranks_, touched_;
  std::vector<std::pair<double, int32_t>> partner_fillers_;
  std::vector<int32_t> longest_fillers_;
  std::vector<double> rank_seconds_;
  std::vector<char> member_;
  std::vector<int64_t> delta_tokens_;
  std::vector<double> delta_other_s_, delta_memory_bytes_;
  std::vector<RankShare> best_shares_;
  // zellige_moves.h's scratch and budget.
  std::vector<double> node_load_s_;
  std::vector<int64_t> window_nodes_;
  std::vector<int32_t> partner_slots_;
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

void ZelligePlanner::prepare() {
  const int64_t total = total_tokens(batch_);
  total_tokens_ = total;
  const int64_t tokens_per_rank = std::max<int64_t>(1, total / num_ranks_);
  rate_s_per_token_ = linear_s(tokens_per_rank) / static_cast<double>(tokens_per_rank);
  free_bytes_ = cost_model_.memory_capacity_bytes() - cost_model_.fixed_bytes();

  local_tokens_.resize(num_sequences_);
  local_other_s_.resize(num_sequences_);
  local_memory_bytes_.resize(num_sequences_);
  local_estimate_s_.resize(num_sequences_);
  // Shares depend on the lengths only, and bucketed batches repeat them a lot.
  shape_key_.resize(num_sequences_);
  std::unordered_map<std::pair<int64_t, int64_t>, int32_t, PairHash> first_of_lengths;
  shape_key_counts_.clear();
  std::vector<int32_t> key_position(num_sequences_, -1);  // by first sequence: its count's index
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const Sequence& sequence = batch_.sequences[i];
    const auto [it, inserted] = first_of_lengths.try_emplace(
        {sequence.num_tokens, sequence.text_tokens}, static_cast<int32_t>(i));
    const int32_t first = it->second;
    shape_key_[i] = first;
    if (inserted) {
      key_position[first] = static_cast<int32_t>(shape_key_counts_.size());
      shape_key_counts_.push_back({first, 0});
    }
    ++shape_key_counts_[key_position[first]].second;
    if (!inserted) {
      local_tokens_[i] = local_tokens_[first];
      local_other_s_[i] = local_other_s_[first];
      local_memory_bytes_[i] = local_memory_bytes_[first];
      local_estimate_s_[i] = local_estimate_s_[first];
      continue;
    }
    const RankShare share =
        cost_model_.shares(sequence, to_placement(sequence.id, Shape{}, {0})).front();
    local_tokens_[i] = share.tokens;
    local_other_s_[i] = share.attention_s + share.exchange_s;
    assert(local_other_s_[i] >= 0);  // times_only_grow relies on it
    local_memory_bytes_[i] = share.memory_bytes;
    local_estimate_s_[i] = estimate_s(share);
  }
  mean_load_s_ = 0;
  for (double estimate_s : local_estimate_s_) mean_load_s_ += estimate_s;
  mean_load_s_ /= static_cast<double>(num_ranks_);
  order_.resize(num_sequences_);
  std::iota(order_.begin(), order_.end(), 0);
  std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
    return local_estimate_s_[a] > local_estimate_s_[b];
  });
  shape_cache_.assign(num_sequences_, {});
  node_ranks_by_time_.assign(num_nodes_, std::vector<int64_t>(gpus_per_node_));
  member_.assign(num_ranks_, 0);
  delta_tokens_.assign(num_ranks_, 0);
  delta_other_s_.assign(num_ranks_, 0.0);
  delta_memory_bytes_.assign(num_ranks_, 0.0);

  // Attention can run faster in shorter blocks, so a long sequence may cost fewer rank-seconds
  // sharded than whole: its most efficient degree (within a node) makes it an anchor. The degree
  // changes slowly with the length, so lengths within kEfficientShapeBucket share one answer.
  efficient_degree_.assign(num_sequences_, 1);
  std::unordered_map<int64_t, int64_t> degree_of_bucket;
  const int64_t max_degree = std::min(gpus_per_node_, num_ranks_);
  for (int64_t i = 0; i < num_sequences_; ++i) {
    if (local_estimate_s_[i] < kEfficientShapeMinLoad * mean_load_s_) continue;
    const Sequence& sequence = batch_.sequences[i];
    const int64_t bucket = static_cast<int64_t>(
        std::log(static_cast<double>(sequence.num_tokens + sequence.text_tokens)) /
        std::log1p(kEfficientShapeBucket));
    const auto [it, inserted] = degree_of_bucket.try_emplace(bucket, 1);
    if (inserted) {
      // Rank-seconds per degree until two in a row do not improve; then the smallest degree
      // within kEfficientShapeTolerance of the best (fewer ranks: fewer overlaps, exchanges).
      rank_seconds_.assign(1, local_estimate_s_[i]);
      double best_s = local_estimate_s_[i];
      int misses = 0;
      for (int64_t degree = 2; degree <= max_degree && misses < 2; ++degree) {
        const ShapeChoice& choice = shape_at(static_cast<int32_t>(i), degree);
        rank_seconds_.push_back(choice.feasible ? choice.rank_seconds : kInf);
        misses = rank_seconds_.back() < best_s ? 0 : misses + 1;
        best_s = std::min(best_s, rank_seconds_.back());
      }
      if (best_s < local_estimate_s_[i] * (1 - kEfficientShapeMinGain)) {
        int64_t degree = 1;
        while (rank_seconds_[degree - 1] > best_s * (1 + kEfficientShapeTolerance)) ++degree;
        it->second = degree;
      }
    }
    efficient_degree_[i] = it->second;
  }
  ordered_.resize(num_sequences_);
  for (int64_t k = 0; k < num_sequences_; ++k) {
    const int32_t i = order_[k];
    ordered_[k] = {i, shape_key_[i], local_tokens_[i], local_other_s_[i], local_memory_bytes_[i],
                   local_estimate_s_[i], efficient_degree_[i] == 1};
  }
}

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
  // Summed in another order than makespan_floor's: keep clear of rounding.
  return bound_s * (1 - 1e-9);
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
    double& sum_s = partial_floor_s_[bags.first_rank[bag] + static_cast<int64_t>(k)];
    sum_s += rate_s * static_cast<double>(terms[k].tokens) + terms[k].added_s - terms[k].skipped_s;
    // Summed in another order than makespan_floor's: keep clear of rounding.
    above = above || sum_s * (1 - 1e-9) > limit_s;
  }
  return above;
}

// Whether `size` consecutive ranks from `first_rank` have the node pattern of ranks 0..size-1.
bool ZelligePlanner::aligned_group(int64_t size, int64_t first_rank) const {
  if (size <= gpus_per_node_) return gpus_per_node_ % size == 0 && first_rank % size == 0;
  return size % gpus_per_node_ == 0 && first_rank % gpus_per_node_ == 0;
}

// makespan_floor of knapformer_plan(bags), bit for bit (the same terms added to the same ranks in
// the same order), without building the plan; -1 when a bag is not node-aligned.
double ZelligePlanner::bags_floor(const planners::KnapformerBags& bags) {
  for (size_t b = 0; b < bags.size.size(); ++b) {
    if (!aligned_group(bags.size[b], bags.first_rank[b])) return -1;
  }
  floor_tokens_.assign(num_ranks_, 0);
  floor_other_s_.assign(num_ranks_, 0.0);
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
    }
  }
  return cost_model_.floor_of_totals(floor_tokens_, floor_other_s_);
}

const ShapeChoice& ZelligePlanner::shape_at(int32_t sequence, int64_t degree) {
  std::vector<ShapeChoice>& cache = shape_cache_[shape_key_[sequence]];
  if (static_cast<int64_t>(cache.size()) <= degree) cache.resize(degree + 1);
  ShapeChoice& choice = cache[degree];
  if (choice.evaluated) return choice;
  choice.evaluated = true;
  const Sequence& seq = batch_.sequences[sequence];
  std::vector<int64_t> ranks(degree);
  std::iota(ranks.begin(), ranks.end(), 0);
  shapes_of_degree(degree, num_heads_, gpus_per_node_, &shapes_);
  for (const Shape& shape : shapes_) {
    std::vector<RankShare> shares = cost_model_.shares(seq, to_placement(seq.id, shape, ranks));
    double time_s = 0, memory_bytes = 0, rank_seconds = 0;
    for (const RankShare& share : shares) {
      time_s = std::max(time_s, estimate_s(share));
      memory_bytes = std::max(memory_bytes, share.memory_bytes);
      rank_seconds += estimate_s(share);
    }
    if (memory_bytes > free_bytes_ || time_s >= choice.time_s) continue;
    choice.feasible = true;
    choice.shape = shape;
    choice.time_s = time_s;
    choice.rank_seconds = rank_seconds;
    choice.memory_bytes = memory_bytes;
    choice.shares = std::move(shares);
  }
  return choice;
}

// The smallest degree whose best shape meets the target; failing that, the fastest degree seen
// before the busiest share stops improving. 0 when no shape fits memory.
int64_t ZelligePlanner::degree_for(int32_t sequence, double target_s) {
  int64_t first = 2;
  if (std::isfinite(target_s) && target_s > 0) {
    first = std::max<int64_t>(
        2, static_cast<int64_t>(std::ceil(local_estimate_s_[sequence] / target_s)));
  }
  first = std::min(first, num_ranks_);
  int64_t best_degree = 0;
  double best_time_s = kInf;
  int misses = 0;
  for (int64_t degree = first; degree <= num_ranks_; degree = next_scanned_degree(degree)) {
    const ShapeChoice& choice = shape_at(sequence, degree);
    if (!choice.feasible) continue;
    if (choice.time_s <= target_s) return degree;
    if (choice.time_s < best_time_s) {
      best_time_s = choice.time_s;
      best_degree = degree;
      misses = 0;
    } else if (++misses >= 3) {
      break;
    }
  }
  return best_degree;
}

void ZelligePlanner::resort_node(const Solution& s, int64_t node) {
  std::vector<int64_t>& ranks = node_ranks_by_time_[node];
  // Insertion sort: a node has few ranks and only a few of them changed.
  for (size_t i = 1; i < ranks.size(); ++i) {
    const int64_t rank = ranks[i];
    size_t j = i;
    while (j > 0 && s.time_s[ranks[j - 1]] > s.time_s[rank]) {
      ranks[j] = ranks[j - 1];
      --j;
    }
    ranks[j] = rank;
  }
  for (int64_t d = 1; d <= gpus_per_node_; ++d) {
    node_trees_[d - 1].update(node, s.time_s[ranks[d - 1]]);
  }
}

// The `degree` least-loaded ranks of one node (beyond a node: the least loaded whole nodes, then
// the least-loaded ranks of one more node) that have the memory for the best shape of that
// degree. Returns the busiest of them after taking their shares (estimated), or infinity.
double ZelligePlanner::select_anchor_ranks(int32_t sequence, int64_t degree, const Solution& s,
                                           std::vector<int64_t>* ranks) {
  const ShapeChoice& choice = shape_at(sequence, degree);
  if (!choice.feasible) return kInf;
  const double memory_bytes = choice.memory_bytes;
  auto take_from_node = [&](int64_t node, int64_t count, std::vector<int64_t>* taken_ranks) {
    double last_time_s = 0;
    int64_t taken = 0;
    for (int64_t rank : node_ranks_by_time_[node]) {
      if (taken == count) break;
      if (s.memory_bytes[rank] + memory_bytes > free_bytes_) continue;
      if (taken_ranks) taken_ranks->push_back(rank);
      last_time_s = s.time_s[rank];
      ++taken;
    }
    return taken == count ? last_time_s : kInf;
  };

  auto busiest_after = [&] {
    double busiest_s = 0;
    for (size_t k = 0; k < ranks->size(); ++k) {
      busiest_s = std::max(busiest_s, s.time_s[(*ranks)[k]] + estimate_s(choice.shares[k]));
    }
    return busiest_s;
  };
  if (degree <= gpus_per_node_) {
    // The node whose degree-th least-loaded rank is least loaded; scan below if it lacks memory.
    ranks->clear();
    if (take_from_node(node_trees_[degree - 1].argmin(), degree, ranks) < kInf) {
      std::sort(ranks->begin(), ranks->end());
      return busiest_after();
    }
  }
  const int64_t full_nodes = degree / gpus_per_node_;
  const int64_t partial = degree % gpus_per_node_;
  if (full_nodes > num_nodes_) return kInf;
  ranks->clear();
  node_keys_.clear();
  for (int64_t node = 0; node < num_nodes_; ++node) {
    node_keys_.push_back({full_nodes > 0 ? take_from_node(node, gpus_per_node_, nullptr)
                                         : take_from_node(node, partial, nullptr),
                          node});
  }
  if (full_nodes > 0) {
    // The full_nodes least (time, node) keys, in any order: ranks are sorted below, and the
    // partial node's choice (least time, then node) does not depend on the order of the rest.
    std::nth_element(node_keys_.begin(), node_keys_.begin() + (full_nodes - 1), node_keys_.end());
    if (node_keys_[full_nodes - 1].first == kInf) return kInf;
    // Each of them has every rank within memory (a finite key): whole nodes, in node order.
    full_node_ids_.clear();
    for (int64_t k = 0; k < full_nodes; ++k) full_node_ids_.push_back(node_keys_[k].second);
    std::sort(full_node_ids_.begin(), full_node_ids_.end());
    for (int64_t node : full_node_ids_) {
      for (int64_t rank = node * gpus_per_node_; rank < (node + 1) * gpus_per_node_; ++rank) {
        ranks->push_back(rank);
      }
    }
  }
  if (partial > 0) {
    int64_t best_node = -1;
    double best_time_s = kInf;
    for (size_t k = full_nodes; k < node_keys_.size(); ++k) {
      const int64_t node = node_keys_[k].second;
      const double time_s =
          full_nodes > 0 ? take_from_node(node, partial, nullptr) : node_keys_[k].first;
      if (time_s < best_time_s || (time_s == best_time_s && node < best_node)) {
        best_time_s = time_s;
        best_node = node;
      }
    }
    if (best_node < 0) return kInf;
    const size_t partial_begin = ranks->size();
    take_from_node(best_node, partial, ranks);
    std::sort(ranks->begin() + partial_begin, ranks->end());
  }
  // Full nodes in node order, each in rank order (above), the partial node last: the canonical
  // pattern.
  return busiest_after();
}

void ZelligePlanner::add_anchor(int32_t sequence, int64_t degree, const std::vector<int64_t>& ranks,
                                Solution* s) {
  const ShapeChoice& choice = shape_at(sequence, degree);
  const int32_t slot = s->num_anchors;
  AnchorPlacement& anchor = s->new_anchor();
  anchor.sequence = sequence;
  anchor.shape = choice.shape;
  anchor.ranks = ranks;
  anchor.shares = choice.shares;
  for (size_t k = 0; k < anchor.ranks.size(); ++k) anchor.shares[k].rank = anchor.ranks[k];
  s->anchor_slot[sequence] = slot;
  add_anchor_shares(s, slot);
}

void ZelligePlanner::commit_anchor(int32_t sequence, int64_t degree,
                                   const std::vector<int64_t>& ranks, Solution* s) {
  add_anchor(sequence, degree, ranks, s);
  const AnchorPlacement& anchor = s->anchors[s->anchor_slot[sequence]];
  for (size_t k = 0; k < anchor.ranks.size(); ++k) {
    if (k == 0 || node_of(anchor.ranks[k]) != node_of(anchor.ranks[k - 1])) {
      resort_node(*s, node_of(anchor.ranks[k]));
    }
  }
}

bool ZelligePlanner::place_anchor(int32_t sequence, int64_t degree, Solution* s) {
  if (select_anchor_ranks(sequence, degree, *s, &candidate_ranks_) == kInf) return false;
  commit_anchor(sequence, degree, candidate_ranks_, s);
  return true;
}

// Stage 1 for one anchor: from the smallest degree whose shape meets `share_s` alone, the first
// degree whose ranks still meet the target with the anchors already placed (else the best seen).
bool ZelligePlanner::place_anchor_within(int32_t sequence, double share_s, double target_s,
                                         Solution* s) {
  const int64_t smallest = degree_for(sequence, share_s);
  if (smallest == 0) return false;
  const int64_t first = std::max(smallest, efficient_degree_[sequence]);
  const int64_t last = std::min(num_ranks_, 2 * first + 2);
  int64_t best_degree = 0;
  double best_s = kInf;
  for (int64_t degree = first; degree <= last; degree = next_scanned_degree(degree)) {
    const double busiest_s = select_anchor_ranks(sequence, degree, *s, &candidate_ranks_);
    if (busiest_s == kInf) continue;  // no ranks with the memory (the target may be infinite)
    if (busiest_s <= target_s) {
      commit_anchor(sequence, degree, candidate_ranks_, s);
      return true;
    }
    if (busiest_s < best_s) {
      best_s = busiest_s;
      best_degree = degree;
      best_ranks_ = candidate_ranks_;
    }
  }
  if (best_degree == 0) return false;
  commit_anchor(sequence, best_degree, best_ranks_, s);
  return true;
}

void ZelligePlanner::add_filler(Solution* s, int32_t sequence, int64_t rank) const {
  add_filler(s, sequence, rank, local_tokens_[sequence], local_other_s_[sequence],
             local_memory_bytes_[sequence]);
}

void ZelligePlanner::add_filler(Solution* s, int32_t sequence, int64_t rank, int64_t tokens,
                                double other_s, double memory_bytes) const {
  s->filler_rank[sequence] = static_cast<int32_t>(rank);
  s->rank_fillers[rank].push_back(sequence);
  s->tokens[rank] += tokens;
  s->other_s[rank] += other_s;
  s->memory_bytes[rank] += memory_bytes;
  refresh_time(s, rank);
}

void ZelligePlanner::remove_filler(Solution* s, int32_t sequence) const {
  const int64_t rank = s->filler_rank[sequence];
  erase_value(&s->rank_fillers[rank], sequence);
  s->filler_rank[sequence] = -1;
  s->tokens[rank] -= local_tokens_[sequence];
  s->other_s[rank] -= local_other_s_[sequence];
  s->memory_bytes[rank] -= local_memory_bytes_[sequence];
  refresh_time(s, rank);
}

void ZelligePlanner::add_anchor_shares(Solution* s, int32_t slot) const {
  for (const RankShare& share : s->anchors[slot].shares) {
    assert(share.attention_s + share.exchange_s >= 0);  // times_only_grow relies on it
    s->tokens[share.rank] += share.tokens;
    s->other_s[share.rank] += share.attention_s + share.exchange_s;
    s->memory_bytes[share.rank] += share.memory_bytes;
    s->rank_anchors[share.rank].push_back(slot);
    refresh_time(s, share.rank);
  }
}

void ZelligePlanner::remove_anchor_shares(Solution* s, int32_t slot) const {
  for (const RankShare& share : s->anchors[slot].shares) {
    s->tokens[share.rank] -= share.tokens;
    s->other_s[share.rank] -= share.attention_s + share.exchange_s;
    s->memory_bytes[share.rank] -= share.memory_bytes;
    erase_value(&s->rank_anchors[share.rank], slot);
    refresh_time(s, share.rank);
  }
}

void ZelligePlanner::finish(Solution* s) const {
  s->makespan_s = 0;
  for (int64_t rank = 0; rank < num_ranks_; ++rank) {
    refresh_time(s, rank);  // re-summed totals drift by float rounding only
    s->makespan_s = std::max(s->makespan_s, s->time_s[rank]);
  }
}

// Another planner's plan as a Solution: single-rank placements become fillers, the rest anchors.
void ZelligePlanner::import_plan(const Plan& plan, Solution* s) {
  s->reset(num_ranks_, num_sequences_);
  std::unordered_map<int64_t, int32_t> index_of;
  for (int64_t i = 0; i < num_sequences_; ++i) {
    index_of[batch_.sequences[i].id] = static_cast<int32_t>(i);
  }
  for (const Placement& placement : plan.placements) {
    const int32_t sequence = index_of.at(placement.sequence_id);
    if (placement.degree() == 1) {
      add_filler(s, sequence, placement.ranks[0]);
      continue;
    }
    const int32_t slot = s->num_anchors;
    AnchorPlacement& anchor = s->new_anchor();
    anchor.sequence = sequence;
    anchor.shape = {placement.strategy, placement.degree(), placement.ulysses_degree};
    anchor.ranks = placement.ranks;
    anchor.shares = cost_model_.shares(batch_.sequences[sequence], placement, cache_);
    s->anchor_slot[sequence] = slot;
    add_anchor_shares(s, slot);
  }
  finish(s);
  // A plan that overflows a rank's memory is no start for the search (knapformer ignores memory).
  for (int64_t rank = 0; rank < num_ranks_; ++rank) {
    if (s->memory_bytes[rank] > free_bytes_) s->makespan_s = kInf;
  }
}

// One plan aiming at makespan `target_s`; each anchor's shape alone must fit `share_fraction` of
// the target (a half lets two anchors share ranks).
void ZelligePlanner::construct(double target_s, double share_fraction, Solution* s,
                               double stop_above_s) {
  s->reset(num_ranks_, num_sequences_);
  for (int64_t node = 0; node < num_nodes_; ++node) {
    std::iota(node_ranks_by_time_[node].begin(), node_ranks_by_time_[node].end(),
              node * gpus_per_node_);
  }
  node_keys_s_.assign(num_nodes_, 0.0);
  split_pending_.assign(num_nodes_, 0);
  split_times_s_.resize(num_ranks_);
  node_trees_.resize(gpus_per_node_);
  for (MinTree& tree : node_trees_) tree.reset(node_keys_s_);
  auto place_by_degree = [&](int32_t sequence, int64_t degree) {
    for (; degree >= 1 && degree <= num_ranks_; ++degree) {
      if (place_anchor(sequence, degree, s)) return;
    }
    double total_bytes = 0;
    for (int64_t i = 0; i < num_sequences_; ++i) total_bytes += local_memory_bytes_[i];
    throw PlanMemoryError(
        "sequence " + std::to_string(batch_.sequences[sequence].id) +
        " fits in memory on none of the ranks left to it (the batch's activations need " +
        std::to_string(total_bytes / num_ranks_ / (1 << 30)) + " GiB per rank on average, " +
        std::to_string(free_bytes_ / (1 << 30)) + " GiB are free per rank)");
  };

  // Stage 1: anchors, longest first.
  for (const Ordered& item : ordered_) {
    if (item.memory_bytes <= free_bytes_ && item.estimate_s <= target_s && item.efficient_whole) {
      continue;
    }
    const int32_t sequence = item.sequence;
    if (!place_anchor_within(sequence, share_fraction * target_s, target_s, s)) {
      place_by_degree(sequence, 2);
    }
    s->anchor_rank_slots += s->anchors[s->anchor_slot[sequence]].shape.degree;
  }

  // Stage 2: fillers, longest first. First fit under the target: the lowest rank that stays
  // within it. A filler that fits nowhere is split over the least-loaded ranks if that meets the
  // target, else goes whole to the least-loaded rank with the memory (LPT).
  open_ranks_.reset(s->time_s);
  failed_key_ = -1;
  for (const Ordered& item : ordered_) {
    const int32_t sequence = item.sequence;
    if (s->anchor_slot[sequence] >= 0) continue;
    const int64_t tokens = item.tokens;
    const double other_s = item.other_s;
    const double bytes = item.memory_bytes;
    int64_t chosen = -1;
    if (std::isfinite(target_s)) {
      // Estimates use the mean per-token rate; a few ranks below the cut are priced exactly.
      const double cut_s = target_s - 0.98 * item.estimate_s;
      int64_t rank = -1;
      int tries = 0;
      // Ranks only get busier in stage 2: those where the previous filler of these lengths failed
      // still fail, or are now above the cut; only the scan past them is left to do.
      if (failed_key_ == item.shape_key && times_only_grow()) {
        size_t kept = 0;
        for (int64_t failed : failed_ranks_) {
          if (s->time_s[failed] <= cut_s) failed_ranks_[kept++] = failed;
        }
        failed_ranks_.resize(kept);
        tries = static_cast<int>(kept);
        rank = failed_last_rank_;
      } else {
        failed_ranks_.clear();
        failed_last_rank_ = -1;
      }
      for (; tries < 8; ++tries) {
        rank = open_ranks_.first_at_most(cut_s, rank + 1);
        if (rank < 0) break;
        if (s->memory_bytes[rank] + bytes <= free_bytes_ &&
            time_with(*s, rank, tokens, other_s) <= target_s) {
          chosen = rank;
          break;
        }
        failed_ranks_.push_back(rank);
        failed_last_rank_ = rank;
      }
      failed_key_ = chosen < 0 ? item.shape_key : -1;
      if (chosen < 0 && split_filler(sequence, item.estimate_s, target_s, s)) continue;
    }
    if (chosen < 0) {
      chosen = open_ranks_.argmin();
      if (s->memory_bytes[chosen] + bytes > free_bytes_) {
        // Rare: the least-loaded rank is out of memory; scan for the least loaded that is not.
        chosen = -1;
        for (int64_t rank = 0; rank < num_ranks_; ++rank) {
          if (s->memory_bytes[rank] + bytes <= free_bytes_ &&
              (chosen < 0 || s->time_s[rank] < s->time_s[chosen])) {
            chosen = rank;
          }
        }
      }
    }
    if (chosen < 0) {
      // No rank has the memory left for it whole: shard it like an anchor.
      sort_split_nodes();
      for (int64_t node = 0; node < num_nodes_; ++node) resort_node(*s, node);
      place_by_degree(sequence, 2);
      open_ranks_.reset(s->time_s);
      continue;
    }
    add_filler(s, sequence, chosen, tokens, other_s, bytes);
    open_ranks_.update(chosen, s->time_s[chosen]);
    if (s->time_s[chosen] > stop_above_s && times_only_grow()) {
      s->makespan_s = s->time_s[chosen];  // a lower bound of the finished construction's
      return;
    }
  }
  finish(s);
}

// Whether, in the sweep, a rank's time linear_s(tokens) + other_s can only grow as it takes more
// shares (so a construction may stop once a rank is too slow): shares add non-negative attention
// and exchange time (the cost model's terms), and linear_s must not decrease up to the batch's
// total tokens. Checked once on its exact values below kInterpolateFrom and on the knots above
// (it is linear between knots).
bool ZelligePlanner::times_only_grow() {
  if (exact_) return false;
  if (times_only_grow_ < 0) {
    times_only_grow_ = 1;
    double previous_s = 0;
    for (int64_t tokens = 1;;) {
      const double time_s = linear_s(tokens);
      if (time_s < previous_s) {
        times_only_grow_ = 0;
        break;
      }
      previous_s = time_s;
      if (tokens >= total_tokens_) break;  // the first knot at or above the total is the last
      const int octave = 63 - __builtin_clzll(static_cast<uint64_t>(tokens));
      tokens += tokens < kInterpolateFrom ? 1 : int64_t{1} << (octave - kStepsPerOctaveLog2);
    }
  }
  return times_only_grow_ == 1;
}

// A filler that fits whole on no rank under the target, sharded over 2..kMaxSplitDegree of the
// least-loaded ranks of the node that holds the least-loaded rank (smallest degree first), when
// its busiest share then stays within the target.
bool ZelligePlanner::split_filler(int32_t sequence, double estimate_s, double target_s,
                                  Solution* s) {
  const int64_t max_degree = std::min(kMaxSplitDegree, gpus_per_node_);
  if (max_degree < 2) return false;
  const int64_t least_loaded_rank = open_ranks_.argmin();
  const int64_t node = node_of(least_loaded_rank);
  // The node's max_degree least-loaded ranks by (time, id). Its whole order, which stage 1's
  // rank picking reads, is needed again only if a filler must then be placed like an anchor:
  // sort_split_nodes sorts it there, by the times of now.
  const int64_t first = node * gpus_per_node_;
  std::copy(s->time_s.begin() + first, s->time_s.begin() + first + gpus_per_node_,
            split_times_s_.begin() + first);
  split_pending_[node] = 1;
  // Every degree's test below fails when even the least-loaded rank with the widest degree's
  // least share exceeds the target (its d-th rank is no less loaded, its share no smaller).
  if (s->time_s[least_loaded_rank] +
          0.95 * estimate_s / static_cast<double>(max_degree) >
      target_s) {
    return false;
  }
  int64_t node_ranks[kMaxSplitDegree];
  double node_times_s[kMaxSplitDegree];  // their times, kept alongside
  int64_t count = 0;
  for (int64_t rank = first; rank < first + gpus_per_node_; ++rank) {
    const double time_s = s->time_s[rank];
    if (count == max_degree && time_s >= node_times_s[count - 1]) continue;
    int64_t at = count < max_degree ? count++ : count - 1;
    for (; at > 0 && node_times_s[at - 1] > time_s; --at) {
      node_ranks[at] = node_ranks[at - 1];
      node_times_s[at] = node_times_s[at - 1];
    }
    node_ranks[at] = rank;
    node_times_s[at] = time_s;
  }
  for (int64_t degree = 2; degree <= max_degree; ++degree) {
    // A share is at least about 1/degree of the whole: skip pricing shapes that cannot fit.
    const double least_share_s = 0.95 * estimate_s / static_cast<double>(degree);
    if (node_times_s[degree - 1] + least_share_s > target_s) continue;
    const ShapeChoice& choice = shape_at(sequence, degree);
    if (!choice.feasible) continue;
    candidate_ranks_.assign(node_ranks, node_ranks + degree);
    sort_ranks(&candidate_ranks_);
    // Inside one node the canonical shares hold for any ranks: links differ by node only.
    bool within = true;
    for (int64_t k = 0; k < degree && within; ++k) {
      const RankShare& share = choice.shares[k];
      const int64_t rank = candidate_ranks_[k];
      within = s->memory_bytes[rank] + share.memory_bytes <= free_bytes_ &&
               time_with(*s, rank, share.tokens, share.attention_s + share.exchange_s) <= target_s;
    }
    if (!within) continue;
    add_anchor(sequence, degree, candidate_ranks_, s);
    for (int64_t rank : candidate_ranks_) open_ranks_.update(rank, s->time_s[rank]);
    return true;
  }
  return false;
}

// The order of every node split_filler looked at: by the times of then, then id.
void ZelligePlanner::sort_split_nodes() {
  for (int64_t node = 0; node < num_nodes_; ++node) {
    if (!split_pending_[node]) continue;
    split_pending_[node] = 0;
    std::vector<int64_t>& ranks = node_ranks_by_time_[node];
    std::iota(ranks.begin(), ranks.end(), node * gpus_per_node_);
    std::sort(ranks.begin(), ranks.end(), [&](int64_t a, int64_t b) {
      return split_times_s_[a] < split_times_s_[b] || (split_times_s_[a] == split_times_s_[b] && a < b);
    });
  }
}

// The `count` least-loaded ranks (by time, then id), skipping ranks marked in `excluded`.
void ZelligePlanner::least_loaded(const Solution& s, int count, const std::vector<char>* excluded,
                                  std::vector<int64_t>* ranks) const {
  ranks->clear();
  // Once `count` ranks are kept, a rank is a candidate only below the last kept one's time: most
  // ranks fail that first test, which is all they cost.
  bool full = false;
  double last_kept_s = 0;
  const double* time_s = s.time_s.data();
  for (int64_t rank = 0; rank < num_ranks_; ++rank) {
    if (full && time_s[rank] >= last_kept_s) continue;
    if (excluded && (*excluded)[rank]) continue;
    if (full) ranks->pop_back();
    auto at = ranks->end();
    while (at != ranks->begin() && time_s[*(at - 1)] > time_s[rank]) --at;
    ranks->insert(at, rank);
    full = static_cast<int>(ranks->size()) == count;
    if (full) last_kept_s = time_s[ranks->back()];
  }
}

bool ZelligePlanner::try_move(Solution* s, int64_t busiest) {
  member_[busiest] = 1;
  least_loaded(*s, kMovePartners, &member_, &low_ranks_);
  member_[busiest] = 0;
  const double bound_s = s->time_s[busiest] * (1 - kMinGain);
  double best_s = bound_s;
  int32_t best_sequence = -1;
  int64_t best_rank = -1;
  for (int32_t sequence : s->rank_fillers[busiest]) {
    const int64_t tokens = local_tokens_[sequence];
    const double other_s = local_other_s_[sequence];
    const double left_s = time_with(*s, busiest, -tokens, -other_s);
    if (left_s >= best_s) continue;
    for (int64_t rank : low_ranks_) {
      if (s->memory_bytes[rank] + local_memory_bytes_[sequence] > free_bytes_) continue;
      const double score_s = std::max(left_s, time_with(*s, rank, tokens, other_s));
      if (score_s < best_s) {
        best_s = score_s;
        best_sequence = sequence;
        best_rank = rank;
      }
    }
  }
  if (best_sequence < 0) return false;
  remove_filler(s, best_sequence);
  add_filler(s, best_sequence, best_rank);
  return true;
}

bool ZelligePlanner::try_swap(Solution* s, int64_t busiest) {
  if (s->rank_fillers[busiest].empty()) return false;
  member_[busiest] = 1;
  least_loaded(*s, kSwapPartners, &member_, &low_ranks_);
  member_[busiest] = 0;
  const double bound_s = s->time_s[busiest] * (1 - kMinGain);
  double best_s = bound_s;
  int32_t best_out = -1, best_in = -1;
  for (int64_t rank : low_ranks_) {
    const double gap_s = s->time_s[busiest] - s->time_s[rank];
    if (gap_s <= 0) continue;
    partner_fillers_.clear();
    for (int32_t sequence : s->rank_fillers[rank]) {
      partner_fillers_.push_back({local_estimate_s_[sequence], sequence});
    }
    if (partner_fillers_.empty()) continue;
    std::sort(partner_fillers_.begin(), partner_fillers_.end());
    for (int32_t out : s->rank_fillers[busiest]) {
      // The ideal partner is smaller by half the gap; price the few nearest exactly.
      const double want_s = local_estimate_s_[out] - gap_s / 2;
      const auto at = std::lower_bound(partner_fillers_.begin(), partner_fillers_.end(),
                                       std::pair<double, int32_t>{want_s, -1});
      const int64_t center = at - partner_fillers_.begin();
      const int64_t lo = std::max<int64_t>(0, center - 2);
      const int64_t hi = std::min<int64_t>(partner_fillers_.size(), center + 2);
      for (int64_t k = lo; k < hi; ++k) {
        const int32_t in = partner_fillers_[k].second;
        const int64_t delta_tokens = local_tokens_[in] - local_tokens_[out];
        const double delta_other_s = local_other_s_[in] - local_other_s_[out];
        const double delta_bytes = local_memory_bytes_[in] - local_memory_bytes_[out];
        if (s->memory_bytes[busiest] + delta_bytes > free_bytes_ ||
            s->memory_bytes[rank] - delta_bytes > free_bytes_) {
          continue;
        }
        const double score_s = std::max(time_with(*s, busiest, delta_tokens, delta_other_s),
                                        time_with(*s, rank, -delta_tokens, -delta_other_s));
        if (score_s < best_s) {
          best_s = score_s;
          best_out = out;
          best_in = in;
        }
      }
    }
  }
  if (best_out < 0) return false;
  const int64_t rank = s->filler_rank[best_in];
  remove_filler(s, best_out);
  remove_filler(s, best_in);
  add_filler(s, best_out, rank);
  add_filler(s, best_in, busiest);
  return true;
}

// The busiest time over the ranks that trading `old_shares` for `new_shares` touches, or infinity
// when a rank would run out of memory; past `above_s`, the rest of the ranks are not priced.
double ZelligePlanner::price_change(const Solution& s, const std::vector<RankShare>& old_shares,
                                    const std::vector<RankShare>& new_shares, double above_s) {
  touched_.clear();
  auto touch = [&](const RankShare& share, double sign) {
    if (delta_tokens_[share.rank] == 0 && delta_other_s_[share.rank] == 0 &&
        delta_memory_bytes_[share.rank] == 0) {
      touched_.push_back(share.rank);
    }
    delta_tokens_[share.rank] += static_cast<int64_t>(sign) * share.tokens;
    delta_other_s_[share.rank] += sign * (share.attention_s + share.exchange_s);
    delta_memory_bytes_[share.rank] += sign * share.memory_bytes;
  };
  for (const RankShare& share : old_shares) touch(share, -1);
  for (const RankShare& share : new_shares) touch(share, +1);
  double score_s = 0;
  for (int64_t rank : touched_) {
    if (score_s >= above_s) break;
    if (delta_memory_bytes_[rank] > 0 &&
        s.memory_bytes[rank] + delta_memory_bytes_[rank] > free_bytes_) {
      score_s = kInf;
      break;
    }
    score_s = std::max(score_s, time_with(s, rank, delta_tokens_[rank], delta_other_s_[rank]));
  }
  for (int64_t rank : touched_) {
    delta_tokens_[rank] = 0;
    delta_other_s_[rank] = 0;
    delta_memory_bytes_[rank] = 0;
  }
  return score_s;
}

bool ZelligePlanner::try_remould(Solution* s, int64_t busiest) {
  const double bound_s = s->time_s[busiest] * (1 - kMinGain);
  double best_s = bound_s;
  int32_t best_slot = -1;
  Shape best_shape;
  for (int32_t slot : s->rank_anchors[busiest]) {
    const AnchorPlacement& anchor = s->anchors[slot];
    const Sequence& sequence = batch_.sequences[anchor.sequence];
    const int64_t degree = anchor.shape.degree;
    auto consider = [&](const Shape& shape, const std::vector<int64_t>& ranks) {
      std::vector<RankShare> shares =
          small_shares(sequence, to_placement(sequence.id, shape, ranks));
      const double score_s = price_change(*s, anchor.shares, shares, best_s);
      if (score_s < best_s) {
        best_s = score_s;
        best_slot = slot;
        best_shape = shape;
        best_ranks_ = ranks;
        best_shares_ = std::move(shares);
      }
    };
    for (int64_t rank : anchor.ranks) member_[rank] = 1;
    least_loaded(*s, kRemouldPartners, &member_, &low_ranks_);
    for (int64_t rank : anchor.ranks) member_[rank] = 0;

    // Another shape on the same ranks.
    shapes_of_degree(degree, num_heads_, gpus_per_node_, &shapes_);
    const std::vector<Shape> same_degree = shapes_;
    for (const Shape& shape : same_degree) {
      if (shape.strategy != anchor.shape.strategy ||
          shape.ulysses_degree != anchor.shape.ulysses_degree) {
        consider(shape, anchor.ranks);
      }
    }
    // The busiest rank swapped for a lightly loaded one.
    for (int64_t rank : low_ranks_) {
      candidate_ranks_ = anchor.ranks;
      *std::find(candidate_ranks_.begin(), candidate_ranks_.end(), busiest) = rank;
      sort_ranks(&candidate_ranks_);
      consider(anchor.shape, candidate_ranks_);
    }
    // One rank more, in the best shape of that degree.
    if (degree < num_ranks_) {
      const ShapeChoice& wider = shape_at(anchor.sequence, degree + 1);
      if (wider.feasible) {
        const Shape shape = wider.shape;
        for (int64_t rank : low_ranks_) {
          candidate_ranks_ = anchor.ranks;
          candidate_ranks_.push_back(rank);
          sort_ranks(&candidate_ranks_);
          consider(shape, candidate_ranks_);
        }
      }
    }
    // The busiest rank dropped, in the best shape of that degree.
    if (degree > 1) {
      const ShapeChoice& narrower = shape_at(anchor.sequence, degree - 1);
      if (narrower.feasible) {
        const Shape shape = narrower.shape;
        candidate_ranks_ = anchor.ranks;
        candidate_ranks_.erase(
            std::find(candidate_ranks_.begin(), candidate_ranks_.end(), busiest));
        consider(shape, candidate_ranks_);
      }
    }
  }
  if (best_slot < 0) return false;
  remove_anchor_shares(s, best_slot);
  AnchorPlacement& anchor = s->anchors[best_slot];
  anchor.shape = best_shape;
  anchor.ranks = best_ranks_;
  anchor.shares = best_shares_;
  add_anchor_shares(s, best_slot);
  return true;
}

// A filler of the busiest rank sharded over 2..kMaxSplitDegree ranks: the least-loaded ones,
// with or without the busiest rank itself. Tries its kPromoteFillers longest fillers.
bool ZelligePlanner::try_promote(Solution* s, int64_t busiest) {
  const std::vector<int32_t>& fillers = s->rank_fillers[busiest];
  if (fillers.empty()) return false;
  longest_fillers_.assign(fillers.begin(), fillers.end());
  const size_t count = std::min<size_t>(kPromoteFillers, longest_fillers_.size());
  std::partial_sort(
      longest_fillers_.begin(), longest_fillers_.begin() + count, longest_fillers_.end(),
      [&](int32_t a, int32_t b) { return local_estimate_s_[a] > local_estimate_s_[b]; });
  longest_fillers_.resize(count);
  member_[busiest] = 1;
  least_loaded(*s, static_cast<int>(kMaxSplitDegree), &member_, &low_ranks_);
  member_[busiest] = 0;

  const double bound_s = s->time_s[busiest] * (1 - kMinGain);
  double best_s = bound_s;
  int32_t best_sequence = -1;
  Shape best_shape;
  std::vector<RankShare> old_shares(1);
  for (int32_t sequence : longest_fillers_) {
    const Sequence& seq = batch_.sequences[sequence];
    old_shares[0].rank = busiest;
    old_shares[0].tokens = local_tokens_[sequence];
    old_shares[0].attention_s = local_other_s_[sequence];
    old_shares[0].exchange_s = 0;
    old_shares[0].memory_bytes = local_memory_bytes_[sequence];
    const int64_t max_degree = std::min<int64_t>(kMaxSplitDegree, num_ranks_);
    for (int64_t degree = 2; degree <= max_degree; ++degree) {
      const ShapeChoice& choice = shape_at(sequence, degree);
      if (!choice.feasible) continue;
      const Shape shape = choice.shape;
      for (int keep_busiest = 0; keep_busiest < 2; ++keep_busiest) {
        const int64_t others = degree - keep_busiest;
        if (others > static_cast<int64_t>(low_ranks_.size())) continue;
        candidate_ranks_.assign(low_ranks_.begin(), low_ranks_.begin() + others);
        if (keep_busiest) candidate_ranks_.push_back(busiest);
        sort_ranks(&candidate_ranks_);
        std::vector<RankShare> shares =
            small_shares(seq, to_placement(seq.id, shape, candidate_ranks_));
        const double score_s = price_change(*s, old_shares, shares, best_s);
        if (score_s < best_s) {
          best_s = score_s;
          best_sequence = sequence;
          best_shape = shape;
          best_ranks_ = candidate_ranks_;
          best_shares_ = std::move(shares);
        }
      }
    }
  }
  if (best_sequence < 0) return false;
  remove_filler(s, best_sequence);
  const int32_t slot = s->num_anchors;
  AnchorPlacement& anchor = s->new_anchor();
  anchor.sequence = best_sequence;
  anchor.shape = best_shape;
  anchor.ranks = best_ranks_;
  anchor.shares = best_shares_;
  s->anchor_slot[best_sequence] = slot;
  add_anchor_shares(s, slot);
  return true;
}

int64_t ZelligePlanner::local_search(Solution* s, Clock::time_point deadline) {
  const int64_t max_steps = 20 * (num_sequences_ + num_ranks_) + 1000;
  int64_t step = 0;
  relocations_left_ = whole_anchor_moves_ ? kAnchorMovesPerAnchor * s->num_anchors : 0;
  int64_t memory_steps_left = whole_anchor_moves_ ? kMemorySteps : 0;
  for (; step < max_steps; ++step) {
    if ((step & 15) == 15 && Clock::now() > deadline) break;
    const int64_t busiest =
        std::max_element(s->time_s.begin(), s->time_s.end()) - s->time_s.begin();
    if (try_move(s, busiest) || try_swap(s, busiest) || try_remould(s, busiest) ||
        try_promote(s, busiest) || try_relocate(s, busiest) || try_pair(s, busiest)) {
      continue;
    }
    if (memory_steps_left <= 0 || !try_lower_memory(s)) break;
    --memory_steps_left;
  }
  finish(s);
  return step;
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
  // A baseline start is searched only when its floor is below the sweep's searched makespan (an
  // additive one, close to the exact): otherwise it rarely ends better and costs a whole search.
  const double sweep_s = best.makespan_s;
  price_finalists(0);

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
  };
  const double skip_above_s = std::max(sweep_s, best_s * (1 + kMemoryTieBreak));
  std::vector<Seed> seeds;
  int64_t skipped = 0;
  for (const std::string& name : covered_baselines(batch_, cost_model_)) {
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
      if (!bags.complete || bags_floor(bags) > skip_above_s) {
        ++skipped;
        continue;
      }
      seed.plan = planners::knapformer_plan(batch_, cost_model_, spec, kCoveredKnapformerGamma, bags);
      seed.floor_s = cost_model_.makespan_floor(batch_, seed.plan, cache_);
      seeds.push_back(std::move(seed));
      continue;
    }
    try {
      seed.plan = planners::run_policy(name, batch_, cost_model_, options_, &cache_);
    } catch (const PlanMemoryError&) {
      continue;  // the baseline has no plan within memory: nothing to be worse than
    }
    seed.floor_s = cost_model_.makespan_floor(batch_, seed.plan, cache_);
    seeds.push_back(std::move(seed));
  }
  std::stable_sort(seeds.begin(), seeds.end(),
                   [](const Seed& a, const Seed& b) { return a.floor_s < b.floor_s; });

  // Local search from the most promising baseline plans that fit.
  const size_t first_baseline_start = finalists.size();
  size_t starts = 0;
  for (const Seed& seed : seeds) {
    if (starts == kBaselineStarts || seed.floor_s >= sweep_s) break;
    import_plan(seed.plan, &current);
    if (!std::isfinite(current.makespan_s)) continue;  // out of memory
    search_from(&current, "search:" + seed.name);
    ++starts;
  }
  for (const bool busiest_only : {true, false}) {
    for (const int32_t max_run : {int32_t{1}, kBagRun}) {
      Plan bags;
      if (!bag_start(busiest_only, max_run, &bags)) break;
      import_plan(bags, &current);
      if (std::isfinite(current.makespan_s)) search_from(&current, "search:bags");
    }
  }
  {
    Plan configurations;
    if (configuration_start(sweep_s, &configurations)) {
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
  for (Seed& seed : seeds) {
    if (seed.floor_s > best_s * (1 + kMemoryTieBreak)) break;  // seeds are in floor order
    Finalist finalist{seed.name, std::move(seed.plan), {}};
    finalist.cost = cost_model_.evaluate(batch_, finalist.plan, cache_);
    ++priced;
    if (!finalist.cost.fits) continue;
    best_s = std::min(best_s, finalist.cost.makespan_s);
    best_baseline_s = std::min(best_baseline_s, finalist.cost.makespan_s);
    finalists.push_back(std::move(finalist));
  }
  if (!std::isfinite(best_s)) {
    throw PlanMemoryError(memory_error.empty()
                              ? "no construction and no baseline found a plan within memory"
                              : memory_error);
  }
  const double cap_s = std::min(best_s * (1 + kMemoryTieBreak), best_baseline_s);
  const Finalist* chosen = nullptr;
  for (const Finalist& finalist : finalists) {
    if (!finalist.cost.fits || finalist.cost.makespan_s > cap_s) continue;
    if (chosen == nullptr || finalist.cost.peak_bytes < chosen->cost.peak_bytes ||
        (finalist.cost.peak_bytes == chosen->cost.peak_bytes &&
         finalist.cost.makespan_s < chosen->cost.makespan_s)) {
      chosen = &finalist;
    }
  }
  Plan plan = chosen->plan;
  planners::set_prediction(plan, chosen->cost);  // make_plan's prediction: priced already
  plan.planner = "zellige";
  plan.note = "anchors=" + std::to_string(best.num_anchors) +
              " target_s=" + shortest(best_target_s) + " constructed_s=" + shortest(constructed_s) +
              " search_steps=" + std::to_string(steps) + " baselines=" +
              std::to_string(seeds.size()) + " skipped=" + std::to_string(skipped) + " priced=" + std::to_string(priced) +
              " final=" + chosen->source +
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

#include "zellige_moves.h"

}  // namespace

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
