#include "zellige/plan_compiler.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace zellige {
namespace {

// Where one rank sits in one sequence's placement, and what that gives it.
struct Membership {
  int64_t sequence_index = 0;
  int64_t position = 0;      // index into placement.ranks
  int64_t block = 0;         // j
  int64_t chunk = 0;         // k
  int64_t block_offset = 0;  // first token of block j in the sequence
  int64_t block_tokens = 0;  // b_j
  int64_t chunk_offset = 0;  // first token of chunk k within the block
  int64_t chunk_tokens = 0;
  int64_t head_offset = 0;  // first head of share k
  int64_t num_heads = 0;    // n_k
};

int64_t prefix_before(const std::vector<int64_t>& sizes, int64_t index) {
  return std::accumulate(sizes.begin(), sizes.begin() + index, int64_t{0});
}

Membership membership(const Sequence& seq, const Placement& placement, int64_t sequence_index,
                      int64_t position, int64_t num_heads) {
  const int64_t u = placement.ulysses_degree;
  Membership m;
  m.sequence_index = sequence_index;
  m.position = position;
  m.block = position / u;
  m.chunk = position % u;
  const std::vector<int64_t> blocks = balanced_split(seq.num_tokens, placement.ring_degree);
  m.block_offset = prefix_before(blocks, m.block);
  m.block_tokens = blocks[m.block];
  const std::vector<int64_t> chunks = balanced_split(m.block_tokens, u);
  m.chunk_offset = prefix_before(chunks, m.chunk);
  m.chunk_tokens = chunks[m.chunk];
  const std::vector<int64_t> heads = balanced_split(num_heads, u);
  m.head_offset = prefix_before(heads, m.chunk);
  m.num_heads = heads[m.chunk];
  return m;
}

// Longest first, then batch order: equal sizes end up adjacent (dense attention batches).
void sort_longest_first(std::vector<Membership>& items, int64_t Membership::* size) {
  std::stable_sort(items.begin(), items.end(), [size](const Membership& a, const Membership& b) {
    if (a.*size != b.*size) return a.*size > b.*size;
    return a.sequence_index < b.sequence_index;
  });
}

void sort_exchange_segments(std::vector<Membership>& items) {
  std::stable_sort(items.begin(), items.end(), [](const Membership& a, const Membership& b) {
    if (a.block_tokens != b.block_tokens) return a.block_tokens > b.block_tokens;
    if (a.num_heads != b.num_heads) return a.num_heads > b.num_heads;
    return a.sequence_index < b.sequence_index;
  });
}

}  // namespace

RankLayout compile_rank_layout(const Batch& batch, const Plan& plan, int64_t rank,
                               int64_t num_heads) {
  if (num_heads <= 0) {
    throw std::invalid_argument("num_heads must be positive, got " + std::to_string(num_heads));
  }
  validate_batch(batch, plan.num_ranks);
  validate_plan(plan, batch, plan.num_ranks, num_heads);
  if (rank < 0 || rank >= plan.num_ranks) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is outside the plan's " +
                                std::to_string(plan.num_ranks) + " ranks");
  }
  const int64_t num_ranks = plan.num_ranks;
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());

  std::unordered_map<int64_t, const Placement*> placement_of_id;
  for (const Placement& p : plan.placements) placement_of_id[p.sequence_id] = &p;
  std::vector<const Placement*> placement(num_sequences);
  for (int64_t i = 0; i < num_sequences; ++i) {
    placement[i] = placement_of_id.at(batch.sequences[i].id);
  }

  RankLayout layout;
  layout.rank = rank;
  layout.num_ranks = num_ranks;
  layout.num_heads = num_heads;

  // ---- What this rank holds, by kind. ----
  std::vector<Membership> local, ring, exchanged;  // exchanged: Ulysses and hybrid
  for (int64_t i = 0; i < num_sequences; ++i) {
    const Placement& p = *placement[i];
    if (p.ulysses_degree > 1) layout.world_has_exchange = true;
    const auto it = std::find(p.ranks.begin(), p.ranks.end(), rank);
    if (it == p.ranks.end()) continue;
    const Membership m =
        membership(batch.sequences[i], p, i, static_cast<int64_t>(it - p.ranks.begin()), num_heads);
    if (p.ulysses_degree > 1) {
      exchanged.push_back(m);
    } else if (p.ring_degree > 1) {
      ring.push_back(m);
    } else {
      local.push_back(m);
    }
  }
  sort_longest_first(local, &Membership::chunk_tokens);
  sort_longest_first(ring, &Membership::chunk_tokens);
  std::vector<Membership> exchanged_held = exchanged;
  sort_longest_first(exchanged_held, &Membership::chunk_tokens);

  // ---- Held chunks, per-token sequence index and positions. ----
  std::vector<int64_t> held_offset_of(num_sequences, -1);
  for (const std::vector<Membership>* group : {&local, &ring, &exchanged_held}) {
    for (const Membership& m : *group) {
      const Sequence& seq = batch.sequences[m.sequence_index];
      const int64_t first = m.block_offset + m.chunk_offset;
      held_offset_of[m.sequence_index] = layout.num_held_tokens;
      layout.chunk_sequence_index.push_back(m.sequence_index);
      layout.chunk_token_offset.push_back(first);
      layout.chunk_num_tokens.push_back(m.chunk_tokens);
      layout.chunk_held_offset.push_back(layout.num_held_tokens);
      layout.num_held_tokens += m.chunk_tokens;
      const int64_t frame_tokens = seq.grid_h * seq.grid_w;
      for (int64_t token = first; token < first + m.chunk_tokens; ++token) {
        layout.token_sequence_index.push_back(m.sequence_index);
        layout.token_position_thw.push_back(token / frame_tokens);
        layout.token_position_thw.push_back((token / seq.grid_w) % seq.grid_h);
        layout.token_position_thw.push_back(token % seq.grid_w);
      }
    }
  }

  // ---- Route. Rows from source rank q to holder s: sequences with source q in batch order,
  // each sequence's chunk held by s, tokens in order. ----
  std::vector<std::vector<int64_t>> route_rows_to(num_ranks);
  int64_t source_offset = 0;
  for (int64_t i = 0; i < num_sequences; ++i) {
    const Sequence& seq = batch.sequences[i];
    if (seq.source_rank != rank) continue;
    const Placement& p = *placement[i];
    for (int64_t position = 0; position < p.degree(); ++position) {
      const Membership m = membership(seq, p, i, position, num_heads);
      std::vector<int64_t>& rows = route_rows_to[p.ranks[position]];
      const int64_t first = source_offset + m.block_offset + m.chunk_offset;
      for (int64_t token = first; token < first + m.chunk_tokens; ++token) rows.push_back(token);
    }
    source_offset += seq.num_tokens;
  }
  layout.num_source_tokens = source_offset;
  for (int64_t s = 0; s < num_ranks; ++s) {
    layout.route_send_splits.push_back(static_cast<int64_t>(route_rows_to[s].size()));
    layout.route_send_index.insert(layout.route_send_index.end(), route_rows_to[s].begin(),
                                   route_rows_to[s].end());
  }
  layout.route_recv_splits.assign(num_ranks, 0);
  layout.route_recv_index.assign(layout.num_held_tokens, -1);
  {
    // Held chunks sorted by (source rank, batch order) give the receive order.
    std::vector<int64_t> chunk_order(layout.chunk_sequence_index.size());
    std::iota(chunk_order.begin(), chunk_order.end(), 0);
    auto source_of = [&](int64_t c) {
      return batch.sequences[layout.chunk_sequence_index[c]].source_rank;
    };
    std::stable_sort(chunk_order.begin(), chunk_order.end(), [&](int64_t a, int64_t b) {
      if (source_of(a) != source_of(b)) return source_of(a) < source_of(b);
      return layout.chunk_sequence_index[a] < layout.chunk_sequence_index[b];
    });
    int64_t recv_row = 0;
    for (int64_t c : chunk_order) {
      layout.route_recv_splits[source_of(c)] += layout.chunk_num_tokens[c];
      for (int64_t t = 0; t < layout.chunk_num_tokens[c]; ++t) {
        layout.route_recv_index[layout.chunk_held_offset[c] + t] = recv_row++;
      }
    }
  }

  // ---- Attention segments on own rows: local sequences, then ring blocks. ----
  auto add_segment = [&](const Membership& m, SegmentKind kind, bool in_exchange,
                         int64_t row_offset, int64_t tokens, int64_t heads, int64_t head_offset) {
    layout.segment_sequence_index.push_back(m.sequence_index);
    layout.segment_kind.push_back(static_cast<int64_t>(kind));
    layout.segment_in_exchange.push_back(in_exchange ? 1 : 0);
    layout.segment_row_offset.push_back(row_offset);
    layout.segment_num_tokens.push_back(tokens);
    layout.segment_num_heads.push_back(heads);
    layout.segment_head_offset.push_back(head_offset);
  };
  for (const Membership& m : local) {
    add_segment(m, SegmentKind::kLocal, false, held_offset_of[m.sequence_index] * num_heads,
                m.chunk_tokens, num_heads, 0);
  }
  std::vector<std::pair<int64_t, Membership>> ring_members;  // (segment index, membership)
  for (const Membership& m : ring) {
    ring_members.emplace_back(layout.num_segments(), m);
    add_segment(m, SegmentKind::kRing, false, held_offset_of[m.sequence_index] * num_heads,
                m.chunk_tokens, num_heads, 0);
  }

  // ---- Exchange rows: Ulysses sequences, then hybrid blocks, each longest first. ----
  std::vector<Membership> ulysses_segments, hybrid_segments;
  for (const Membership& m : exchanged) {
    (placement[m.sequence_index]->ring_degree > 1 ? hybrid_segments : ulysses_segments)
        .push_back(m);
  }
  sort_exchange_segments(ulysses_segments);
  sort_exchange_segments(hybrid_segments);
  std::vector<int64_t> exchange_offset_of(num_sequences, -1);
  for (const std::vector<Membership>* group : {&ulysses_segments, &hybrid_segments}) {
    const bool hybrid = group == &hybrid_segments;
    for (const Membership& m : *group) {
      exchange_offset_of[m.sequence_index] = layout.num_exchange_rows;
      if (hybrid) ring_members.emplace_back(layout.num_segments(), m);
      add_segment(m, hybrid ? SegmentKind::kHybrid : SegmentKind::kUlysses, true,
                  layout.num_exchange_rows, m.block_tokens, m.num_heads, m.head_offset);
      layout.num_exchange_rows += m.block_tokens * m.num_heads;
    }
  }
  layout.cu_seqlens.push_back(0);
  for (int64_t tokens : layout.segment_num_tokens) {
    layout.cu_seqlens.push_back(layout.cu_seqlens.back() + tokens);
  }

  // ---- Ulysses exchange. Rows from rank a to rank b (same block of sequence i): sequences in
  // batch order, a's chunk tokens in order, b's heads in order (token-major). ----
  std::vector<std::vector<int64_t>> exchange_rows_to(num_ranks);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> exchange_from(num_ranks);  // (i, k')
  for (const Membership& m : exchanged) {                                          // batch order
    const Placement& p = *placement[m.sequence_index];
    const int64_t u = p.ulysses_degree;
    const std::vector<int64_t> heads = balanced_split(num_heads, u);
    const int64_t held_first = held_offset_of[m.sequence_index];
    for (int64_t k = 0; k < u; ++k) {
      const int64_t peer = p.ranks[m.block * u + k];
      const int64_t head_first = prefix_before(heads, k);
      std::vector<int64_t>& rows = exchange_rows_to[peer];
      for (int64_t t = 0; t < m.chunk_tokens; ++t) {
        for (int64_t h = head_first; h < head_first + heads[k]; ++h) {
          rows.push_back((held_first + t) * num_heads + h);
        }
      }
      exchange_from[peer].emplace_back(m.sequence_index, k);
    }
  }
  for (int64_t s = 0; s < num_ranks; ++s) {
    layout.exchange_send_splits.push_back(static_cast<int64_t>(exchange_rows_to[s].size()));
    layout.exchange_send_index.insert(layout.exchange_send_index.end(), exchange_rows_to[s].begin(),
                                      exchange_rows_to[s].end());
  }
  layout.exchange_recv_splits.assign(num_ranks, 0);
  layout.exchange_recv_index.assign(layout.num_exchange_rows, -1);
  {
    std::vector<int64_t> position_of(num_sequences, -1);
    for (const Membership& m : exchanged) position_of[m.sequence_index] = m.position;
    int64_t recv_row = 0;
    for (int64_t source = 0; source < num_ranks; ++source) {
      for (const auto& [i, k] : exchange_from[source]) {
        const Placement& p = *placement[i];
        const Membership mine = membership(batch.sequences[i], p, i, position_of[i], num_heads);
        const Membership theirs =
            membership(batch.sequences[i], p, i, mine.block * p.ulysses_degree + k, num_heads);
        const int64_t base = exchange_offset_of[i];
        for (int64_t t = 0; t < theirs.chunk_tokens; ++t) {
          for (int64_t h = 0; h < mine.num_heads; ++h) {
            layout.exchange_recv_index[base + (theirs.chunk_offset + t) * mine.num_heads + h] =
                recv_row++;
          }
        }
        layout.exchange_recv_splits[source] += theirs.chunk_tokens * mine.num_heads;
      }
    }
  }

  // ---- Ring table, in segment order. ----
  std::sort(ring_members.begin(), ring_members.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  layout.ring_peer_offset.push_back(0);
  for (const auto& [segment, m] : ring_members) {
    const Placement& p = *placement[m.sequence_index];
    const std::vector<int64_t> blocks =
        balanced_split(batch.sequences[m.sequence_index].num_tokens, p.ring_degree);
    layout.ring_segment.push_back(segment);
    layout.ring_degree.push_back(p.ring_degree);
    layout.ring_position.push_back(m.block);
    for (int64_t j = 0; j < p.ring_degree; ++j) {
      layout.ring_peers.push_back(p.ranks[j * p.ulysses_degree + m.chunk]);
      layout.ring_block_tokens.push_back(blocks[j]);
    }
    layout.ring_peer_offset.push_back(static_cast<int64_t>(layout.ring_peers.size()));
  }
  return layout;
}

}  // namespace zellige
