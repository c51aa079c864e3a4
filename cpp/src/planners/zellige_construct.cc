// The zellige planner's construction: per-sequence estimates (prepare), anchor shapes and their
// rank sets (stage 1), fillers first-fit under the target (stage 2), and the Solution's
// bookkeeping.
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

void ZelligePlanner::prepare() {
  const int64_t total = total_tokens(batch_);
  total_tokens_ = total;
  const int64_t tokens_per_rank = std::max<int64_t>(1, total / num_ranks_);
  rate_s_per_token_ = linear_s(tokens_per_rank) / static_cast<double>(tokens_per_rank);
  free_bytes_ = cost_model_.memory_capacity_bytes() - cost_model_.fixed_bytes();
  most_free_bytes_ = cost_model_.max_memory_capacity_bytes() - cost_model_.fixed_bytes();
  const Cluster& cluster = cost_model_.cluster();
  rank_free_bytes_.clear();
  if (!cluster.rank_memory_bytes.empty()) {
    for (int64_t rank = 0; rank < num_ranks_; ++rank) {
      rank_free_bytes_.push_back(cost_model_.memory_capacity_bytes(rank) -
                                 cost_model_.fixed_bytes());
    }
  }
  speeds_ = cluster.rank_speeds;
  max_speed_ = cluster.max_speed();

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
  mean_load_s_ /= cost_model_.cluster().total_speed();  // the rank count on like ranks
  order_.resize(num_sequences_);
  std::iota(order_.begin(), order_.end(), 0);
  std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
    return local_estimate_s_[a] > local_estimate_s_[b];
  });
  shape_cache_.assign(num_sequences_, {});
  node_ranks_by_time_.assign(num_nodes_, std::vector<int64_t>(gpus_per_node_));
  node_least_free_bytes_.assign(num_nodes_, kInf);
  for (int64_t rank = 0; rank < num_ranks_; ++rank) {
    double& least_bytes = node_least_free_bytes_[node_of(rank)];
    least_bytes = std::min(least_bytes, free_bytes(rank));
  }
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
    if (memory_bytes > most_free_bytes_ || time_s >= choice.time_s) continue;
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
  double most_bytes = 0;
  for (int64_t d = 1; d <= gpus_per_node_; ++d) {
    node_trees_[d - 1].update(node, s.time_s[ranks[d - 1]]);
    most_bytes = std::max(most_bytes, s.memory_bytes[ranks[d - 1]]);
  }
  node_most_bytes_[node] = most_bytes;
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
      if (s.memory_bytes[rank] + memory_bytes > free_bytes(rank)) continue;
      if (taken_ranks) taken_ranks->push_back(rank);
      last_time_s = s.time_s[rank];
      ++taken;
    }
    return taken == count ? last_time_s : kInf;
  };
  // take_from_node's time without its ranks: where every rank of the node has the memory, the
  // node tree's key for `count` (O(1), not a walk over the node's ranks for each of its nodes).
  auto node_key = [&](int64_t node, int64_t count) {
    if (node_most_bytes_[node] + memory_bytes <= node_least_free_bytes_[node]) {
      return node_trees_[count - 1].value(node);
    }
    return take_from_node(node, count, nullptr);
  };

  auto busiest_after = [&] {
    double busiest_s = 0;
    for (size_t k = 0; k < ranks->size(); ++k) {
      const int64_t rank = (*ranks)[k];
      busiest_s =
          std::max(busiest_s, s.time_s[rank] + at_speed(rank, estimate_s(choice.shares[k])));
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
  int64_t best_node = -1;
  const int found = full_nodes > 0 ? nodes_from_trees(full_nodes, partial, memory_bytes, &best_node)
                                   : -1;
  if (found == 0) return kInf;
  if (found < 0) {
    node_keys_.clear();
    for (int64_t node = 0; node < num_nodes_; ++node) {
      node_keys_.push_back({node_key(node, full_nodes > 0 ? gpus_per_node_ : partial), node});
    }
    full_node_ids_.clear();
    if (full_nodes > 0) {
      // The full_nodes least (time, node) keys, in any order: ranks are sorted below, and the
      // partial node's choice (least time, then node) does not depend on the order of the rest.
      std::nth_element(node_keys_.begin(), node_keys_.begin() + (full_nodes - 1),
                       node_keys_.end());
      if (node_keys_[full_nodes - 1].first == kInf) return kInf;
      // Each of them has every rank within memory (a finite key): whole nodes, in node order.
      for (int64_t k = 0; k < full_nodes; ++k) full_node_ids_.push_back(node_keys_[k].second);
    }
    if (partial > 0) {
      double best_time_s = kInf;
      for (size_t k = full_nodes; k < node_keys_.size(); ++k) {
        const int64_t node = node_keys_[k].second;
        const double time_s =
            full_nodes > 0 ? node_key(node, partial) : node_keys_[k].first;
        if (time_s < best_time_s || (time_s == best_time_s && node < best_node)) {
          best_time_s = time_s;
          best_node = node;
        }
      }
      if (best_node < 0) return kInf;
    }
  }
  std::sort(full_node_ids_.begin(), full_node_ids_.end());
  for (int64_t node : full_node_ids_) {
    for (int64_t rank = node * gpus_per_node_; rank < (node + 1) * gpus_per_node_; ++rank) {
      ranks->push_back(rank);
    }
  }
  if (partial > 0) {
    const size_t partial_begin = ranks->size();
    take_from_node(best_node, partial, ranks);
    std::sort(ranks->begin() + partial_begin, ranks->end());
  }
  // Full nodes in node order, each in rank order (above), the partial node last: the canonical
  // pattern.
  return busiest_after();
}

// select_anchor_ranks beyond a node, from the node trees rather than a pass over every node for
// each anchor and degree tried (thousands of clips over 4096 ranks): the `full_nodes` least
// (key, node) pairs popped off the whole-node tree into full_node_ids_, then the partial node
// (`best_node`) as the least of the others on its tree. The same choice as the scan while every
// node that comes up has the memory on all its ranks: its key is then its tree value, and no
// node's key is below its tree value (a node short of memory skips ranks). Returns 1 when found,
// 0 when no such ranks exist, -1 when a node short of memory came up (the caller scans).
int ZelligePlanner::nodes_from_trees(int64_t full_nodes, int64_t partial, double memory_bytes,
                                     int64_t* best_node) {
  auto has_memory = [&](int64_t node) {
    return node_most_bytes_[node] + memory_bytes <= node_least_free_bytes_[node];
  };
  MinTree& full_tree = node_trees_[gpus_per_node_ - 1];
  popped_keys_s_.clear();
  full_node_ids_.clear();
  int found = 1;
  while (static_cast<int64_t>(full_node_ids_.size()) < full_nodes) {
    const int64_t node = full_tree.argmin();
    const double key_s = full_tree.value(node);
    if (key_s == kInf || !has_memory(node)) {
      found = key_s == kInf ? 0 : -1;
      break;
    }
    full_node_ids_.push_back(node);
    popped_keys_s_.push_back(key_s);
    full_tree.update(node, kInf);
  }
  for (size_t k = 0; k < full_node_ids_.size(); ++k) {
    full_tree.update(full_node_ids_[k], popped_keys_s_[k]);
  }
  if (found != 1 || partial == 0) return found;
  MinTree& partial_tree = node_trees_[partial - 1];
  popped_keys_s_.clear();
  for (int64_t node : full_node_ids_) {
    popped_keys_s_.push_back(partial_tree.value(node));
    partial_tree.update(node, kInf);
  }
  *best_node = partial_tree.argmin();
  if (partial_tree.value(*best_node) == kInf) {
    found = 0;
  } else if (!has_memory(*best_node)) {
    found = -1;
  }
  for (size_t k = 0; k < full_node_ids_.size(); ++k) {
    partial_tree.update(full_node_ids_[k], popped_keys_s_[k]);
  }
  if (found != 1) *best_node = -1;
  return found;
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
    if (s->memory_bytes[rank] > free_bytes(rank)) s->makespan_s = kInf;
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
  node_most_bytes_.assign(num_nodes_, 0.0);
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
    if (item.memory_bytes <= most_free_bytes_ && item.estimate_s <= target_s &&
        item.efficient_whole) {
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
      const double cut_s = target_s - 0.98 * item.estimate_s / max_speed_;
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
        if (s->memory_bytes[rank] + bytes <= free_bytes(rank) &&
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
      if (s->memory_bytes[chosen] + bytes > free_bytes(chosen)) {
        // Rare: the least-loaded rank is out of memory; scan for the least loaded that is not.
        chosen = -1;
        for (int64_t rank = 0; rank < num_ranks_; ++rank) {
          if (s->memory_bytes[rank] + bytes <= free_bytes(rank) &&
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
          0.95 * estimate_s / static_cast<double>(max_degree) / max_speed_ >
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
    const double least_share_s = 0.95 * estimate_s / static_cast<double>(degree) / max_speed_;
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
      within = s->memory_bytes[rank] + share.memory_bytes <= free_bytes(rank) &&
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


}  // namespace zellige::planners::zellige_detail
