// The zellige planner's local search: move, swap, re-mould and promote at the busiest rank, each
// priced from the ranks' totals (zellige_moves.cc holds the whole-anchor moves).
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

// At most this many shares are kept by wide_shares (a few hundred MB at 4096 ranks' patterns).
constexpr int64_t kWideSharesHeld = int64_t{1} << 22;

const std::vector<RankShare>& ZelligePlanner::wide_shares(const Sequence& sequence,
                                                          const Shape& shape,
                                                          const std::vector<int64_t>& ranks) {
  const size_t degree = ranks.size();
  wide_key_.assign({sequence.num_tokens, sequence.text_tokens, static_cast<int64_t>(shape.strategy),
                    shape.ulysses_degree});
  // Position k's node as the first position on that node: the same for rank sets whose
  // positions share nodes alike, whichever nodes they are. Kept run-length encoded (positions in
  // a row on one node, then that node's first position): ranks come mostly sorted, so a key holds
  // a pair per node rather than an entry per rank.
  if (node_first_position_.empty()) node_first_position_.assign(num_nodes_, -1);
  // One division per run, not per rank: a run extends while its ranks stay in the node's range.
  key_nodes_.clear();
  for (size_t k = 0; k < degree;) {
    const int64_t node = node_of(ranks[k]);
    const int64_t node_first = node * gpus_per_node_, node_end = node_first + gpus_per_node_;
    size_t end = k + 1;
    while (end < degree && ranks[end] >= node_first && ranks[end] < node_end) {
      ++end;
    }
    int64_t& first = node_first_position_[node];
    if (first < 0) {
      first = static_cast<int64_t>(k);
      key_nodes_.push_back(node);
    }
    wide_key_.push_back(static_cast<int64_t>(end - k));
    wide_key_.push_back(first);
    k = end;
  }
  for (int64_t node : key_nodes_) node_first_position_[node] = -1;
  const auto found = wide_shares_.find(wide_key_);
  if (found != wide_shares_.end()) {
    assert(found->second.size() == degree);
    return found->second;
  }
  std::vector<RankShare> shares =
      cost_model_.shares(sequence, to_placement(sequence.id, shape, ranks));
  if (wide_shares_held_ + static_cast<int64_t>(degree) <= kWideSharesHeld) {
    wide_shares_held_ += static_cast<int64_t>(degree);
    return wide_shares_.emplace(wide_key_, std::move(shares)).first->second;
  }
  shares_scratch_ = std::move(shares);
  return shares_scratch_;
}

// The `count` least-loaded ranks (by time, then id), skipping ranks marked in `excluded`.
void ZelligePlanner::least_loaded(const Solution& s, int count, const std::vector<char>* excluded,
                                  std::vector<int64_t>* ranks) const {
  ranks->clear();
  if (&s == searched_ && num_ranks_ > kScanRanks) {
    // The least ranks one by one from the tree (each set aside at infinity, then restored): the
    // same ranks in the same (time, id) order as the scan below.
    popped_ranks_.clear();
    while (static_cast<int>(ranks->size()) < count) {
      const int64_t rank = least_time_.argmin();
      if (least_time_.value(rank) == kInf) break;
      popped_ranks_.push_back(rank);
      least_time_.update(rank, kInf);
      if (!excluded || !(*excluded)[rank]) ranks->push_back(rank);
    }
    for (int64_t rank : popped_ranks_) least_time_.update(rank, s.time_s[rank]);
    return;
  }
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

const std::vector<int32_t>& ZelligePlanner::fillers_by_key(const Solution& s, int64_t rank) {
  key_seen_.resize(num_sequences_, 0);
  fillers_by_key_.clear();
  for (int32_t sequence : s.rank_fillers[rank]) {
    char& seen = key_seen_[shape_key_[sequence]];
    if (seen == 0) fillers_by_key_.push_back(sequence);
    seen = 1;
  }
  for (int32_t sequence : fillers_by_key_) key_seen_[shape_key_[sequence]] = 0;
  return fillers_by_key_;
}

bool ZelligePlanner::try_move(Solution* s, int64_t busiest) {
  member_[busiest] = 1;
  least_loaded(*s, kMovePartners, &member_, &low_ranks_);
  member_[busiest] = 0;
  const double bound_s = s->time_s[busiest] * (1 - kMinGain);
  double best_s = bound_s;
  int32_t best_sequence = -1;
  int64_t best_rank = -1;
  for (int32_t sequence : fillers_by_key(*s, busiest)) {
    const int64_t tokens = local_tokens_[sequence];
    const double other_s = local_other_s_[sequence];
    const double left_s = time_with(*s, busiest, -tokens, -other_s);
    if (left_s >= best_s) continue;
    for (int64_t rank : low_ranks_) {
      if (s->memory_bytes[rank] + local_memory_bytes_[sequence] > free_bytes(rank)) continue;
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
  const std::vector<int32_t>& outs = fillers_by_key(*s, busiest);
  for (int64_t rank : low_ranks_) {
    const double gap_s = s->time_s[busiest] - s->time_s[rank];
    if (gap_s <= 0) continue;
    partner_fillers_.clear();
    for (int32_t sequence : s->rank_fillers[rank]) {
      partner_fillers_.push_back({local_estimate_s_[sequence], sequence});
    }
    if (partner_fillers_.empty()) continue;
    std::sort(partner_fillers_.begin(), partner_fillers_.end());
    for (int32_t out : outs) {
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
        if (s->memory_bytes[busiest] + delta_bytes > free_bytes(busiest) ||
            s->memory_bytes[rank] - delta_bytes > free_bytes(rank)) {
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
                                    const std::vector<RankShare>& new_shares, double above_s,
                                    const std::vector<int64_t>* new_ranks) {
  touched_.clear();
  auto touch = [&](const RankShare& share, int64_t rank, double sign) {
    if (delta_tokens_[rank] == 0 && delta_other_s_[rank] == 0 && delta_memory_bytes_[rank] == 0) {
      touched_.push_back(rank);
    }
    delta_tokens_[rank] += static_cast<int64_t>(sign) * share.tokens;
    delta_other_s_[rank] += sign * (share.attention_s + share.exchange_s);
    delta_memory_bytes_[rank] += sign * share.memory_bytes;
  };
  for (const RankShare& share : old_shares) touch(share, share.rank, -1);
  for (size_t k = 0; k < new_shares.size(); ++k) {
    touch(new_shares[k], new_ranks ? (*new_ranks)[k] : new_shares[k].rank, +1);
  }
  double score_s = 0;
  for (int64_t rank : touched_) {
    if (score_s >= above_s) break;
    if (delta_memory_bytes_[rank] > 0 &&
        s.memory_bytes[rank] + delta_memory_bytes_[rank] > free_bytes(rank)) {
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

double ZelligePlanner::rank_time_after(const Solution& s, int64_t rank,
                                       const std::vector<RankShare>& old_shares,
                                       const std::vector<RankShare>& new_shares,
                                       const std::vector<int64_t>& new_ranks) const {
  int64_t delta_tokens = 0;
  double delta_other_s = 0;
  for (const RankShare& share : old_shares) {
    if (share.rank != rank) continue;
    delta_tokens -= share.tokens;
    delta_other_s += -1.0 * (share.attention_s + share.exchange_s);
  }
  for (size_t k = 0; k < new_shares.size(); ++k) {
    if (new_ranks[k] != rank) continue;
    delta_tokens += new_shares[k].tokens;
    delta_other_s += new_shares[k].attention_s + new_shares[k].exchange_s;
  }
  return time_with(s, rank, delta_tokens, delta_other_s);
}

const std::vector<int32_t>& ZelligePlanner::searched_anchors(const Solution& s, int64_t busiest) {
  const std::vector<int32_t>& slots = s.rank_anchors[busiest];
  searched_slots_.clear();
  if (slots.size() <= kSearchAnchors) {
    searched_slots_.assign(slots.begin(), slots.end());
  } else {
    anchor_shares_s_.clear();
    for (int32_t slot : slots) {
      for (const RankShare& share : s.anchors[slot].shares) {
        if (share.rank == busiest) anchor_shares_s_.push_back({-estimate_s(share), slot});
      }
    }
    std::partial_sort(anchor_shares_s_.begin(), anchor_shares_s_.begin() + kSearchAnchors,
                      anchor_shares_s_.end());
    for (size_t k = 0; k < kSearchAnchors; ++k) {
      searched_slots_.push_back(anchor_shares_s_[k].second);
    }
  }
  // An anchor of the same lengths, shape and ranks as one before it prices every move alike, so
  // it never beats that one (moves must be strictly better): tried once (many equal clips or
  // images over the same ranks).
  auto alike = [&](int32_t a, int32_t b) {
    const AnchorPlacement& x = s.anchors[a];
    const AnchorPlacement& y = s.anchors[b];
    return shape_key_[x.sequence] == shape_key_[y.sequence] &&
           x.shape.strategy == y.shape.strategy &&
           x.shape.ulysses_degree == y.shape.ulysses_degree && x.ranks == y.ranks;
  };
  size_t kept = 0;
  for (size_t k = 0; k < searched_slots_.size(); ++k) {
    bool seen = false;
    for (size_t j = 0; j < kept && !seen; ++j) seen = alike(searched_slots_[j], searched_slots_[k]);
    if (!seen) searched_slots_[kept++] = searched_slots_[k];
  }
  searched_slots_.resize(kept);
  return searched_slots_;
}

bool ZelligePlanner::try_remould(Solution* s, int64_t busiest) {
  const double bound_s = s->time_s[busiest] * (1 - kMinGain);
  double best_s = bound_s;
  int32_t best_slot = -1;
  Shape best_shape;
  for (int32_t slot : searched_anchors(*s, busiest)) {
    const AnchorPlacement& anchor = s->anchors[slot];
    const Sequence& sequence = batch_.sequences[anchor.sequence];
    const int64_t degree = anchor.shape.degree;
    auto consider = [&](const Shape& shape, const std::vector<int64_t>& ranks) {
      const std::vector<RankShare>& shares = small_shares(sequence, shape, ranks);
      // The busiest rank first: most changes keep it at or above the best, and then no other
      // rank needs pricing.
      if (rank_time_after(*s, busiest, anchor.shares, shares, ranks) >= best_s) return;
      const double score_s = price_change(*s, anchor.shares, shares, best_s, &ranks);
      if (score_s < best_s) {
        best_s = score_s;
        best_slot = slot;
        best_shape = shape;
        best_ranks_ = ranks;
        place_shares(shares, ranks, &best_shares_);
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
        const std::vector<RankShare>& shares = small_shares(seq, shape, candidate_ranks_);
        const double score_s = price_change(*s, old_shares, shares, best_s, &candidate_ranks_);
        if (score_s < best_s) {
          best_s = score_s;
          best_sequence = sequence;
          best_shape = shape;
          best_ranks_ = candidate_ranks_;
          place_shares(shares, candidate_ranks_, &best_shares_);
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
  least_time_.reset(s->time_s);
  negated_s_.resize(num_ranks_);
  for (int64_t rank = 0; rank < num_ranks_; ++rank) negated_s_[rank] = -s->time_s[rank];
  most_time_.reset(negated_s_);
  searched_ = s;
  for (; step < max_steps; ++step) {
    if ((step & 15) == 15 && Clock::now() > deadline) break;
    const int64_t busiest = most_time_.argmin();  // the lowest rank of the greatest time
    if (try_move(s, busiest) || try_swap(s, busiest) || try_remould(s, busiest) ||
        try_promote(s, busiest) || try_relocate(s, busiest) || try_pair(s, busiest)) {
      continue;
    }
    if (memory_steps_left <= 0 || !try_lower_memory(s)) break;
    --memory_steps_left;
  }
  searched_ = nullptr;
  finish(s);
  return step;
}


}  // namespace zellige::planners::zellige_detail
