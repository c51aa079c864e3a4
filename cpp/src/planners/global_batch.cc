// Global-batch planning (docs/global-batch.md): cut one optimizer step's sequences into
// micro-batches and place each micro-batch with a one-step planner.
//
// A sequence's memory demand is its activations alone on one rank (the least any placement
// holds in total over its ranks, up to exchange buffers) and its work the time it takes alone on
// one rank; a micro-batch's memory budget is every rank's room above the fixed bytes. Both are
// estimates for cutting only: every micro-batch is then placed by make_plan, which prices it
// with the exact cost model and refuses a plan beyond memory; a micro-batch that does not fit is
// split in two.
#include "zellige/global_batch.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "rank_loads.h"

namespace zellige {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// zellige's micro-batch counts, in quarters of the least count: 1.5, 2, 1.25, 2.5 and 3 times it.
constexpr int64_t kCountQuartersOfLeast[] = {6, 8, 5, 10, 12};
// zellige places at most about this many times the global batch's sequences over all its cuts,
// fewer from kEstimatedFromRanks ranks on, where one pass costs hundreds of milliseconds and
// each count is first priced by one micro-batch (plan_zellige_global) ...
constexpr int64_t kEstimatedFromRanks = 65;
int64_t placed_passes(int64_t num_ranks) { return num_ranks < kEstimatedFromRanks ? 8 : 2; }
// ... unless the batch holds at most this many: then every cut is tried.
constexpr int64_t kSmallGlobalBatch = 256;
// A cut is abandoned once its bound exceeds the step time to beat by this fraction (the bound
// and the step time sum the same makespans in different orders).
constexpr double kBoundMargin = 1e-9;
// Lower bounds of micro-batches are used from this many ranks on: on fewer, makespan_lower_bound
// adds its whole-share refinement and costs more than the baselines it would cut short ...
constexpr int64_t kBoundedFromRanks = 128;
// ... and only while the batch holds at least this many sequences per distinct length: the
// bound's cost grows with the distinct lengths, a placement's with the sequences (heavy-tailed
// lengths made the bounds cost several times the placements they saved).
constexpr int64_t kBoundedSequencesPerLength = 64;

using Cut = std::vector<std::vector<int64_t>>;  // micro-batches of indices into the batch

struct SequenceCost {
  double memory_bytes = 0;
  double work_s = 0;
  double tokens = 0;  // its shares' tokens, the same under every placement
};

// Sequences of equal lengths cost the same under every placement (routing from the loader rank
// adds exchange bytes, not time), so each length is priced once.
using LengthKey = std::pair<int64_t, int64_t>;  // (num_tokens, text_tokens)

LengthKey length_key(const Sequence& sequence) {
  return {sequence.num_tokens, sequence.text_tokens};
}

std::vector<SequenceCost> sequence_costs(const Batch& batch, const CostModel& cost_model) {
  std::map<LengthKey, SequenceCost> by_length;
  std::vector<SequenceCost> costs;
  costs.reserve(batch.sequences.size());
  for (const Sequence& sequence : batch.sequences) {
    auto [it, is_new] = by_length.try_emplace(length_key(sequence));
    if (is_new) {
      const Placement local = make_placement(sequence.id, Strategy::kLocal, {0});
      const std::vector<RankShare> shares = cost_model.shares(sequence, local);
      double tokens = 0;
      for (const RankShare& share : shares) tokens += static_cast<double>(share.tokens);
      it->second = {planners::placement_memory_bytes(shares),
                    planners::placement_time_s(cost_model, shares), tokens};
    }
    costs.push_back(it->second);
  }
  return costs;
}

// Per sequence, the index of its length among the batch's distinct lengths.
std::vector<int64_t> length_classes(const Batch& batch, int64_t* num_classes) {
  std::map<LengthKey, int64_t> index;
  std::vector<int64_t> classes;
  classes.reserve(batch.sequences.size());
  for (const Sequence& sequence : batch.sequences) {
    classes.push_back(
        index.try_emplace(length_key(sequence), static_cast<int64_t>(index.size())).first->second);
  }
  *num_classes = static_cast<int64_t>(index.size());
  return classes;
}

double micro_batch_budget_bytes(const CostModel& cost_model) {
  const double room_bytes = cost_model.memory_capacity_bytes() - cost_model.fixed_bytes();
  return static_cast<double>(cost_model.cluster().num_ranks()) * std::max(room_bytes, 0.0);
}

// The fewest micro-batches whose budgets hold `total_bytes`, between 1 and `num_sequences`.
int64_t least_micro_batches(double total_bytes, double budget_bytes, int64_t num_sequences) {
  if (!(budget_bytes > 0)) return num_sequences;
  const double count = std::ceil(total_bytes / budget_bytes);
  return count >= static_cast<double>(num_sequences)
             ? num_sequences
             : std::max<int64_t>(1, static_cast<int64_t>(count));
}

// `order` cut into consecutive micro-batches of at most `budget_bytes` each (a sequence above the
// budget alone in its own).
Cut cut_in_order(const std::vector<int64_t>& order, const std::vector<SequenceCost>& costs,
                 double budget_bytes) {
  Cut cut;
  double used_bytes = kInf;
  for (const int64_t index : order) {
    if (used_bytes + costs[index].memory_bytes > budget_bytes) {
      cut.emplace_back();
      used_bytes = 0;
    }
    cut.back().push_back(index);
    used_bytes += costs[index].memory_bytes;
  }
  return cut;
}

// The two stages over micro-batches: sequences heaviest first, each to the micro-batch of least
// work among those with memory left for it (else the one of least memory), so the K heaviest
// open one micro-batch each and the rest fill around them.
Cut spread(const std::vector<int64_t>& heaviest_first, const std::vector<SequenceCost>& costs,
           int64_t num_micro_batches, double budget_bytes) {
  Cut cut(num_micro_batches);
  std::vector<double> work_s(num_micro_batches, 0.0), memory_bytes(num_micro_batches, 0.0);
  for (const int64_t index : heaviest_first) {
    int64_t best = -1;
    for (int64_t k = 0; k < num_micro_batches; ++k) {
      if (memory_bytes[k] + costs[index].memory_bytes > budget_bytes) continue;
      if (best < 0 || work_s[k] < work_s[best]) best = k;
    }
    if (best < 0) {
      best = std::min_element(memory_bytes.begin(), memory_bytes.end()) - memory_bytes.begin();
    }
    cut[best].push_back(index);
    work_s[best] += costs[index].work_s;
    memory_bytes[best] += costs[index].memory_bytes;
  }
  std::erase_if(cut, [](const std::vector<int64_t>& part) { return part.empty(); });
  return cut;
}

// The heaviest kept together: `heaviest_first` cut in order into micro-batches of an equal share
// of the memory, the remainder that rounding leaves merged into the last where it fits.
Cut grouped(const std::vector<int64_t>& heaviest_first, const std::vector<SequenceCost>& costs,
            int64_t num_micro_batches, double total_bytes, double budget_bytes) {
  Cut cut = cut_in_order(heaviest_first, costs,
                         std::min(budget_bytes, total_bytes / num_micro_batches));
  if (static_cast<int64_t>(cut.size()) > num_micro_batches) {
    double merged_bytes = 0;
    for (const auto* part : {&cut[cut.size() - 2], &cut.back()}) {
      for (const int64_t index : *part) merged_bytes += costs[index].memory_bytes;
    }
    if (merged_bytes <= budget_bytes) {
      cut[cut.size() - 2].insert(cut[cut.size() - 2].end(), cut.back().begin(), cut.back().end());
      cut.pop_back();
    }
  }
  return cut;
}

Batch sub_batch(const Batch& batch, std::vector<int64_t> indices) {
  std::sort(indices.begin(), indices.end());  // the global batch's order
  Batch part;
  part.sequences.reserve(indices.size());
  for (const int64_t index : indices) part.sequences.push_back(batch.sequences[index]);
  return part;
}

// What each micro-batch's planner is handed of the global batch's options.
PlannerOptions inner_planner_options(const GlobalBatchOptions& options) {
  PlannerOptions planner_options;
  planner_options.seed = options.seed;
  planner_options.time_limit_s = options.time_limit_s;
  return planner_options;
}

double step_time_s(const GlobalPlan& plan, double overhead_s) {
  double total_s = 0;
  for (const MicroBatch& micro_batch : plan.micro_batches) {
    total_s += micro_batch.plan.predicted.makespan_s + overhead_s;
  }
  return total_s;
}

// A lower bound on the makespan of `part` under any placement, from its per-token layers alone:
// every rank runs them on the tokens it holds at no less than min_floor_time_per_token_s each
// (makespan_floor's rate, at most what evaluate charges), and the shares of a sequence hold its
// tokens whatever the shape. O(sequences), so it can bound every micro-batch of every cut; tight
// where attention is small beside the per-token layers (many short sequences).
double token_bound_s(const std::vector<int64_t>& part, const std::vector<SequenceCost>& costs,
                     const CostModel& cost_model) {
  double tokens = 0;
  for (const int64_t index : part) tokens += costs[index].tokens;
  return tokens * cost_model.min_floor_time_per_token_s() / cost_model.cluster().total_speed();
}

// A planner that places micro-batches: for a baseline's, the one shape it gives every sequence
// (group_size ranks, Ulysses over ulysses_degree of them, ring over the rest; 1: local), which
// ShapeBounds prices; group_size 0: no fixed shape (zellige, megatron-dcp).
struct Variant {
  std::string planner;
  int64_t group_size = 0;
  int64_t ulysses_degree = 1;
};

// Plans of micro-batches by their lengths: a micro-batch of the same lengths as one placed
// before (in any cut) takes that plan's placements, sequence for sequence of equal lengths, and
// the cost model prices it anew. Its placements are then the planner's own for those lengths,
// only on other sequence ids; a micro-batch that fitted under none is remembered as such. One
// memo serves one inner planner.
class PlanMemo {
 public:
  explicit PlanMemo(std::vector<int64_t> classes) : classes_(std::move(classes)) {}

  // The key of `part` (indices into the batch, in the global batch's order).
  std::vector<int64_t> key(const std::vector<int64_t>& part) const {
    std::vector<int64_t> lengths;
    lengths.reserve(part.size());
    for (const int64_t index : part) lengths.push_back(classes_[index]);
    std::sort(lengths.begin(), lengths.end());
    return lengths;
  }

  bool knows(const std::vector<int64_t>& part) const { return plans_.count(key(part)) > 0; }

  // True when `part` was placed before; then `micro_batch` holds its plan (false in `*fits` when
  // it fitted under no planner).
  bool reuse(const std::vector<int64_t>& part, MicroBatch* micro_batch,
             const CostModel& cost_model, bool* fits) const {
    const auto known = plans_.find(key(part));
    if (known == plans_.end()) return false;
    *fits = known->second.fits;
    if (!*fits) return true;
    const Entry& entry = known->second;
    std::vector<int64_t> sorted = part;
    std::sort(sorted.begin(), sorted.end());  // sub_batch's order
    if (sorted == entry.indices) {  // the same sequences: the same plan
      micro_batch->plan = entry.plan;
      return true;
    }
    // The template's placements of each length, in its order; each taken once.
    std::unordered_map<int64_t, std::vector<size_t>> of_length;
    for (size_t i = entry.classes.size(); i-- > 0;) of_length[entry.classes[i]].push_back(i);
    Plan plan = entry.plan;
    for (size_t j = 0; j < sorted.size(); ++j) {
      std::vector<size_t>& free = of_length.at(classes_[sorted[j]]);
      plan.placements[j] = entry.plan.placements[free.back()];
      plan.placements[j].sequence_id = micro_batch->batch.sequences[j].id;
      free.pop_back();
    }
    predict(plan, micro_batch->batch, cost_model);
    micro_batch->plan = std::move(plan);
    return true;
  }

  void remember(const std::vector<int64_t>& part, const MicroBatch& micro_batch, bool fits) {
    std::vector<int64_t> sorted = part;
    std::sort(sorted.begin(), sorted.end());
    Entry entry{fits ? micro_batch.plan : Plan{}, {}, sorted, fits};
    for (const int64_t index : sorted) entry.classes.push_back(classes_[index]);
    plans_.emplace(key(part), std::move(entry));
  }

 private:
  struct Entry {
    Plan plan;                     // placements in its micro-batch's order
    std::vector<int64_t> classes;  // the length class of each of its sequences, in that order
    std::vector<int64_t> indices;  // its sequences, in that order
    bool fits = true;
  };
  std::vector<int64_t> classes_;  // per sequence of the batch
  std::map<std::vector<int64_t>, Entry> plans_;
};

// `part` in two, in its order, at half its memory (each half non-empty).
std::pair<std::vector<int64_t>, std::vector<int64_t>> halves(
    const std::vector<int64_t>& part, const std::vector<SequenceCost>& costs) {
  double total_bytes = 0;
  for (const int64_t index : part) total_bytes += costs[index].memory_bytes;
  size_t split = 1;
  double front_bytes = costs[part[0]].memory_bytes;
  while (split + 1 < part.size() &&
         front_bytes + costs[part[split]].memory_bytes <= total_bytes / 2) {
    front_bytes += costs[part[split++]].memory_bytes;
  }
  return {std::vector<int64_t>(part.begin(), part.begin() + split),
          std::vector<int64_t>(part.begin() + split, part.end())};
}

// makespan_lower_bound of micro-batches (index sets into the batch), memoised: the baselines'
// variants share their cuts. A cut's micro-batches' bounds sum to at most its step time: each
// makespan is at least its micro-batch's bound, and two halves of a micro-batch take at least
// the bound of the whole (the bound's terms are sums and maxima over sequences; the global-batch
// tests check that no plan's step is below the whole batch's bound).
class PartBounds {
 public:
  PartBounds(const Batch& batch, const CostModel& cost_model, const std::vector<int64_t>& classes,
             int64_t num_classes)
      : batch_(batch), cost_model_(cost_model), classes_(classes), seen_(num_classes, false) {}

  double operator()(std::vector<int64_t> part) {
    std::sort(part.begin(), part.end());
    const auto known = bound_s_.find(part);
    if (known != bound_s_.end()) return known->second;
    const double bound_s = makespan_lower_bound(sub_batch(batch_, part), cost_model_);
    bound_s_.emplace(std::move(part), bound_s);
    return bound_s;
  }

  // The bound of `part` where its lengths repeat (kBoundedSequencesPerLength sequences or more
  // per distinct length), so that it costs far less than placing `part`; 0 elsewhere.
  double where_repeated(const std::vector<int64_t>& part) {
    int64_t num_lengths = 0;
    for (const int64_t index : part) {
      if (!seen_[classes_[index]]) {
        seen_[classes_[index]] = true;
        ++num_lengths;
      }
    }
    for (const int64_t index : part) seen_[classes_[index]] = false;
    const bool repeated =
        static_cast<int64_t>(part.size()) >= kBoundedSequencesPerLength * num_lengths;
    return repeated ? (*this)(part) : 0.0;
  }

 private:
  const Batch& batch_;
  const CostModel& cost_model_;
  const std::vector<int64_t>& classes_;
  std::vector<bool> seen_;  // where_repeated's scratch, all false between calls
  std::map<std::vector<int64_t>, double> bound_s_;
};

// Lower bounds on a micro-batch's makespan under a planner that gives every sequence one shape
// (static-cp:C, knapformer:gGnN, dp-cost: Ulysses/ring over C consecutive ranks, local for 1),
// from the cost model's floor (CostModel::floor_rank_seconds, at most what evaluate charges):
// the ranks together run the sum of the floors, and the busiest position of each sequence at
// least its placement's mean. Each (length, shape) is priced once; a cheap test that a baseline
// cannot win, so that it need not be placed.
class ShapeBounds {
 public:
  ShapeBounds(const Batch& batch, const std::vector<int64_t>& classes, int64_t num_classes,
              const CostModel& cost_model)
      : batch_(batch), classes_(classes), num_classes_(num_classes), cost_model_(cost_model) {}

  // The bound of `part` under each sequence on `group_size` ranks, Ulysses over
  // `ulysses_degree` of them (ring over the rest).
  double operator()(const std::vector<int64_t>& part, int64_t group_size,
                    int64_t ulysses_degree) {
    const Cluster& cluster = cost_model_.cluster();
    // Every group of the planner then shares nodes as ranks 0..group_size-1 do.
    if (cluster.gpus_per_node % group_size != 0 && group_size % cluster.gpus_per_node != 0) {
      return 0;
    }
    std::vector<double>& floors = floors_[{group_size, ulysses_degree}];
    if (floors.empty()) floors.assign(static_cast<size_t>(num_classes_), -1.0);
    double total_s = 0, busiest_s = 0;
    for (const int64_t index : part) {
      double& floor_s = floors[classes_[index]];
      if (floor_s < 0) {
        const Sequence& sequence = batch_.sequences[index];
        floor_s = cost_model_.floor_rank_seconds(
            sequence, shape(sequence.id, group_size, ulysses_degree), cache_);
      }
      total_s += floor_s;
      busiest_s = std::max(busiest_s, floor_s / static_cast<double>(group_size));
    }
    return std::max(total_s / cluster.total_speed(), busiest_s / cluster.max_speed());
  }

 private:
  static Placement shape(int64_t sequence_id, int64_t group_size, int64_t ulysses_degree) {
    std::vector<int64_t> ranks(static_cast<size_t>(group_size));
    std::iota(ranks.begin(), ranks.end(), 0);
    if (group_size == 1) return make_placement(sequence_id, Strategy::kLocal, std::move(ranks));
    if (ulysses_degree == group_size) {
      return make_placement(sequence_id, Strategy::kUlysses, std::move(ranks));
    }
    if (ulysses_degree == 1) return make_placement(sequence_id, Strategy::kRing, std::move(ranks));
    return make_placement(sequence_id, Strategy::kHybrid, std::move(ranks), ulysses_degree);
  }

  const Batch& batch_;
  const std::vector<int64_t>& classes_;
  int64_t num_classes_;
  const CostModel& cost_model_;
  EvaluationCache cache_;
  std::map<std::pair<int64_t, int64_t>, std::vector<double>> floors_;
};

// The fastest plan of `inner` that fits `micro_batch` (the sequences `part` of the batch); false
// when none fits. With `shapes`, a planner of one shape whose bound there is no faster than the
// plan in hand is not run.
bool place_one(const std::vector<Variant>& inner, const std::vector<int64_t>& part,
               MicroBatch* micro_batch, const CostModel& cost_model,
               const PlannerOptions& planner_options, ShapeBounds* shapes) {
  double best_s = kInf;
  for (const Variant& variant : inner) {
    if (shapes != nullptr && variant.group_size > 0 && best_s < kInf &&
        (*shapes)(part, variant.group_size, variant.ulysses_degree) >= best_s) {
      continue;
    }
    try {
      Plan plan = make_plan(variant.planner, micro_batch->batch, cost_model, planner_options);
      if (plan.predicted.makespan_s < best_s) {
        best_s = plan.predicted.makespan_s;
        micro_batch->plan = std::move(plan);
      }
    } catch (const PlanMemoryError&) {
    }
  }
  return best_s < kInf;
}

// Each micro-batch of `cut` placed by the fastest of `inner` that fits it. With `costs`, one
// that fits under none is split in two and each half placed in its stead (the cut's memory
// estimate need only be near); without, or for a single sequence, nullopt. Also nullopt once the
// cut cannot beat a plan of step time `abandon_at_s`: the micro-batches placed so far reach it,
// or, with `costs` (token bounds), `bounds` or `shapes` (for planners of one shape each), they
// and the bounds of the rest do; with `placed_bounds`, also where the lower bound of the
// micro-batch about to be placed (only where its lengths repeat: PartBounds::where_repeated) and
// the bounds of the rest do. `placed_sequences`, if given, counts the sequences placed and those
// a bound ruled out; `memo` reuses plans of micro-batches of equal lengths.
std::optional<GlobalPlan> place_cut(const std::vector<Variant>& inner, const Batch& batch,
                                    Cut cut, const CostModel& cost_model,
                                    const GlobalBatchOptions& options,
                                    const std::vector<SequenceCost>* costs = nullptr,
                                    double abandon_at_s = kInf,
                                    int64_t* placed_sequences = nullptr,
                                    PartBounds* bounds = nullptr, PlanMemo* memo = nullptr,
                                    ShapeBounds* shapes = nullptr,
                                    PartBounds* placed_bounds = nullptr) {
  const PlannerOptions planner_options = inner_planner_options(options);
  const bool shaped =
      shapes != nullptr && std::all_of(inner.begin(), inner.end(), [](const Variant& variant) {
        return variant.group_size > 0;
      });
  const bool bounded = (costs != nullptr || bounds != nullptr || shaped) && abandon_at_s < kInf;
  // A micro-batch's bound: the largest of its token bound, its lower bound and, where every
  // planner of `inner` has one shape, the least of their shape bounds.
  auto part_bound_s = [&](const std::vector<int64_t>& part) {
    double bound_s = costs != nullptr ? token_bound_s(part, *costs, cost_model) : 0;
    if (bounds != nullptr) bound_s = std::max(bound_s, (*bounds)(part));
    if (shaped) {
      double least_s = kInf;
      for (const Variant& variant : inner) {
        least_s = std::min(least_s, (*shapes)(part, variant.group_size, variant.ulysses_degree));
      }
      bound_s = std::max(bound_s, least_s);
    }
    return bound_s;
  };
  double rest_bound_s = 0;  // the bounds of cut[k:] plus their overheads
  if (bounded) {
    for (const std::vector<int64_t>& part : cut) {
      rest_bound_s += part_bound_s(part) + options.micro_batch_overhead_s;
    }
  }
  GlobalPlan result;
  double partial_s = 0;
  // Micro-batches k on that a bound rules out count as placed: the pass budget ends where
  // placing them would have ended it.
  auto ruled_out = [&](size_t k) -> std::optional<GlobalPlan> {
    for (; placed_sequences != nullptr && k < cut.size(); ++k) {
      if (memo == nullptr || !memo->knows(cut[k])) {
        *placed_sequences += static_cast<int64_t>(cut[k].size());
      }
    }
    return std::nullopt;
  };
  for (size_t k = 0; k < cut.size();) {
    if (partial_s >= abandon_at_s) return std::nullopt;
    if (partial_s + rest_bound_s > abandon_at_s * (1 + kBoundMargin)) return ruled_out(k);
    if (bounded && placed_bounds != nullptr && (memo == nullptr || !memo->knows(cut[k]))) {
      const double own_s = part_bound_s(cut[k]);
      const double tighter_s = std::max(own_s, placed_bounds->where_repeated(cut[k]));
      if (partial_s + rest_bound_s - own_s + tighter_s > abandon_at_s * (1 + kBoundMargin)) {
        return ruled_out(k);
      }
    }
    MicroBatch micro_batch{sub_batch(batch, cut[k]), {}};
    bool fits = false;
    if (memo == nullptr || !memo->reuse(cut[k], &micro_batch, cost_model, &fits)) {
      if (placed_sequences != nullptr) *placed_sequences += static_cast<int64_t>(cut[k].size());
      fits = place_one(inner, cut[k], &micro_batch, cost_model, planner_options, shapes);
      if (memo != nullptr) memo->remember(cut[k], micro_batch, fits);
    }
    if (fits) {
      partial_s += micro_batch.plan.predicted.makespan_s + options.micro_batch_overhead_s;
      if (bounded) rest_bound_s -= part_bound_s(cut[k]) + options.micro_batch_overhead_s;
      result.micro_batches.push_back(std::move(micro_batch));
      ++k;
      continue;
    }
    if (costs == nullptr || cut[k].size() == 1) return std::nullopt;
    auto [front, back] = halves(cut[k], *costs);
    if (bounded) {
      rest_bound_s += part_bound_s(front) + part_bound_s(back) + options.micro_batch_overhead_s -
                      part_bound_s(cut[k]);
    }
    cut[k] = std::move(front);
    cut.insert(cut.begin() + static_cast<std::ptrdiff_t>(k) + 1, std::move(back));
  }
  if (partial_s >= abandon_at_s) return std::nullopt;
  result.step_time_s = step_time_s(result, options.micro_batch_overhead_s);
  return result;
}

// `order` cut by memory, refined where a micro-batch does not fit (nullopt past `abandon_at_s`,
// as place_cut).
std::optional<GlobalPlan> place_in_order(const std::vector<Variant>& inner, const Batch& batch,
                                         const std::vector<int64_t>& order,
                                         const std::vector<SequenceCost>& costs,
                                         const CostModel& cost_model,
                                         const GlobalBatchOptions& options, double abandon_at_s,
                                         PartBounds* bounds) {
  const Cut cut = cut_in_order(order, costs, micro_batch_budget_bytes(cost_model));
  return place_cut(inner, batch, cut, cost_model, options, &costs, abandon_at_s, nullptr, bounds);
}

std::vector<int64_t> loader_order(const Batch& batch) {
  std::vector<int64_t> order(batch.sequences.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return batch.sequences[a].source_rank < batch.sequences[b].source_rank;
  });
  return order;
}

std::vector<int64_t> order_by(const Batch& batch, const std::vector<double>& key) {
  std::vector<int64_t> order(batch.sequences.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return key[a] > key[b]; });
  return order;
}

// Group sizes a static layout may use: powers of two up to a node that divide the GPU count.
std::vector<int64_t> static_group_sizes(const CostModel& cost_model) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  std::vector<int64_t> sizes;
  for (int64_t size = 1; size <= std::min<int64_t>(num_ranks, 8); size *= 2) {
    if (num_ranks % size == 0) sizes.push_back(size);
  }
  return sizes;
}

// Static-CP's sharding of a group of `group_size` ranks: Ulysses over the largest degree that
// divides both the group and the head count, ring over the rest (as static-cp places it).
int64_t static_ulysses_degree(int64_t group_size, int64_t num_heads) {
  for (int64_t degree = group_size; degree > 1; --degree) {
    if (group_size % degree == 0 && num_heads % degree == 0) return degree;
  }
  return 1;
}

// The least step time of `cut` with every micro-batch under the best of `variants` (the shape
// bounds; kInf-free: 0 without `shapes`).
double cut_shape_bound_s(const Cut& cut, const std::vector<Variant>& variants,
                         const GlobalBatchOptions& options, ShapeBounds* shapes) {
  if (shapes == nullptr) return 0;
  double total_s = 0;
  for (const std::vector<int64_t>& part : cut) {
    double least_s = kInf;
    for (const Variant& variant : variants) {
      least_s = std::min(least_s, (*shapes)(part, variant.group_size, variant.ulysses_degree));
    }
    total_s += least_s + options.micro_batch_overhead_s;
  }
  return total_s;
}

// The best of several whole-run variants (a bag spec, a group size), each with its own cut. A
// variant is abandoned once it cannot beat the best before it (the first of equals wins, as
// without) or `abandon_at_s`; with `shapes`, one whose shape bound already reaches that is not
// placed at all.
std::optional<GlobalPlan> best_variant(const std::vector<Variant>& variants, const Batch& batch,
                                       const std::vector<int64_t>& order,
                                       const std::vector<SequenceCost>& costs,
                                       const CostModel& cost_model,
                                       const GlobalBatchOptions& options, double abandon_at_s,
                                       PartBounds* bounds, ShapeBounds* shapes) {
  const Cut cut = cut_in_order(order, costs, micro_batch_budget_bytes(cost_model));
  std::optional<GlobalPlan> best;
  for (const Variant& variant : variants) {
    const double beat_s = best ? std::min(best->step_time_s, abandon_at_s) : abandon_at_s;
    if (cut_shape_bound_s(cut, {variant}, options, shapes) > beat_s * (1 + kBoundMargin)) continue;
    std::optional<GlobalPlan> plan;
    try {
      plan = place_cut({variant}, batch, cut, cost_model, options, &costs, beat_s, nullptr,
                       bounds, nullptr, shapes);
    } catch (const std::invalid_argument&) {
      continue;  // a spec the model's heads do not allow
    }
    if (plan && (!best || plan->step_time_s < best->step_time_s)) {
      plan->chosen = variant.planner;
      best = std::move(plan);
    }
  }
  return best;
}

// The baseline's plan; nullopt when none fits in memory, or, given `abandon_at_s`, when it
// cannot beat a plan of that step time (with `shapes`, possibly without placing it).
std::optional<GlobalPlan> plan_baseline(const std::string& name, const Batch& batch,
                                        const std::vector<SequenceCost>& costs,
                                        const CostModel& cost_model,
                                        const GlobalBatchOptions& options,
                                        double abandon_at_s = kInf,
                                        PartBounds* bounds = nullptr,
                                        ShapeBounds* shapes = nullptr) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  const int64_t num_heads = cost_model.model().num_heads;
  std::optional<GlobalPlan> plan;
  if (name == "megatron-dcp") {
    std::vector<double> tokens;
    for (const Sequence& sequence : batch.sequences) {
      tokens.push_back(static_cast<double>(sequence.num_tokens));
    }
    plan = place_in_order({{"megatron-dcp"}}, batch, order_by(batch, tokens), costs, cost_model,
                          options, abandon_at_s, bounds);
    if (plan) plan->chosen = "megatron-dcp";
  } else if (name == "knapformer") {
    // Inside a bag of g GPUs every sequence runs Ulysses over all g.
    std::vector<Variant> specs;
    for (const int64_t size : static_group_sizes(cost_model)) {
      if (num_heads % size != 0) continue;
      specs.push_back({"knapformer:g" + std::to_string(size) + "n" +
                           std::to_string(num_ranks / size),
                       size, size});
    }
    plan = best_variant(specs, batch, loader_order(batch), costs, cost_model, options,
                        abandon_at_s, bounds, shapes);
  } else if (name == "static-cp") {
    std::vector<Variant> sizes;
    for (const int64_t size : static_group_sizes(cost_model)) {
      sizes.push_back(
          {"static-cp:" + std::to_string(size), size, static_ulysses_degree(size, num_heads)});
    }
    plan = best_variant(sizes, batch, loader_order(batch), costs, cost_model, options,
                        abandon_at_s, bounds, shapes);
  } else if (name == "wlb-llm") {
    // Variable-length packing: the fewest micro-batches the memory allows, balanced by work;
    // inside each, whole sequences by cost or a static CP group, whichever is fastest there.
    std::vector<double> work_s;
    double total_bytes = 0;
    for (const SequenceCost& cost : costs) {
      work_s.push_back(cost.work_s);
      total_bytes += cost.memory_bytes;
    }
    std::vector<Variant> inner = {{"dp-cost", 1, 1}};
    for (const int64_t size : static_group_sizes(cost_model)) {
      if (size > 1) {
        inner.push_back(
            {"static-cp:" + std::to_string(size), size, static_ulysses_degree(size, num_heads)});
      }
    }
    const std::vector<int64_t> heaviest_first = order_by(batch, work_s);
    const int64_t count = least_micro_batches(total_bytes, micro_batch_budget_bytes(cost_model),
                                              static_cast<int64_t>(batch.sequences.size()));
    const Cut cut = spread(heaviest_first, costs, count, micro_batch_budget_bytes(cost_model));
    if (cut_shape_bound_s(cut, inner, options, shapes) <= abandon_at_s * (1 + kBoundMargin)) {
      plan = place_cut(inner, batch, cut, cost_model, options, &costs, abandon_at_s, nullptr,
                       bounds, nullptr, shapes);
    }
    if (plan) plan->chosen = "wlb-llm";
  } else {
    throw std::invalid_argument("unknown global-batch planner '" + name + "'");
  }
  if (plan) plan->planner = name;
  return plan;
}

// The same micro-batches in one order, to tell cuts apart.
Cut canonical(Cut cut) {
  for (std::vector<int64_t>& part : cut) std::sort(part.begin(), part.end());
  std::sort(cut.begin(), cut.end());
  return cut;
}

Cut cut_of(const GlobalPlan& plan, const Batch& batch) {
  std::unordered_map<int64_t, int64_t> index;
  for (size_t i = 0; i < batch.sequences.size(); ++i) index[batch.sequences[i].id] = i;
  Cut cut;
  for (const MicroBatch& micro_batch : plan.micro_batches) {
    cut.emplace_back();
    for (const Sequence& sequence : micro_batch.batch.sequences) {
      cut.back().push_back(index.at(sequence.id));
    }
  }
  return cut;
}

// The micro-batch counts zellige tries, in the order it places them: multiples of the least its
// memory estimate allows (micro-batches a third to two thirds full won most often: a full one
// makes the planner shard or recompute more, and is slow to plan; an emptier one balances fewer
// sequences), then the least and up to extra_micro_batches more, for a large per-micro-batch
// overhead.
std::vector<int64_t> micro_batch_counts(int64_t least_count, int64_t num_sequences,
                                        int64_t extra_micro_batches) {
  std::vector<int64_t> counts;
  auto add = [&](int64_t count) {
    count = std::min(count, num_sequences);
    if (std::find(counts.begin(), counts.end(), count) == counts.end()) counts.push_back(count);
  };
  for (const int64_t quarters : kCountQuartersOfLeast) add((quarters * least_count + 3) / 4);
  for (int64_t extra = extra_micro_batches; extra >= 0; --extra) add(least_count + extra);
  return counts;
}

GlobalPlan plan_zellige_global(const Batch& batch, const std::vector<SequenceCost>& costs,
                               const CostModel& cost_model, const GlobalBatchOptions& options) {
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  const double budget_bytes = micro_batch_budget_bytes(cost_model);
  std::vector<double> work_s;
  double total_bytes = 0;
  for (const SequenceCost& cost : costs) {
    work_s.push_back(cost.work_s);
    total_bytes += cost.memory_bytes;
  }
  const std::vector<int64_t> heaviest_first = order_by(batch, work_s);
  std::optional<GlobalPlan> best;
  auto consider = [&](std::optional<GlobalPlan> plan, const std::string& chosen) {
    if (!plan) return;
    plan->chosen = chosen;
    if (!best || plan->step_time_s < best->step_time_s) best = std::move(plan);
  };

  // Stage one and two for each count: the heaviest spread over the micro-batches, and beside it
  // the alternative that keeps the heaviest together (their bottlenecks then share one
  // micro-batch). Each placed by zellige, abandoned once it cannot beat the best so far; past
  // placed_passes times the batch's sequences no further cut is started (a small batch tries
  // every one).
  const int64_t least_count = least_micro_batches(total_bytes, budget_bytes, num_sequences);
  const int64_t placement_budget =
      num_sequences <= kSmallGlobalBatch ? std::numeric_limits<int64_t>::max()
                                         : placed_passes(cost_model.cluster().num_ranks()) *
                                               num_sequences;
  const PlannerOptions planner_options = inner_planner_options(options);
  int64_t placed_sequences = 0;
  std::set<Cut> tried;
  int64_t num_classes = 0;
  const std::vector<int64_t> classes = length_classes(batch, &num_classes);
  PartBounds bounds(batch, cost_model, classes, num_classes);
  PartBounds* const large_cluster_bounds =
      cost_model.cluster().num_ranks() >= kBoundedFromRanks ? &bounds : nullptr;
  PartBounds* const baseline_bounds =
      num_sequences >= kBoundedSequencesPerLength * num_classes ? large_cluster_bounds : nullptr;
  PlanMemo memo(classes);
  auto try_cut = [&](const Cut& cut, const std::string& name, bool within_budget) {
    if (cut.empty() || (within_budget && best && placed_sequences >= placement_budget)) return;
    if (!tried.insert(canonical(cut)).second) return;
    consider(place_cut({{"zellige"}}, batch, cut, cost_model, options, &costs,
                       best ? best->step_time_s : kInf, &placed_sequences, nullptr, &memo,
                       nullptr, large_cluster_bounds),
             name);
  };
  const std::vector<int64_t> counts =
      micro_batch_counts(least_count, num_sequences, options.extra_micro_batches);
  if (num_sequences > kSmallGlobalBatch &&
      cost_model.cluster().num_ranks() >= kEstimatedFromRanks) {
    // Spread micro-batches are alike (balanced by work, the heaviest one each), so one of them
    // prices its whole cut: each count's first micro-batch is placed (and kept for the cut, see
    // PlanMemo) and the counts tried whole in the order of their estimates.
    double total_work_s = 0;
    for (const double seconds : work_s) total_work_s += seconds;
    std::vector<std::pair<double, int64_t>> estimates;  // (step time estimate s, count)
    for (const int64_t count : counts) {
      const Cut cut = spread(heaviest_first, costs, count, budget_bytes);
      MicroBatch first{sub_batch(batch, cut[0]), {}};
      bool fits = false;
      if (!memo.reuse(cut[0], &first, cost_model, &fits)) {
        placed_sequences += static_cast<int64_t>(cut[0].size());
        fits = place_one({{"zellige"}}, cut[0], &first, cost_model, planner_options, nullptr);
        memo.remember(cut[0], first, fits);
      }
      if (!fits) continue;
      double first_work_s = 0;
      for (const int64_t index : cut[0]) first_work_s += work_s[index];
      estimates.push_back({first.plan.predicted.makespan_s * total_work_s / first_work_s +
                               static_cast<double>(cut.size()) * options.micro_batch_overhead_s,
                           count});
    }
    std::sort(estimates.begin(), estimates.end());
    // The best estimate's count, spread and grouped (which one micro-batch does not price), in
    // every case; the next ones while the budget lasts.
    for (size_t rank = 0; rank < estimates.size(); ++rank) {
      const int64_t count = estimates[rank].second;
      try_cut(spread(heaviest_first, costs, count, budget_bytes), "zellige:spread", rank > 0);
      try_cut(grouped(heaviest_first, costs, count, total_bytes, budget_bytes), "zellige:grouped",
              rank > 0);
    }
  }
  for (const int64_t count : counts) {
    try_cut(spread(heaviest_first, costs, count, budget_bytes), "zellige:spread", true);
    try_cut(grouped(heaviest_first, costs, count, total_bytes, budget_bytes), "zellige:grouped",
            true);
  }

  // The baselines: one that wins is kept (the never-worse promise), and the best one's cut placed
  // by zellige, which is never slower than megatron-dcp, knapformer or static-cp on a
  // micro-batch. Past a small batch, each is abandoned once it cannot beat the best plan so far
  // (the micro-batches it placed, and on large clusters the lower bounds of the rest, reach it),
  // and a baseline of one shape per sequence is not placed where its shape bounds reach it.
  const double baseline_abandon_at_s =
      best && num_sequences > kSmallGlobalBatch ? best->step_time_s : kInf;
  std::optional<GlobalPlan> best_baseline;
  ShapeBounds shapes(batch, classes, num_classes, cost_model);
  for (const std::string& name : global_batch_baseline_names()) {
    std::optional<GlobalPlan> plan = plan_baseline(name, batch, costs, cost_model, options,
                                                   baseline_abandon_at_s, baseline_bounds,
                                                   &shapes);
    if (plan && (!best_baseline || plan->step_time_s < best_baseline->step_time_s)) {
      best_baseline = plan;
    }
    if (plan) {
      const std::string chosen = name + "=" + plan->chosen;
      consider(std::move(plan), chosen);
    }
  }
  if (best_baseline) {
    try_cut(cut_of(*best_baseline, batch), "zellige:" + best_baseline->planner, false);
  }
  if (!best) {
    throw PlanMemoryError("no cut of the global batch into micro-batches fits in memory");
  }
  return *std::move(best);
}

}  // namespace

std::vector<std::string> global_batch_planner_names() {
  return {"zellige", "megatron-dcp", "knapformer", "static-cp", "wlb-llm"};
}

std::vector<std::string> global_batch_baseline_names() {
  return {"megatron-dcp", "knapformer", "static-cp", "wlb-llm"};
}

namespace {

// A plan of one micro-batch is a step of one: its prediction by `cost_model` (no gradients of
// earlier micro-batches held), the placements as planned.
void priced_as_one_if_alone(GlobalPlan& plan, const CostModel& cost_model,
                            const GlobalBatchOptions& options) {
  if (plan.micro_batches.size() != 1) return;
  MicroBatch& only = plan.micro_batches.front();
  predict(only.plan, only.batch, cost_model);
  plan.step_time_s = step_time_s(plan, options.micro_batch_overhead_s);
}

// The whole batch as a step of one micro-batch, placed by zellige and priced holding no earlier
// gradients, where memory may allow it: it replaces `plan` where faster. The search prices every
// micro-batch as one of several, a single one included, which a step of one undercuts.
// make_plan refuses a plan beyond memory, so the one it returns fits.
void consider_one_step(GlobalPlan& plan, const Batch& batch, const std::vector<SequenceCost>& costs,
                       const CostModel& cost_model, const GlobalBatchOptions& options) {
  if (plan.micro_batches.size() == 1) return;  // priced as a step of one already
  double total_bytes = 0;
  for (const SequenceCost& cost : costs) total_bytes += cost.memory_bytes;
  if (total_bytes > micro_batch_budget_bytes(cost_model)) return;
  Plan one;
  try {
    one = make_plan("zellige", batch, cost_model, inner_planner_options(options));
  } catch (const PlanMemoryError&) {
    return;
  }
  const double step_s = one.predicted.makespan_s + options.micro_batch_overhead_s;
  if (step_s >= plan.step_time_s) return;
  GlobalPlan single;
  single.chosen = "zellige:one-step";
  single.micro_batches = {MicroBatch{batch, std::move(one)}};
  single.step_time_s = step_s;
  plan = std::move(single);
}

}  // namespace

GlobalPlan plan_global_batch(const std::string& planner, const Batch& batch,
                             const CostModel& cost_model, const GlobalBatchOptions& options) {
  const std::vector<std::string> names = global_batch_planner_names();
  if (std::find(names.begin(), names.end(), planner) == names.end()) {
    std::string allowed;
    for (const std::string& name : names) allowed += (allowed.empty() ? "" : ", ") + name;
    throw std::invalid_argument("unknown global-batch planner '" + planner +
                                "'; allowed: " + allowed);
  }
  if (options.extra_micro_batches < 0) {
    throw std::invalid_argument("extra_micro_batches must be >= 0");
  }
  if (!(options.micro_batch_overhead_s >= 0)) {
    throw std::invalid_argument("micro_batch_overhead_s must be >= 0");
  }
  validate_batch(batch, cost_model.cluster().num_ranks());
  // Every micro-batch is priced as one of several: its backward holds the gradients the earlier
  // ones added (a plan of one micro-batch is priced again as a step of one below).
  const CostModel accumulating = cost_model.accumulating_view();
  check_sequences_fit(batch, accumulating);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<SequenceCost> costs = sequence_costs(batch, accumulating);
  GlobalPlan plan;
  if (planner == "zellige") {
    plan = plan_zellige_global(batch, costs, accumulating, options);
  } else {
    std::optional<GlobalPlan> baseline =
        plan_baseline(planner, batch, costs, accumulating, options);
    if (!baseline) {
      throw PlanMemoryError("global-batch planner '" + planner +
                            "' fits no micro-batch cut of this batch in memory");
    }
    plan = *std::move(baseline);
  }
  priced_as_one_if_alone(plan, cost_model, options);
  if (planner == "zellige") consider_one_step(plan, batch, costs, cost_model, options);
  plan.planner = planner;
  plan.plan_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return plan;
}

GlobalPlan place_micro_batches(const std::string& planner, const Batch& batch,
                               const std::vector<std::vector<int64_t>>& micro_batch_ids,
                               const CostModel& cost_model, const GlobalBatchOptions& options) {
  std::unordered_map<int64_t, int64_t> index;
  for (size_t i = 0; i < batch.sequences.size(); ++i) index[batch.sequences[i].id] = i;
  std::vector<bool> seen(batch.sequences.size(), false);
  Cut cut;
  for (const std::vector<int64_t>& ids : micro_batch_ids) {
    if (ids.empty()) throw std::invalid_argument("a micro-batch is empty");
    cut.emplace_back();
    for (const int64_t id : ids) {
      const auto found = index.find(id);
      if (found == index.end()) {
        throw std::invalid_argument("micro-batch names sequence " + std::to_string(id) +
                                    ", which the batch does not hold");
      }
      if (seen[found->second]) {
        throw std::invalid_argument("sequence " + std::to_string(id) +
                                    " is in more than one micro-batch");
      }
      seen[found->second] = true;
      cut.back().push_back(found->second);
    }
  }
  const auto missing = std::find(seen.begin(), seen.end(), false);
  if (missing != seen.end()) {
    throw std::invalid_argument("sequence " +
                                std::to_string(batch.sequences[missing - seen.begin()].id) +
                                " is in no micro-batch");
  }
  std::optional<GlobalPlan> plan =
      place_cut({{planner}}, batch, cut, cost_model.accumulating_view(), options);
  if (!plan) {
    throw PlanMemoryError("a micro-batch does not fit in memory under '" + planner + "'");
  }
  priced_as_one_if_alone(*plan, cost_model, options);
  plan->planner = planner;
  plan->chosen = planner;
  return *std::move(plan);
}

}  // namespace zellige
