// Local-search moves of whole anchors (issue 15, item 2): an anchor of the busiest rank moved to
// an aligned window of any degree, and two anchors put together on the union of their ranks.
//
// Internal to zellige.cc: it includes this file once, inside its anonymous namespace after
// ZelligePlanner's definition, so these are ZelligePlanner's own members (the planner keeps its
// state private to that file). Both moves run only where the cheaper moves found nothing (the
// busiest rank is at a local optimum of move / swap / re-mould / promote) and, like them, must
// lower the busiest rank's time without raising any rank they touch above it.
#pragma once

// The `count` nodes whose ranks' summed time is least, then the nodes of `anchor`'s ranks.
void ZelligePlanner::window_nodes(const Solution& s, const AnchorPlacement& anchor, int count,
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
  for (int32_t slot : s->rank_anchors[busiest]) {
    const AnchorPlacement& anchor = s->anchors[slot];
    window_nodes(*s, anchor, kWindowNodes, &window_nodes_);
    const int64_t max_degree =
        std::min(num_ranks_, std::max(2 * anchor.shape.degree, 2 * gpus_per_node_));
    for (int64_t degree = 2; degree <= max_degree; ++degree) {
      if (degree > gpus_per_node_ && degree % gpus_per_node_ != 0) continue;
      const ShapeChoice& choice = shape_at(anchor.sequence, degree);
      if (!choice.feasible) continue;
      auto consider = [&](int64_t first_rank) {
        candidate_shares_ = choice.shares;
        candidate_ranks_.resize(degree);
        for (int64_t k = 0; k < degree; ++k) {
          candidate_ranks_[k] = first_rank + k;
          candidate_shares_[k].rank = first_rank + k;
        }
        if (candidate_ranks_ == anchor.ranks && choice.shape.strategy == anchor.shape.strategy &&
            choice.shape.ulysses_degree == anchor.shape.ulysses_degree) {
          return;
        }
        const double score_s = price_change(*s, anchor.shares, candidate_shares_);
        if (score_s < best_s) {
          best_s = score_s;
          best_slot = slot;
          best_degree = degree;
          best_ranks_ = candidate_ranks_;
          best_shares_ = candidate_shares_;
        }
      };
      for (int64_t node : window_nodes_) {
        const int64_t node_first = node * gpus_per_node_;
        if (degree <= gpus_per_node_) {
          for (int64_t offset = 0; offset + degree <= gpus_per_node_; offset += degree) {
            consider(node_first + offset);
          }
          if (gpus_per_node_ % degree != 0) consider(node_first + gpus_per_node_ - degree);
        } else if (node_first + degree <= num_ranks_) {
          consider(node_first);
        }
      }
    }
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
    for (int64_t rank : low_ranks_) {
      for (int32_t slot : s->rank_anchors[rank]) partner_slots_.push_back(slot);
    }
    for (int64_t rank : a.ranks) {
      for (int32_t slot : s->rank_anchors[rank]) {
        if (slot != first) partner_slots_.push_back(slot);
      }
    }
    std::sort(partner_slots_.begin(), partner_slots_.end());
    partner_slots_.erase(std::unique(partner_slots_.begin(), partner_slots_.end()),
                         partner_slots_.end());
    if (partner_slots_.size() > kPairPartners) partner_slots_.resize(kPairPartners);
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
      pair_new_ = cost_model_.shares(
          seq_a, to_placement(seq_a.id, choice_a.shape, candidate_ranks_), cache_);
      const size_t split = pair_new_.size();
      const std::vector<RankShare> shares_b = cost_model_.shares(
          seq_b, to_placement(seq_b.id, choice_b.shape, candidate_ranks_), cache_);
      pair_new_.insert(pair_new_.end(), shares_b.begin(), shares_b.end());
      pair_old_ = a.shares;
      pair_old_.insert(pair_old_.end(), b.shares.begin(), b.shares.end());
      const double score_s = price_change(*s, pair_old_, pair_new_);
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
