// Local-search moves of whole anchors: an anchor of the busiest rank moved to an aligned window of
// any degree, and two anchors put together on the union of their ranks. Both run only where the
// cheaper moves (zellige_search.cc) found nothing (the busiest rank is at a local optimum of move /
// swap / re-mould / promote) and, like them, must lower the busiest rank's time without raising
// any rank they touch above it. Also here: the starts of aligned bags and of node configurations,
// and the equal-makespan memory steps.
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

#include "node_configurations.h"
#include "rank_loads.h"
#include "zellige_planner.h"

namespace zellige::planners::zellige_detail {

// The `count` nodes whose ranks' summed time is least (ties: lower node first), in that order.
void ZelligePlanner::least_loaded_nodes(const Solution& s, int count,
                                        std::vector<int64_t>* nodes) {
  node_load_s_.assign(num_nodes_, 0.0);
  for (int64_t rank = 0; rank < num_ranks_; ++rank) node_load_s_[node_of(rank)] += s.time_s[rank];
  nodes->resize(num_nodes_);
  std::iota(nodes->begin(), nodes->end(), 0);
  const int64_t kept = std::min<int64_t>(count, num_nodes_);
  std::partial_sort(nodes->begin(), nodes->begin() + kept, nodes->end(), [&](int64_t a, int64_t b) {
    return node_load_s_[a] < node_load_s_[b] || (node_load_s_[a] == node_load_s_[b] && a < b);
  });
  nodes->resize(kept);
}

// `least` (least_loaded_nodes), then the nodes of `anchor`'s ranks.
void ZelligePlanner::window_nodes(const std::vector<int64_t>& least, const AnchorPlacement& anchor,
                                  std::vector<int64_t>* nodes) const {
  nodes->assign(least.begin(), least.end());
  for (int64_t rank : anchor.ranks) {
    if (std::find(nodes->begin(), nodes->end(), node_of(rank)) == nodes->end()) {
      nodes->push_back(node_of(rank));
    }
  }
}

// An anchor of the busiest rank moved whole, in the best shape of its new degree, to an aligned
// window: inside one node, `degree` consecutive ranks from an offset that is a multiple of the
// degree or that ends the node (any degree up to a node); beyond a node, whole consecutive nodes.
// Windows lie on the least-loaded nodes and the anchor's own; degrees go up to twice its own (at
// least two nodes' worth). An aligned window has the node pattern of ranks 0..degree-1, so the
// canonical shares of shape_at price it exactly.
bool ZelligePlanner::try_relocate(Solution* s, int64_t busiest) {
  if (s->rank_anchors[busiest].empty() || relocations_left_ <= 0) return false;
  const double bound_s = s->time_s[busiest] * (1 - kMinGain);
  double best_s = bound_s;
  int32_t best_slot = -1;
  int64_t best_degree = 0;
  // The node loads do not change while the anchors of the busiest rank are tried: once per call.
  least_loaded_nodes(*s, kWindowNodes, &least_nodes_);
  for (int32_t slot : searched_anchors(*s, busiest)) {
    const AnchorPlacement& anchor = s->anchors[slot];
    window_nodes(least_nodes_, anchor, &window_nodes_);
    int64_t unit_tokens = 0;  // the shares' tokens, whatever the shape
    for (const RankShare& share : anchor.shares) unit_tokens += share.tokens;
    prepare_relocation(*s, anchor);
    const int64_t max_degree =
        std::min(num_ranks_, std::max(2 * anchor.shape.degree, 2 * gpus_per_node_));
    for (int64_t degree = 2; degree <= max_degree;
         degree = next_window_degree(degree, gpus_per_node_)) {
      // Every aligned window of `degree` ranks on the window nodes, by its first rank.
      auto for_each_window = [&](auto&& visit) {
        for (int64_t node : window_nodes_) {
          const int64_t node_first = node * gpus_per_node_;
          if (degree <= gpus_per_node_) {
            for (int64_t offset = 0; offset + degree <= gpus_per_node_; offset += degree) {
              visit(node_first + offset);
            }
            if (gpus_per_node_ % degree != 0) visit(node_first + gpus_per_node_ - degree);
          } else if (node_first + degree <= num_ranks_) {
            visit(node_first);
          }
        }
      };
      // Where no window's floor is below the best so far, none can win: the degree's shapes are
      // not priced (shape_at prices every shape of a degree, most of relocation's cost).
      bool open = false;
      for_each_window([&](int64_t first_rank) {
        open = open || relocation_floor(*s, anchor, unit_tokens / degree, first_rank, degree,
                                        best_s) < best_s;
      });
      if (!open) continue;
      const ShapeChoice& choice = shape_at(anchor.sequence, degree);
      if (!choice.feasible) continue;
      for_each_window([&](int64_t first_rank) {
        if (choice.shape.strategy == anchor.shape.strategy &&
            choice.shape.ulysses_degree == anchor.shape.ulysses_degree &&
            static_cast<int64_t>(anchor.ranks.size()) == degree) {
          int64_t k = 0;
          while (k < degree && anchor.ranks[k] == first_rank + k) ++k;
          if (k == degree) return;  // the anchor as it is
        }
        const double score_s = relocation_price(*s, anchor, choice.shares, first_rank, best_s);
        if (score_s < best_s) {
          best_s = score_s;
          best_slot = slot;
          best_degree = degree;
          best_shares_ = choice.shares;
          best_ranks_.resize(degree);
          for (int64_t k = 0; k < degree; ++k) {
            best_ranks_[k] = first_rank + k;
            best_shares_[k].rank = first_rank + k;
          }
        }
      });
    }
    finish_relocation(anchor);
  }
  if (best_slot < 0) return false;
  --relocations_left_;
  remove_anchor_shares(s, best_slot);
  AnchorPlacement& anchor = s->anchors[best_slot];
  anchor.shape = shape_at(anchor.sequence, best_degree).shape;
  anchor.ranks = best_ranks_;
  anchor.shares = best_shares_;
  add_anchor_shares(s, best_slot);
  return true;
}

void ZelligePlanner::prepare_relocation(const Solution& s, const AnchorPlacement& anchor) {
  if (old_position_.empty()) old_position_.assign(num_ranks_, -1);
  vacated_s_.clear();
  for (size_t k = 0; k < anchor.shares.size(); ++k) {
    const RankShare& share = anchor.shares[k];
    old_position_[share.rank] = static_cast<int32_t>(k);
    // As price_change sums a rank's deltas: from zero, the old share subtracted.
    const int64_t delta_tokens = 0 - share.tokens;
    const double delta_other_s = 0.0 - (share.attention_s + share.exchange_s);
    vacated_s_.push_back({share.rank, time_with(s, share.rank, delta_tokens, delta_other_s)});
  }
  std::sort(vacated_s_.begin(), vacated_s_.end());
  const size_t count = vacated_s_.size();
  vacated_prefix_max_s_.assign(count + 1, 0.0);
  vacated_suffix_max_s_.assign(count + 1, 0.0);
  for (size_t k = 0; k < count; ++k) {
    vacated_prefix_max_s_[k + 1] = std::max(vacated_prefix_max_s_[k], vacated_s_[k].second);
  }
  for (size_t k = count; k-- > 0;) {
    vacated_suffix_max_s_[k] = std::max(vacated_suffix_max_s_[k + 1], vacated_s_[k].second);
  }
}

void ZelligePlanner::finish_relocation(const AnchorPlacement& anchor) {
  for (const RankShare& share : anchor.shares) old_position_[share.rank] = -1;
}
double ZelligePlanner::vacated_outside_s(int64_t first_rank, int64_t end_rank) const {
  const auto below = std::lower_bound(vacated_s_.begin(), vacated_s_.end(),
                                      std::pair<int64_t, double>{first_rank, -kInf});
  const auto above = std::lower_bound(vacated_s_.begin(), vacated_s_.end(),
                                      std::pair<int64_t, double>{end_rank, -kInf});
  return std::max(vacated_prefix_max_s_[below - vacated_s_.begin()],
                  vacated_suffix_max_s_[above - vacated_s_.begin()]);
}


double ZelligePlanner::relocation_price(const Solution& s, const AnchorPlacement& anchor,
                                        const std::vector<RankShare>& new_shares,
                                        int64_t first_rank, double above_s) {
  // The anchor's ranks outside the window only lose its share: the most loaded of them, from
  // the maxima left and right of the window (ranks by id).
  const int64_t end_rank = first_rank + static_cast<int64_t>(new_shares.size());
  double score_s = vacated_outside_s(first_rank, end_rank);
  for (size_t k = 0; k < new_shares.size(); ++k) {
    if (score_s >= above_s) return score_s;
    const RankShare& share = new_shares[k];
    const int64_t rank = first_rank + static_cast<int64_t>(k);
    const int32_t position = old_position_[rank];
    int64_t delta_tokens = 0;
    double delta_other_s = 0, delta_bytes = 0;
    if (position >= 0) {
      const RankShare& old = anchor.shares[position];
      delta_tokens -= old.tokens;
      delta_other_s += -1.0 * (old.attention_s + old.exchange_s);
      delta_bytes += -1.0 * old.memory_bytes;
    }
    delta_tokens += share.tokens;
    delta_other_s += share.attention_s + share.exchange_s;
    delta_bytes += share.memory_bytes;
    if (delta_bytes > 0 && s.memory_bytes[rank] + delta_bytes > free_bytes(rank)) return kInf;
    score_s = std::max(score_s, time_with(s, rank, delta_tokens, delta_other_s));
  }
  return score_s;
}
double ZelligePlanner::relocation_floor(const Solution& s, const AnchorPlacement& anchor,
                                        int64_t share_tokens, int64_t first_rank, int64_t degree,
                                        double above_s) const {
  double score_s = vacated_outside_s(first_rank, first_rank + degree);
  for (int64_t k = 0; k < degree; ++k) {
    if (score_s >= above_s) return score_s;
    const int64_t rank = first_rank + k;
    const int32_t position = old_position_[rank];
    int64_t delta_tokens = 0;
    double delta_other_s = 0;
    if (position >= 0) {
      const RankShare& old = anchor.shares[position];
      delta_tokens -= old.tokens;
      delta_other_s += -1.0 * (old.attention_s + old.exchange_s);
    }
    delta_tokens += share_tokens;
    score_s = std::max(score_s, time_with(s, rank, delta_tokens, delta_other_s));
  }
  return score_s;
}


// An anchor of the busiest rank and another anchor, both put on the union of their rank sets in
// the best shape of that degree (what KnapFormer's bags do for a few huge sequences: the two share
// every rank instead of each keeping its own, so a rank left idle by one is used by the other).
// Partners: the anchors of the least-loaded ranks and those sharing a rank with it.
bool ZelligePlanner::try_pair(Solution* s, int64_t busiest) {
  if (s->rank_anchors[busiest].empty() || relocations_left_ <= 0) return false;
  const double bound_s = s->time_s[busiest] * (1 - kMinGain);
  double best_s = bound_s;
  int32_t best_first = -1, best_second = -1;
  for (int32_t first : s->rank_anchors[busiest]) {
    const AnchorPlacement& a = s->anchors[first];
    partner_slots_.clear();
    for (int64_t rank : a.ranks) member_[rank] = 1;
    least_loaded(*s, kRemouldPartners, &member_, &low_ranks_);
    for (int64_t rank : a.ranks) member_[rank] = 0;
    // The kPairPartners lowest distinct slots: anchors over many ranks list each partner once
    // per shared rank, so duplicates are marked off rather than sorted away.
    slot_seen_.resize(s->anchors.size(), 0);
    slot_seen_[first] = 1;
    auto add_partners = [&](int64_t rank) {
      for (int32_t slot : s->rank_anchors[rank]) {
        if (slot_seen_[slot] == 0) partner_slots_.push_back(slot);
        slot_seen_[slot] = 1;
      }
    };
    for (int64_t rank : low_ranks_) add_partners(rank);
    for (int64_t rank : a.ranks) add_partners(rank);
    slot_seen_[first] = 0;
    for (int32_t slot : partner_slots_) slot_seen_[slot] = 0;
    const size_t kept = std::min(partner_slots_.size(), kPairPartners);
    std::partial_sort(partner_slots_.begin(), partner_slots_.begin() + kept, partner_slots_.end());
    partner_slots_.resize(kept);
    for (int32_t second : partner_slots_) {
      const AnchorPlacement& b = s->anchors[second];
      candidate_ranks_ = a.ranks;
      candidate_ranks_.insert(candidate_ranks_.end(), b.ranks.begin(), b.ranks.end());
      sort_ranks(&candidate_ranks_);
      candidate_ranks_.erase(std::unique(candidate_ranks_.begin(), candidate_ranks_.end()),
                             candidate_ranks_.end());
      const int64_t degree = static_cast<int64_t>(candidate_ranks_.size());
      if (degree == a.shape.degree && degree == b.shape.degree) continue;  // the same ranks
      const ShapeChoice& choice_a = shape_at(a.sequence, degree);
      const ShapeChoice& choice_b = shape_at(b.sequence, degree);
      if (!choice_a.feasible || !choice_b.feasible) continue;
      const Sequence& seq_a = batch_.sequences[a.sequence];
      const Sequence& seq_b = batch_.sequences[b.sequence];
      place_shares(small_shares(seq_a, choice_a.shape, candidate_ranks_), candidate_ranks_,
                   &pair_new_);
      const size_t split = pair_new_.size();
      const std::vector<RankShare>& shares_b =
          small_shares(seq_b, choice_b.shape, candidate_ranks_);
      pair_new_.insert(pair_new_.end(), shares_b.begin(), shares_b.end());
      for (size_t k = 0; k < shares_b.size(); ++k) pair_new_[split + k].rank = candidate_ranks_[k];
      pair_old_ = a.shares;
      pair_old_.insert(pair_old_.end(), b.shares.begin(), b.shares.end());
      const double score_s = price_change(*s, pair_old_, pair_new_, best_s);
      if (score_s < best_s) {
        best_s = score_s;
        best_first = first;
        best_second = second;
        best_ranks_ = candidate_ranks_;
        best_shares_.assign(pair_new_.begin(), pair_new_.begin() + split);
        best_pair_shares_.assign(pair_new_.begin() + split, pair_new_.end());
      }
    }
  }
  if (best_first < 0) return false;
  --relocations_left_;
  const int64_t degree = static_cast<int64_t>(best_ranks_.size());
  remove_anchor_shares(s, best_first);
  remove_anchor_shares(s, best_second);
  for (const auto& [slot, shares] :
       {std::pair<int32_t, std::vector<RankShare>*>{best_first, &best_shares_},
        std::pair<int32_t, std::vector<RankShare>*>{best_second, &best_pair_shares_}}) {
    AnchorPlacement& anchor = s->anchors[slot];
    anchor.shape = shape_at(anchor.sequence, degree).shape;
    anchor.ranks = best_ranks_;
    anchor.shares = *shares;
    add_anchor_shares(s, slot);
  }
  return true;
}

// The grouped start: every sequence whole, each distinct length on a block of ranks of its own
// (ranks in proportion to its estimated load, largest remainders, at least one), its sequences
// dealt round-robin over the block. A rank then holds one length: its attention runs as one call
// per kind, where a balanced plan mixes every length on every rank and each is a call of its own
// (the launch floor binds when a rank holds many short sequences). False when lengths outnumber
// the ranks, ranks are unlike, or a rank would run out of memory.
bool ZelligePlanner::grouped_start(Plan* plan) {
  const int64_t num_keys = static_cast<int64_t>(shape_key_counts_.size());
  if (num_keys == 0 || num_keys > num_ranks_ || !speeds_.empty() || !rank_free_bytes_.empty()) {
    return false;
  }
  std::vector<double> load_s(num_keys), quota(num_keys);
  std::vector<int64_t> block_ranks(num_keys), key_index(num_sequences_);
  std::unordered_map<int32_t, int64_t> index_of_key;
  for (int64_t k = 0; k < num_keys; ++k) {
    const auto [first, count] = shape_key_counts_[k];
    index_of_key[first] = k;
    load_s[k] = local_estimate_s_[first] * static_cast<double>(count);
  }
  const double total_s = std::accumulate(load_s.begin(), load_s.end(), 0.0);
  if (!(total_s > 0)) return false;
  int64_t allotted = 0;
  for (int64_t k = 0; k < num_keys; ++k) {
    quota[k] = static_cast<double>(num_ranks_) * load_s[k] / total_s;
    block_ranks[k] = std::max<int64_t>(1, static_cast<int64_t>(quota[k]));
    allotted += block_ranks[k];
  }
  // Largest remainders up to the rank count, then back down from the most over its quota.
  while (allotted < num_ranks_) {
    int64_t best = 0;
    for (int64_t k = 1; k < num_keys; ++k) {
      if (quota[k] - block_ranks[k] > quota[best] - block_ranks[best]) best = k;
    }
    ++block_ranks[best];
    ++allotted;
  }
  while (allotted > num_ranks_) {
    int64_t best = -1;
    for (int64_t k = 0; k < num_keys; ++k) {
      if (block_ranks[k] > 1 &&
          (best < 0 || block_ranks[k] - quota[k] > block_ranks[best] - quota[best])) {
        best = k;
      }
    }
    --block_ranks[best];
    --allotted;
  }
  std::vector<int64_t> first_rank(num_keys), dealt(num_keys, 0);
  for (int64_t k = 1; k < num_keys; ++k) first_rank[k] = first_rank[k - 1] + block_ranks[k - 1];
  for (int64_t k = 0; k < num_keys; ++k) {
    const auto [first, count] = shape_key_counts_[k];
    const int64_t per_rank = (count + block_ranks[k] - 1) / block_ranks[k];
    if (static_cast<double>(per_rank) * local_memory_bytes_[first] > free_bytes_) return false;
  }
  plan->num_ranks = num_ranks_;
  plan->placements.clear();
  plan->placements.reserve(num_sequences_);
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const int64_t k = index_of_key.at(shape_key_[i]);
    const int64_t rank = first_rank[k] + dealt[k]++ % block_ranks[k];
    plan->placements.push_back(
        make_placement(batch_.sequences[i].id, Strategy::kLocal, {rank}));
  }
  return true;
}

// A starting point of aligned bags (what the best known plans of a few huge sequences look like:
// a few windows of 4 to 16 ranks, each holding several long videos over all of its ranks). The
// long sequences (at least kBagItemFraction of the mean load per rank, or too large for one rank)
// go whole to bags, each in the best shape of its bag's size, longest first to the bag that ends
// earliest (LPT), or to a run of up to `max_run` neighbouring bags when that ends earlier; the
// rest go whole to the least-loaded rank. The bags: from every uniform
// partition (half a node to four nodes), bags are split in halves or two neighbours merged while
// that lowers the busiest bag, taking the best such change each step, over every bag or
// (`busiest_only`) the busiest one. Estimates only (shape_at's busiest share): the plan is
// searched and priced exactly like every other start. False when the batch has fewer than two
// long sequences, more than half as many as ranks, more sequences than ranks (recipes of many
// images and clips: there the sweep does well and this cost ~10 ms), or the cluster and the
// batch are too large for this to be cheap (kBagWork window trials).
bool ZelligePlanner::bag_start(bool busiest_only, int32_t max_run, Plan* plan) {
  bag_items_.clear();
  for (int32_t sequence : order_) {
    if (local_estimate_s_[sequence] >= kBagItemFraction * mean_load_s_ ||
        local_memory_bytes_[sequence] > free_bytes_) {
      bag_items_.push_back(sequence);
    }
  }
  // Bags pay off when long sequences are few next to the ranks (each gets several); elsewhere
  // the sweep and the baselines' bags already do well, and this would cost planning time.
  // The refinement prices (steps x candidates) partitions, each by LPT over items x bags x runs:
  // only while that stays small (32 GPUs, a dozen long videos: ~1.5 M window trials).
  const int64_t items = static_cast<int64_t>(bag_items_.size());
  const double most_bags = static_cast<double>(num_ranks_) /
                           static_cast<double>(std::max<int64_t>(2, gpus_per_node_ / 2));
  const double steps = static_cast<double>(4 * num_nodes_ + 8);
  const double trials = 4.0 * steps * (2.0 * most_bags) * static_cast<double>(items) *
                        most_bags * static_cast<double>(max_run);
  if (items < 2 || 2 * items > num_ranks_ || num_sequences_ > num_ranks_ || trials > kBagWork) {
    return false;
  }

  struct Bag {
    int64_t first, size;
  };
  // The busiest bag's estimated time under LPT, and each item's window (first bag, bag count):
  // consecutive bags, so that a sequence may also span a few neighbouring bags (a bag's ranks then
  // run it after their own sequences: rank times add up); infinity when an item fits nowhere.
  std::vector<double> load_s, bytes;
  using Window = std::pair<int32_t, int32_t>;
  auto assign = [&](const std::vector<Bag>& bags, std::vector<Window>* of_item) {
    const int32_t num_bags = static_cast<int32_t>(bags.size());
    load_s.assign(num_bags, 0.0);
    bytes.assign(num_bags, 0.0);
    of_item->assign(bag_items_.size(), {-1, 0});
    double busiest_s = 0;
    for (size_t i = 0; i < bag_items_.size(); ++i) {
      Window best{-1, 0};
      double best_s = kInf;
      for (int32_t first = 0; first < num_bags; ++first) {
        int64_t size = 0;
        double start_s = 0, used_bytes = 0;
        for (int32_t count = 1; count <= max_run && first + count <= num_bags; ++count) {
          const int32_t last = first + count - 1;
          size += bags[last].size;
          start_s = std::max(start_s, load_s[last]);
          used_bytes = std::max(used_bytes, bytes[last]);
          const ShapeChoice& choice = shape_at(bag_items_[i], size);
          if (!choice.feasible || used_bytes + choice.memory_bytes > free_bytes_) continue;
          const double end_s = start_s + choice.time_s;
          if (end_s < best_s) {
            best_s = end_s;
            best = {first, count};
          }
        }
      }
      if (best.first < 0) return kInf;
      (*of_item)[i] = best;
      int64_t size = 0;
      for (int32_t b = best.first; b < best.first + best.second; ++b) size += bags[b].size;
      const ShapeChoice& choice = shape_at(bag_items_[i], size);
      for (int32_t b = best.first; b < best.first + best.second; ++b) {
        load_s[b] += choice.time_s;
        bytes[b] += choice.memory_bytes;
        busiest_s = std::max(busiest_s, load_s[b]);
      }
    }
    return busiest_s;
  };
  std::vector<Bag> best_bags;
  double best_s = kInf;
  std::vector<Window> of_item;
  for (int64_t size : {gpus_per_node_ / 2, gpus_per_node_, 2 * gpus_per_node_,
                       4 * gpus_per_node_}) {
    if (size < 2 || size > num_ranks_ || num_ranks_ % size != 0) continue;
    std::vector<Bag> bags;
    for (int64_t first = 0; first < num_ranks_; first += size) bags.push_back({first, size});
    double bags_s = assign(bags, &of_item);
    for (int64_t step = 0; step < 4 * num_nodes_ + 8 && std::isfinite(bags_s); ++step) {
      // Every bag (or the busiest only) split in halves or merged with its next neighbour
      // (the busiest: with either neighbour).
      std::vector<std::vector<Bag>> candidates;
      const size_t busiest = static_cast<size_t>(
          std::max_element(load_s.begin(), load_s.end()) - load_s.begin());
      if (busiest_only && busiest > 0) {
        std::vector<Bag> merged = bags;
        merged[busiest - 1] = {bags[busiest - 1].first,
                               bags[busiest - 1].size + bags[busiest].size};
        merged.erase(merged.begin() + static_cast<int64_t>(busiest));
        candidates.push_back(std::move(merged));
      }
      for (size_t b = 0; b < bags.size(); ++b) {
        if (busiest_only && b != busiest) continue;
        const Bag bag = bags[b];
        if (bag.size % 2 == 0) {
          std::vector<Bag> split = bags;
          split[b] = {bag.first, bag.size / 2};
          split.insert(split.begin() + static_cast<int64_t>(b) + 1,
                       Bag{bag.first + bag.size / 2, bag.size / 2});
          candidates.push_back(std::move(split));
        }
        if (b + 1 < bags.size()) {
          std::vector<Bag> merged = bags;
          merged[b] = {bag.first, bag.size + bags[b + 1].size};
          merged.erase(merged.begin() + static_cast<int64_t>(b) + 1);
          candidates.push_back(std::move(merged));
        }
      }
      double step_s = bags_s;
      std::vector<Bag> step_bags;
      for (const std::vector<Bag>& candidate : candidates) {
        const double candidate_s = assign(candidate, &of_item);
        if (candidate_s < step_s * (1 - kMinGain)) {
          step_s = candidate_s;
          step_bags = candidate;
        }
      }
      if (step_bags.empty()) break;
      bags = std::move(step_bags);
      bags_s = assign(bags, &of_item);  // load_s of the accepted partition
    }
    if (bags_s < best_s) {
      best_s = bags_s;
      best_bags = bags;
    }
  }
  if (!std::isfinite(best_s)) return false;

  // The plan: items on their bags, then the rest whole on the least-loaded rank.
  assign(best_bags, &of_item);
  plan->num_ranks = num_ranks_;
  plan->placements.clear();
  rank_load_s_.assign(num_ranks_, 0.0);
  member_.assign(num_ranks_, 0);  // scratch: nothing else uses it between searches
  std::vector<char> is_item(num_sequences_, 0);
  for (size_t i = 0; i < bag_items_.size(); ++i) {
    const int32_t sequence = bag_items_[i];
    is_item[sequence] = 1;
    const Window window = of_item[i];
    const int64_t first_rank = best_bags[window.first].first;
    int64_t size = 0;
    for (int32_t b = window.first; b < window.first + window.second; ++b) {
      size += best_bags[b].size;
    }
    const ShapeChoice& choice = shape_at(sequence, size);
    std::vector<int64_t> ranks(size);
    std::iota(ranks.begin(), ranks.end(), first_rank);
    for (int64_t k = 0; k < size; ++k) {
      rank_load_s_[first_rank + k] += estimate_s(choice.shares[k]);
    }
    plan->placements.push_back(to_placement(batch_.sequences[sequence].id, choice.shape, ranks));
  }
  for (int32_t sequence : order_) {
    if (is_item[sequence]) continue;
    const int64_t rank =
        std::min_element(rank_load_s_.begin(), rank_load_s_.end()) - rank_load_s_.begin();
    rank_load_s_[rank] += local_estimate_s_[sequence];
    plan->placements.push_back(to_placement(batch_.sequences[sequence].id, Shape{}, {rank}));
  }
  return true;
}

// A starting point from the configuration view of a run of equal long sequences (what the best
// known plans of many equal long videos look like: one node holding a window of eight, another two
// of four and some pairs). Nodes are identical, so for a cap T on any window's load,
// node_configurations.h chooses exactly which windows one node holds, how many sequences of the run
// each carries and how many nodes take each configuration, for the least rank-seconds (shape_at's
// estimates on aligned windows). Every cap where the run's window loads change (count x a degree's
// time, up to `upper_s`) is tried; the best estimate of the whole plan (the busiest window, the
// mean load with the rest of the batch, the longest other sequence) is built. The rest go whole,
// longest first, to the least-loaded rank with the memory (or, too large for a rank, to the
// least-loaded aligned window of the smallest degree that fits). The run: the equal lengths with
// the most estimated work among those of at least two sequences of kBagItemFraction of the mean
// load per rank. False when there is none, or the exact solve would cost more than
// kConfigurationWork steps.
bool ZelligePlanner::configuration_start(double upper_s, Plan* plan) {
  int32_t run_key = -1;
  double run_work_s = 0;
  for (const auto& [key, count] : shape_key_counts_) {
    if (count < 2 || local_estimate_s_[key] < kBagItemFraction * mean_load_s_) continue;
    const double work_s = static_cast<double>(count) * local_estimate_s_[key];
    if (work_s > run_work_s) {
      run_work_s = work_s;
      run_key = key;
    }
  }
  // Only where the run is much of the batch's work (on the recipes' bucketed batches, equal
  // lengths are common but no such run decides the plan, and the extra search would cost ~1 ms at
  // 32 GPUs).
  if (run_key < 0 || !std::isfinite(upper_s) ||
      run_work_s < kConfigurationRunShare * mean_load_s_ * static_cast<double>(num_ranks_)) {
    return false;
  }
  std::vector<int32_t> run;
  for (int32_t sequence : order_) {
    if (shape_key_[sequence] == run_key) run.push_back(sequence);
  }
  const int64_t k = static_cast<int64_t>(run.size());
  planners::RunShapes shapes;
  shapes.time_s.assign(gpus_per_node_ + 1, kInf);
  shapes.rank_seconds.assign(gpus_per_node_ + 1, kInf);
  shapes.memory_bytes.assign(gpus_per_node_ + 1, 0.0);
  std::vector<double> caps_s;
  for (int64_t degree = 1; degree <= std::min(gpus_per_node_, num_ranks_); ++degree) {
    const ShapeChoice& choice = shape_at(run_key, degree);
    if (!choice.feasible) continue;
    shapes.time_s[degree] = choice.time_s;
    shapes.rank_seconds[degree] = choice.rank_seconds;
    shapes.memory_bytes[degree] = choice.memory_bytes;
    for (int64_t count = 1; count <= k; ++count) {
      const double cap_s = static_cast<double>(count) * choice.time_s;
      if (cap_s > upper_s) break;
      caps_s.push_back(cap_s);
    }
  }
  std::sort(caps_s.begin(), caps_s.end());
  caps_s.erase(std::unique(caps_s.begin(), caps_s.end()), caps_s.end());
  const double work = static_cast<double>(caps_s.size()) * static_cast<double>(num_nodes_) *
                      static_cast<double>(k) * static_cast<double>(k);
  if (caps_s.empty() || work > kConfigurationWork) return false;

  // The rest of the batch: its rank-seconds and its longest whole sequence.
  double rest_s = 0, longest_rest_s = 0;
  for (int32_t sequence : order_) {
    if (shape_key_[sequence] == run_key) continue;
    rest_s += local_estimate_s_[sequence];
    if (local_memory_bytes_[sequence] <= free_bytes_) {
      longest_rest_s = std::max(longest_rest_s, local_estimate_s_[sequence]);
    }
  }
  planners::ConfigurationChoice best;
  double best_s = kInf;
  for (double cap_s : caps_s) {
    planners::ConfigurationChoice choice = planners::solve_node_configurations(
        shapes, gpus_per_node_, num_nodes_, k, cap_s, free_bytes_);
    if (!choice.feasible) continue;
    double busiest_s = 0;
    for (const planners::NodeConfiguration& configuration : choice.configurations) {
      for (const planners::WindowUse& window : configuration.windows) {
        busiest_s = std::max(busiest_s,
                             static_cast<double>(window.count) * shapes.time_s[window.degree]);
      }
    }
    const double estimate_s =
        std::max({busiest_s, longest_rest_s,
                  (choice.rank_seconds + rest_s) / static_cast<double>(num_ranks_)});
    if (estimate_s < best_s * (1 - kMinGain)) {
      best_s = estimate_s;
      best = std::move(choice);
    }
  }
  // The estimate is about a relaxation of the plan (mean load, no packing): one that does not
  // even beat the sweep's plan is no start worth a search.
  if (!(best_s < upper_s)) return false;

  // The run on its windows, node by node, each node's windows largest first from its first rank.
  plan->num_ranks = num_ranks_;
  plan->placements.clear();
  rank_load_s_.assign(num_ranks_, 0.0);
  std::vector<double> rank_bytes(num_ranks_, 0.0);
  size_t next = 0;
  int64_t node = 0;
  std::vector<int64_t> ranks;
  auto place = [&](int32_t sequence, int64_t degree, int64_t first_rank) {
    const ShapeChoice& choice = shape_at(sequence, degree);
    ranks.resize(degree);
    std::iota(ranks.begin(), ranks.end(), first_rank);
    for (int64_t j = 0; j < degree; ++j) {
      rank_load_s_[first_rank + j] += estimate_s(choice.shares[j]);
      rank_bytes[first_rank + j] += choice.shares[j].memory_bytes;
    }
    plan->placements.push_back(to_placement(batch_.sequences[sequence].id, choice.shape, ranks));
  };
  for (const planners::NodeConfiguration& configuration : best.configurations) {
    for (int64_t copy = 0; copy < configuration.nodes; ++copy, ++node) {
      int64_t first_rank = node * gpus_per_node_;
      for (const planners::WindowUse& window : configuration.windows) {
        for (int64_t c = 0; c < window.count; ++c) place(run[next++], window.degree, first_rank);
        first_rank += window.degree;
      }
    }
  }
  // The rest, longest first.
  for (int32_t sequence : order_) {
    if (shape_key_[sequence] == run_key) continue;
    if (local_memory_bytes_[sequence] <= most_free_bytes_) {
      int64_t target = -1;
      for (int64_t rank = 0; rank < num_ranks_; ++rank) {
        if (rank_bytes[rank] + local_memory_bytes_[sequence] > free_bytes(rank)) continue;
        if (target < 0 || rank_load_s_[rank] < rank_load_s_[target]) target = rank;
      }
      if (target >= 0) {
        rank_load_s_[target] += local_estimate_s_[sequence];
        rank_bytes[target] += local_memory_bytes_[sequence];
        plan->placements.push_back(
            to_placement(batch_.sequences[sequence].id, Shape{}, {target}));
        continue;
      }
    }
    // Sharded: the smallest degree with a window whose ranks have the memory, on the window
    // (aligned inside a node, whole nodes beyond) that would end earliest.
    bool placed = false;
    for (int64_t degree = 2; degree <= num_ranks_ && !placed;
         degree = next_window_degree(degree, gpus_per_node_)) {
      const ShapeChoice& choice = shape_at(sequence, degree);
      if (!choice.feasible) continue;
      int64_t best_first = -1;
      double best_end_s = kInf;
      const int64_t step = degree <= gpus_per_node_ ? degree : gpus_per_node_;
      for (int64_t first = 0; first + degree <= num_ranks_; first += step) {
        if (degree <= gpus_per_node_ && node_of(first) != node_of(first + degree - 1)) continue;
        double end_s = 0;
        bool fits = true;
        for (int64_t j = 0; j < degree && fits; ++j) {
          fits = rank_bytes[first + j] + choice.shares[j].memory_bytes <= free_bytes(first + j);
          end_s = std::max(end_s, rank_load_s_[first + j] + estimate_s(choice.shares[j]));
        }
        if (fits && end_s < best_end_s) {
          best_end_s = end_s;
          best_first = first;
        }
      }
      if (best_first >= 0) {
        place(sequence, degree, best_first);
        placed = true;
      }
    }
    if (!placed) return false;
  }
  return true;
}

// An equal-makespan step taken when no move lowers the busiest rank: a whole sequence of the rank
// holding the most bytes moves to one of the kMemoryPartners ranks holding the least, where it
// raises no rank's time above the makespan and lowers the larger of the two ranks' bytes. The
// makespan stays (or falls), the secondary objective falls: the ranks' bytes, sorted from the
// fullest down, compared lexicographically; so these steps cannot cycle among themselves, and
// local_search caps them at kMemorySteps. Why memory: the search sizes memory as if every layer
// were recomputed whole but times selective checkpointing; evaluate() recomputes attention too on
// ranks whose kept activations do not fit, so on memory-tight batches the fullest rank's bytes cost
// exact time that the search does not see (and the final comparison prefers the lower peak among
// plans of about the same makespan).
bool ZelligePlanner::try_lower_memory(Solution* s) {
  const int64_t fullest =
      std::max_element(s->memory_bytes.begin(), s->memory_bytes.end()) - s->memory_bytes.begin();
  if (s->rank_fillers[fullest].empty()) return false;
  const double makespan_s = *std::max_element(s->time_s.begin(), s->time_s.end());
  memory_ranks_.resize(num_ranks_);
  std::iota(memory_ranks_.begin(), memory_ranks_.end(), 0);
  const size_t count = std::min<size_t>(kMemoryPartners + 1, memory_ranks_.size());
  std::partial_sort(memory_ranks_.begin(), memory_ranks_.begin() + count, memory_ranks_.end(),
                    [&](int64_t a, int64_t b) {
                      return s->memory_bytes[a] < s->memory_bytes[b] ||
                             (s->memory_bytes[a] == s->memory_bytes[b] && a < b);
                    });
  memory_ranks_.resize(count);
  double best_bytes = s->memory_bytes[fullest] * (1 - kMinGain);
  int32_t best_sequence = -1;
  int64_t best_rank = -1;
  for (int32_t sequence : s->rank_fillers[fullest]) {
    const double bytes = local_memory_bytes_[sequence];
    const double left_bytes = s->memory_bytes[fullest] - bytes;
    for (int64_t rank : memory_ranks_) {
      if (rank == fullest) continue;
      const double score_bytes = std::max(left_bytes, s->memory_bytes[rank] + bytes);
      if (score_bytes >= best_bytes || s->memory_bytes[rank] + bytes > free_bytes(rank)) continue;
      if (time_with(*s, rank, local_tokens_[sequence], local_other_s_[sequence]) > makespan_s) {
        continue;
      }
      best_bytes = score_bytes;
      best_sequence = sequence;
      best_rank = rank;
    }
  }
  if (best_sequence < 0) return false;
  remove_filler(s, best_sequence);
  add_filler(s, best_sequence, best_rank);
  return true;
}


}  // namespace zellige::planners::zellige_detail
