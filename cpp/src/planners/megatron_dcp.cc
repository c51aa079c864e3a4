// megatron-dcp: Megatron-Core dynamic (hybrid) context parallelism, as REFERENCE.md describes it.
//  - Degree from memory: cp = max(1, 2^ceil(log2(L / max_tokens_per_rank))), where
//    max_tokens_per_rank is the longest sequence one rank holds within memory under this cost
//    model; CP is Megatron's default ring (p2p) attention.
//  - Workload L^2 / cp (attention only). Samples sorted by length and cut into as many buckets of
//    roughly equal work as there are distinct degrees; the next sample is the first bucket head
//    with a home: the least-loaded group of its size, or a new group on free ranks when that one
//    is less loaded. A round stops once some smaller degree was placed and the slack between the
//    most and least loaded rank is <= 5%; then the last sample of the most loaded group is
//    trimmed while that lowers the slack, and empty ranks are filled by doubling the smallest
//    group. Groups of a round lie on consecutive ranks in creation order (power-of-two aligned
//    when sizes descend). Leftover samples start the next round.
// Megatron runs its rounds as micro-batches separated by barriers; a Zellige plan is one step in
// which a rank runs all its sequences, so the rounds' placements are united and their memory adds:
// groups without room are skipped, and a round that places nothing raises PlanMemoryError.
#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <numeric>
#include <set>
#include <utility>

#include "rank_loads.h"
#include "registry.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

constexpr double kBalanceSlack = 0.05;    // stop a round once max - min <= 5% of max
constexpr double kBucketOverfill = 1.10;  // a bucket closes above 110% of its work target

struct Sample {
  int64_t index = 0;        // in the batch
  double length = 0;        // attended tokens
  int64_t cp = 1;           // degree from memory
  double work = 0;          // length^2 / cp
  double memory_bytes = 0;  // per rank at degree cp, the sample alone
};

struct Group {
  int64_t size = 0;
  double load = 0;               // sum of work, the same on every member
  double memory_bytes = 0;       // sum of the samples' per-rank memory
  std::vector<int64_t> samples;  // positions in the samples vector, in placement order
};

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

// Buckets of roughly equal work, as many as there are distinct degrees; contiguous in `pending`.
std::vector<std::deque<int64_t>> make_buckets(const std::vector<int64_t>& pending,
                                              const std::vector<Sample>& samples) {
  std::set<int64_t> degrees;
  double total_work = 0;
  for (int64_t s : pending) {
    degrees.insert(samples[s].cp);
    total_work += samples[s].work;
  }
  const int64_t num_buckets = static_cast<int64_t>(degrees.size());
  const double target = total_work / static_cast<double>(num_buckets);
  const int64_t num_pending = static_cast<int64_t>(pending.size());
  std::vector<std::deque<int64_t>> buckets;
  std::deque<int64_t> current;
  double current_work = 0;
  for (int64_t i = 0; i < num_pending; ++i) {
    const double work = samples[pending[i]].work;
    // Close the bucket when it would overflow, or to keep a sample for every bucket still to come.
    const int64_t buckets_to_come = num_buckets - static_cast<int64_t>(buckets.size());
    if (!current.empty() && (current_work + work > target * kBucketOverfill ||
                             num_pending - i <= buckets_to_come - 1)) {
      buckets.push_back(std::move(current));
      current = {};
      current_work = 0;
    }
    current.push_back(pending[i]);
    current_work += work;
  }
  if (!current.empty()) buckets.push_back(std::move(current));
  return buckets;
}

class MegatronDcp {
 public:
  MegatronDcp(const Batch& batch, const CostModel& cost_model, EvaluationCache* cache)
      : batch_(batch),
        cost_model_(cost_model),
        loads_(cost_model, cache),
        num_ranks_(cost_model.cluster().num_ranks()) {}

  Plan run();

 private:
  void prepare_samples();
  // One round over `pending`; places what it can into plan_ and returns the leftovers.
  std::vector<int64_t> round(const std::vector<int64_t>& pending, int64_t* num_placed);
  void trim_overload(std::vector<Group>& groups, std::vector<int64_t>& leftovers) const;

  const Batch& batch_;
  const CostModel& cost_model_;
  planners::RankLoads loads_;
  const int64_t num_ranks_;
  std::vector<Sample> samples_;
  Plan plan_;
};

void MegatronDcp::prepare_samples() {
  int64_t max_text_tokens = 0;
  for (const Sequence& sequence : batch_.sequences) {
    max_text_tokens = std::max(max_text_tokens, sequence.text_tokens);
  }
  const int64_t max_tokens = max_tokens_per_rank(cost_model_, max_text_tokens);
  if (max_tokens == 0) {
    throw PlanMemoryError("megatron-dcp: no rank has memory for even one token (" +
                          planners::format_gib(cost_model_.fixed_bytes()) + " fixed, " +
                          planners::format_gib(cost_model_.memory_capacity_bytes()) +
                          " available)");
  }
  const double max_length =
      static_cast<double>(attended_tokens(cost_model_.model(), max_tokens, max_text_tokens));
  const double room_bytes = cost_model_.memory_capacity_bytes() - cost_model_.fixed_bytes();

  for (int64_t i = 0; i < static_cast<int64_t>(batch_.sequences.size()); ++i) {
    const Sequence& sequence = batch_.sequences[i];
    Sample sample;
    sample.index = i;
    sample.length = static_cast<double>(
        attended_tokens(cost_model_.model(), sequence.num_tokens, sequence.text_tokens));
    while (static_cast<double>(sample.cp) * max_length < sample.length) sample.cp *= 2;
    sample.cp = std::min(sample.cp, num_ranks_);  // or the entire DP x CP group
    // The memory-derived degree estimates ring buffers from one probe; double until it fits.
    while (true) {
      sample.memory_bytes = planners::placement_memory_bytes(
          loads_.shares(sequence, ring_placement(sequence.id, 0, sample.cp)));
      if (sample.memory_bytes <= room_bytes) break;
      if (sample.cp == num_ranks_) {
        throw PlanMemoryError("megatron-dcp: " + planners::describe_sequence(sequence) +
                              " does not fit in memory even as ring attention over all " +
                              std::to_string(num_ranks_) + " GPUs");
      }
      sample.cp = std::min(sample.cp * 2, num_ranks_);
    }
    sample.work = sample.length * sample.length / static_cast<double>(sample.cp);
    samples_.push_back(sample);
  }
}

void MegatronDcp::trim_overload(std::vector<Group>& groups, std::vector<int64_t>& leftovers) const {
  while (true) {
    double max_load = 0, min_load = groups.front().load;
    int64_t most_loaded = 0;
    for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
      if (groups[g].load > max_load) max_load = groups[g].load, most_loaded = g;
      min_load = std::min(min_load, groups[g].load);
    }
    const double slack = max_load - min_load;
    if (slack <= kBalanceSlack * max_load) return;
    Group& group = groups[most_loaded];
    if (group.samples.size() <= 1) return;
    const Sample& last = samples_[group.samples.back()];
    double projected_max = 0, projected_min = group.load - last.work;
    for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
      const double load = g == most_loaded ? group.load - last.work : groups[g].load;
      projected_max = std::max(projected_max, load);
      projected_min = std::min(projected_min, load);
    }
    if (projected_max - projected_min >= slack) return;
    group.load -= last.work;
    group.memory_bytes -= last.memory_bytes;
    leftovers.push_back(group.samples.back());
    group.samples.pop_back();
  }
}

std::vector<int64_t> MegatronDcp::round(const std::vector<int64_t>& pending, int64_t* num_placed) {
  std::vector<std::deque<int64_t>> buckets = make_buckets(pending, samples_);
  // Memory in a round is checked against the emptiest rank; exact per-rank checks follow once
  // the round's layout is known, and a sample that does not fit then waits for the next round.
  double base_bytes = loads_.peak_bytes(0);
  for (int64_t rank = 1; rank < num_ranks_; ++rank) {
    base_bytes = std::min(base_bytes, loads_.peak_bytes(rank));
  }
  const double capacity_bytes = loads_.capacity_bytes();

  std::vector<Group> groups;
  std::map<int64_t, std::set<std::pair<double, int64_t>>> groups_by_size;  // (load, group)
  std::set<std::pair<double, int64_t>> groups_by_load;
  int64_t used_ranks = 0;
  double max_load = 0;
  int64_t first_degree = 0;
  bool check_balance = false;
  int64_t num_remaining = static_cast<int64_t>(pending.size());

  while (num_remaining > 0) {
    // The first bucket head with a home: a group of its size with room, or enough free ranks.
    int64_t bucket = -1, existing = -1;
    bool open_new = false;
    for (int64_t b = 0; b < static_cast<int64_t>(buckets.size()) && bucket < 0; ++b) {
      if (buckets[b].empty()) continue;
      const Sample& sample = samples_[buckets[b].front()];
      existing = -1;
      for (const auto& [load, g] : groups_by_size[sample.cp]) {
        if (base_bytes + groups[g].memory_bytes + sample.memory_bytes <= capacity_bytes) {
          existing = g;
          break;
        }
      }
      const bool can_open = num_ranks_ - used_ranks >= sample.cp &&
                            base_bytes + sample.memory_bytes <= capacity_bytes;
      if (existing < 0 && !can_open) continue;
      bucket = b;
      // Free ranks carry no load in this round: a new group wins over any loaded one.
      open_new = can_open && (existing < 0 || groups[existing].load > 0);
    }
    if (bucket < 0) break;

    const int64_t s = buckets[bucket].front();
    buckets[bucket].pop_front();
    --num_remaining;
    const Sample& sample = samples_[s];
    int64_t g = existing;
    if (open_new) {
      g = static_cast<int64_t>(groups.size());
      groups.push_back({sample.cp, 0.0, 0.0, {}});
      used_ranks += sample.cp;
    } else {
      groups_by_size[sample.cp].erase({groups[g].load, g});
      groups_by_load.erase({groups[g].load, g});
    }
    groups[g].load += sample.work;
    groups[g].memory_bytes += sample.memory_bytes;
    groups[g].samples.push_back(s);
    groups_by_size[sample.cp].insert({groups[g].load, g});
    groups_by_load.insert({groups[g].load, g});
    max_load = std::max(max_load, groups[g].load);

    if (first_degree == 0) first_degree = sample.cp;
    if (sample.cp < first_degree) check_balance = true;
    const double min_load = used_ranks < num_ranks_ ? 0.0 : groups_by_load.begin()->first;
    if (check_balance && num_remaining > 0 && max_load - min_load <= kBalanceSlack * max_load) {
      break;
    }
  }

  std::vector<int64_t> leftovers;
  for (const std::deque<int64_t>& b : buckets)
    leftovers.insert(leftovers.end(), b.begin(), b.end());
  *num_placed = 0;
  if (groups.empty()) return leftovers;
  if (used_ranks == num_ranks_) trim_overload(groups, leftovers);

  // Fill empty ranks by doubling the smallest group (the first of that size).
  while (used_ranks < num_ranks_) {
    int64_t smallest = 0;
    for (int64_t g = 1; g < static_cast<int64_t>(groups.size()); ++g) {
      if (groups[g].size < groups[smallest].size) smallest = g;
    }
    const int64_t grow = std::min(groups[smallest].size, num_ranks_ - used_ranks);
    groups[smallest].size += grow;
    used_ranks += grow;
  }

  int64_t first_rank = 0;
  for (const Group& group : groups) {
    for (int64_t s : group.samples) {
      const Sequence& sequence = batch_.sequences[samples_[s].index];
      Placement placement = ring_placement(sequence.id, first_rank, group.size);
      const std::vector<RankShare> shares = loads_.shares(sequence, placement);
      if (!loads_.fits(shares)) {
        leftovers.push_back(s);
        continue;
      }
      loads_.add(shares);
      plan_.placements[samples_[s].index] = std::move(placement);
      ++*num_placed;
    }
    first_rank += group.size;
  }
  return leftovers;
}

Plan MegatronDcp::run() {
  plan_ = planners::empty_plan("megatron-dcp", cost_model_);
  plan_.placements.resize(batch_.sequences.size());
  prepare_samples();
  std::vector<int64_t> pending(samples_.size());
  std::iota(pending.begin(), pending.end(), 0);
  std::stable_sort(pending.begin(), pending.end(),
                   [&](int64_t a, int64_t b) { return samples_[a].length > samples_[b].length; });
  while (!pending.empty()) {
    int64_t num_placed = 0;
    pending = round(pending, &num_placed);
    if (num_placed == 0) {
      const Sequence& sequence = batch_.sequences[samples_[pending.front()].index];
      throw PlanMemoryError("megatron-dcp: " + planners::describe_sequence(sequence) +
                            " fits in no group of " + std::to_string(samples_[pending.front()].cp) +
                            " GPUs: out of memory (" +
                            planners::format_gib(loads_.capacity_bytes()) + " per rank)");
    }
  }
  return plan_;
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
