#include "zellige/plan_compiler.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

namespace zellige {
namespace {

// Where one rank sits in one sequence's placement, and what that gives it. Token offsets and
// counts are in the sequence's attended token list (joint: text first).
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

Membership membership(int64_t attended, const Placement& placement, int64_t sequence_index,
                      int64_t position, int64_t num_heads) {
  const int64_t u = placement.ulysses_degree;
  Membership m;
  m.sequence_index = sequence_index;
  m.position = position;
  m.block = position / u;
  m.chunk = position % u;
  const std::vector<int64_t> blocks = balanced_split(attended, placement.ring_degree);
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

// a + b and a * b for non-negative sizes, saturating at kMaxRowsPerRank + 1 (so limits can be
// checked before anything of that size is allocated, without overflow).
int64_t add_rows(int64_t a, int64_t b) {
  return (a > kMaxRowsPerRank || b > kMaxRowsPerRank) ? kMaxRowsPerRank + 1
                                                      : std::min(a + b, kMaxRowsPerRank + 1);
}
int64_t mul_rows(int64_t a, int64_t b) {
  if (a == 0 || b == 0) return 0;
  if (a > kMaxRowsPerRank || b > kMaxRowsPerRank) return kMaxRowsPerRank + 1;
  return std::min(a * b, kMaxRowsPerRank + 1);  // both < 2^31 + 1: the product fits int64
}

void check_rows(int64_t rows, int64_t rank, const std::string& what) {
  if (rows > kMaxRowsPerRank) {
    throw std::invalid_argument(
        "rank " + std::to_string(rank) + " would hold more than 2^31 " + what +
        " in one step (text included); no rank's memory holds that: shorten the sequences or "
        "their text, or spread them over more ranks");
  }
}

uint64_t fnv1a(uint64_t hash, int64_t value) {
  for (int byte = 0; byte < 8; ++byte) {
    hash ^= static_cast<uint64_t>(value >> (8 * byte)) & 0xffu;
    hash *= 1099511628211ull;
  }
  return hash;
}

int64_t program_fingerprint(const Batch& batch, const Plan& plan, int64_t num_heads,
                            bool joint_attention) {
  uint64_t hash = 14695981039346656037ull;
  hash = fnv1a(hash, num_heads);
  hash = fnv1a(hash, joint_attention ? 1 : 0);
  hash = fnv1a(hash, plan.num_ranks);
  for (const Sequence& s : batch.sequences) {
    for (int64_t v :
         {s.id, s.num_tokens, s.text_tokens, s.source_rank, s.grid_t, s.grid_h, s.grid_w}) {
      hash = fnv1a(hash, v);
    }
  }
  for (const Placement& p : plan.placements) {
    hash = fnv1a(hash, p.sequence_id);
    hash = fnv1a(hash, static_cast<int64_t>(p.strategy));
    hash = fnv1a(hash, p.ulysses_degree);
    hash = fnv1a(hash, p.ring_degree);
    for (int64_t r : p.ranks) hash = fnv1a(hash, r);
  }
  return static_cast<int64_t>(hash >> 1);
}

}  // namespace

std::vector<SegmentGroup> group_segments(const std::vector<int64_t>& q_row_offset,
                                         const std::vector<int64_t>& k_row_offset,
                                         const std::vector<int64_t>& q_len,
                                         const std::vector<int64_t>& k_len,
                                         const std::vector<int64_t>& num_heads) {
  const size_t n = q_row_offset.size();
  if (k_row_offset.size() != n || q_len.size() != n || k_len.size() != n || num_heads.size() != n) {
    throw std::invalid_argument(
        "group_segments: offsets, lengths and heads must have one entry "
        "per segment");
  }
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> by;
  for (size_t s = 0; s < n; ++s) {
    if (q_len[s] > 0 && k_len[s] > 0 && num_heads[s] > 0) {
      by[{q_len[s], k_len[s], num_heads[s]}].emplace_back(q_row_offset[s], k_row_offset[s]);
    }
  }
  std::vector<SegmentGroup> groups;
  for (auto it = by.rbegin(); it != by.rend(); ++it) {
    auto members = it->second;
    std::sort(members.begin(), members.end());
    SegmentGroup g;
    std::tie(g.q_len, g.k_len, g.num_heads) = it->first;
    for (const auto& [q, k] : members) {
      g.q_row_offset.push_back(q);
      g.k_row_offset.push_back(k);
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

StepProgram compile_step_program(const Batch& batch, const Plan& plan, int64_t rank,
                                 int64_t num_heads, bool joint_attention) {
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
  const int64_t N = num_heads;

  std::unordered_map<int64_t, const Placement*> placement_of_id;
  for (const Placement& p : plan.placements) placement_of_id[p.sequence_id] = &p;
  std::vector<const Placement*> placement(num_sequences);
  // attended[i]: the sequence's attended tokens; text_of[i]: how many of them are text (joint).
  std::vector<int64_t> attended(num_sequences), text_of(num_sequences);
  for (int64_t i = 0; i < num_sequences; ++i) {
    const Sequence& seq = batch.sequences[i];
    placement[i] = placement_of_id.at(seq.id);
    text_of[i] = joint_attention ? seq.text_tokens : 0;
    if (__builtin_add_overflow(seq.num_tokens, text_of[i], &attended[i]) ||
        attended[i] > kMaxRowsPerRank) {
      throw std::invalid_argument("sequence " + std::to_string(seq.id) + " has " +
                                  std::to_string(seq.num_tokens) + " tokens and " +
                                  std::to_string(seq.text_tokens) +
                                  " text tokens: more than the 2^31 attended tokens a sequence "
                                  "may have");
    }
  }

  StepProgram program;
  program.rank = rank;
  program.num_ranks = num_ranks;
  program.num_heads = N;
  program.joint_attention = joint_attention;
  program.fingerprint = program_fingerprint(batch, plan, N, joint_attention);

  // ---- What this rank holds, by kind; refuse sizes no rank can hold before allocating. ----
  std::vector<Membership> local, ring, exchanged;  // exchanged: Ulysses and hybrid
  int64_t held_rows = 0, exchange_rows = 0, cross_rows = 0, source_rows = 0, source_text = 0;
  for (int64_t i = 0; i < num_sequences; ++i) {
    const Placement& p = *placement[i];
    const Sequence& seq = batch.sequences[i];
    if (p.ulysses_degree > 1) program.world_has_exchange = true;
    if (seq.source_rank == rank) {
      source_rows = add_rows(source_rows, attended[i]);
      source_text = add_rows(source_text, seq.text_tokens);
    }
    const auto it = std::find(p.ranks.begin(), p.ranks.end(), rank);
    if (it == p.ranks.end()) continue;
    const Membership m =
        membership(attended[i], p, i, static_cast<int64_t>(it - p.ranks.begin()), N);
    held_rows = add_rows(held_rows, mul_rows(m.chunk_tokens, N));
    if (!joint_attention && m.chunk_tokens > 0) {
      cross_rows = add_rows(cross_rows, mul_rows(seq.text_tokens, N));
    }
    if (p.ulysses_degree > 1) {
      exchange_rows = add_rows(exchange_rows, mul_rows(m.block_tokens, m.num_heads));
      exchanged.push_back(m);
    } else if (p.ring_degree > 1) {
      ring.push_back(m);
    } else {
      local.push_back(m);
    }
  }
  check_rows(held_rows, rank, "token x head rows");
  check_rows(exchange_rows, rank, "Ulysses exchange rows");
  check_rows(cross_rows, rank, "cross-attention text x head rows");
  check_rows(source_rows, rank, "source tokens");
  check_rows(source_text, rank, "source text tokens");
  sort_longest_first(local, &Membership::chunk_tokens);
  sort_longest_first(ring, &Membership::chunk_tokens);
  std::vector<Membership> exchanged_held = exchanged;
  sort_longest_first(exchanged_held, &Membership::chunk_tokens);

  // ---- Held chunks and per-token tables. ----
  std::vector<int64_t> held_offset_of(num_sequences, -1);
  for (const std::vector<Membership>* group : {&local, &ring, &exchanged_held}) {
    for (const Membership& m : *group) {
      const int64_t i = m.sequence_index;
      const Sequence& seq = batch.sequences[i];
      const int64_t first = m.block_offset + m.chunk_offset;
      const int64_t chunk = static_cast<int64_t>(program.chunk_sequence_index.size());
      const int64_t cross_text = (!joint_attention && m.chunk_tokens > 0) ? seq.text_tokens : 0;
      held_offset_of[i] = program.num_held_tokens;
      program.chunk_sequence_index.push_back(i);
      program.chunk_token_offset.push_back(first);
      program.chunk_num_tokens.push_back(m.chunk_tokens);
      program.chunk_num_text_tokens.push_back(
          std::clamp<int64_t>(text_of[i] - first, 0, m.chunk_tokens));
      program.chunk_cross_text_tokens.push_back(cross_text);
      program.chunk_held_offset.push_back(program.num_held_tokens);
      program.chunk_cross_text_offset.push_back(program.num_cross_text_rows);
      program.num_cross_text_rows += cross_text;
      const int64_t frame_tokens = seq.grid_h * seq.grid_w;
      for (int64_t token = first; token < first + m.chunk_tokens; ++token) {
        const int64_t held = program.num_held_tokens + (token - first);
        program.token_sequence_index.push_back(i);
        program.token_chunk_index.push_back(chunk);
        if (token < text_of[i]) {
          program.token_position_thw.insert(program.token_position_thw.end(), {token, 0, 0});
          program.token_modality.push_back(1);
          program.held_text_index.push_back(held);
        } else {
          const int64_t v = token - text_of[i];
          program.token_position_thw.insert(
              program.token_position_thw.end(),
              {v / frame_tokens, (v / seq.grid_w) % seq.grid_h, v % seq.grid_w});
          program.token_modality.push_back(0);
          program.held_visual_index.push_back(held);
        }
      }
      program.num_held_tokens += m.chunk_tokens;
    }
  }
  const int64_t num_chunks = static_cast<int64_t>(program.chunk_sequence_index.size());

  // ---- Routes, sending side. Rows from source rank q to holder s: sequences with source q in
  // batch order, each sequence's chunk held by s, tokens in order (per modality: filtered). ----
  struct Sent {
    int64_t all_row, modality, modal_row;
  };
  std::vector<std::vector<Sent>> sent_to(num_ranks);
  std::vector<std::vector<int64_t>> text_rows_to(num_ranks);  // cross-attention text
  int64_t source_all = 0, source_visual = 0, source_text_rows = 0;
  for (int64_t i = 0; i < num_sequences; ++i) {
    const Sequence& seq = batch.sequences[i];
    if (seq.source_rank != rank) continue;
    const Placement& p = *placement[i];
    for (int64_t position = 0; position < p.degree(); ++position) {
      const Membership m = membership(attended[i], p, i, position, N);
      const int64_t dest = p.ranks[position];
      const int64_t first = m.block_offset + m.chunk_offset;
      for (int64_t token = first; token < first + m.chunk_tokens; ++token) {
        const bool text = token < text_of[i];
        sent_to[dest].push_back(
            {source_all + token, text ? 1 : 0,
             text ? source_text_rows + token : source_visual + token - text_of[i]});
      }
      if (!joint_attention && m.chunk_tokens > 0) {
        for (int64_t t = 0; t < seq.text_tokens; ++t) {
          text_rows_to[dest].push_back(source_text_rows + t);
        }
      }
    }
    source_all += attended[i];
    source_visual += seq.num_tokens;
    source_text_rows += seq.text_tokens;
  }
  TokenRoute* modal[2] = {&program.visual_route, &program.text_route};
  program.route.num_source = source_all;
  program.visual_route.num_source = source_visual;
  program.text_route.num_source = joint_attention ? source_text_rows : 0;
  program.cross_text_route.num_source = joint_attention ? 0 : source_text_rows;
  for (TokenRoute* r : {&program.route, modal[0], modal[1], &program.cross_text_route}) {
    r->send_splits.assign(num_ranks, 0);
    r->recv_splits.assign(num_ranks, 0);
  }
  for (int64_t s = 0; s < num_ranks; ++s) {
    for (const Sent& row : sent_to[s]) {
      program.route.send_index.push_back(row.all_row);
      ++program.route.send_splits[s];
      modal[row.modality]->send_index.push_back(row.modal_row);
      ++modal[row.modality]->send_splits[s];
    }
    program.cross_text_route.send_index.insert(program.cross_text_route.send_index.end(),
                                               text_rows_to[s].begin(), text_rows_to[s].end());
    program.cross_text_route.send_splits[s] = static_cast<int64_t>(text_rows_to[s].size());
  }

  // ---- Routes, receiving side: held chunks sorted by (source rank, batch order). ----
  program.route.num_held = program.num_held_tokens;
  program.visual_route.num_held = static_cast<int64_t>(program.held_visual_index.size());
  program.text_route.num_held = static_cast<int64_t>(program.held_text_index.size());
  program.cross_text_route.num_held = program.num_cross_text_rows;
  program.route.recv_index.assign(program.num_held_tokens, -1);
  program.visual_route.recv_index.assign(program.visual_route.num_held, -1);
  program.text_route.recv_index.assign(program.text_route.num_held, -1);
  program.cross_text_route.recv_index.assign(program.num_cross_text_rows, -1);
  {
    std::vector<int64_t> modal_ordinal(program.num_held_tokens, -1);
    for (int64_t k = 0; k < program.visual_route.num_held; ++k) {
      modal_ordinal[program.held_visual_index[k]] = k;
    }
    for (int64_t k = 0; k < program.text_route.num_held; ++k) {
      modal_ordinal[program.held_text_index[k]] = k;
    }
    std::vector<int64_t> chunk_order(num_chunks);
    std::iota(chunk_order.begin(), chunk_order.end(), 0);
    auto source_of = [&](int64_t c) {
      return batch.sequences[program.chunk_sequence_index[c]].source_rank;
    };
    std::stable_sort(chunk_order.begin(), chunk_order.end(), [&](int64_t a, int64_t b) {
      if (source_of(a) != source_of(b)) return source_of(a) < source_of(b);
      return program.chunk_sequence_index[a] < program.chunk_sequence_index[b];
    });
    int64_t all_row = 0, text_row = 0;
    int64_t modal_row[2] = {0, 0};
    for (int64_t c : chunk_order) {
      const int64_t source = source_of(c);
      for (int64_t t = 0; t < program.chunk_num_tokens[c]; ++t) {
        const int64_t held = program.chunk_held_offset[c] + t;
        program.route.recv_index[held] = all_row++;
        ++program.route.recv_splits[source];
        const int64_t mod = program.token_modality[held];
        modal[mod]->recv_index[modal_ordinal[held]] = modal_row[mod]++;
        ++modal[mod]->recv_splits[source];
      }
      for (int64_t t = 0; t < program.chunk_cross_text_tokens[c]; ++t) {
        program.cross_text_route.recv_index[program.chunk_cross_text_offset[c] + t] = text_row++;
      }
      program.cross_text_route.recv_splits[source] += program.chunk_cross_text_tokens[c];
    }
  }

  // ---- Attention segments on own rows: local sequences, then ring blocks. ----
  auto add_segment = [&](const Membership& m, SegmentKind kind, bool in_exchange,
                         int64_t row_offset, int64_t tokens, int64_t heads, int64_t head_offset) {
    program.segment_sequence_index.push_back(m.sequence_index);
    program.segment_kind.push_back(static_cast<int64_t>(kind));
    program.segment_in_exchange.push_back(in_exchange ? 1 : 0);
    program.segment_row_offset.push_back(row_offset);
    program.segment_num_tokens.push_back(tokens);
    program.segment_num_heads.push_back(heads);
    program.segment_head_offset.push_back(head_offset);
  };
  for (const Membership& m : local) {
    add_segment(m, SegmentKind::kLocal, false, held_offset_of[m.sequence_index] * N, m.chunk_tokens,
                N, 0);
  }
  std::vector<std::pair<int64_t, Membership>> ring_members;  // (segment index, membership)
  for (const Membership& m : ring) {
    ring_members.emplace_back(program.num_segments(), m);
    add_segment(m, SegmentKind::kRing, false, held_offset_of[m.sequence_index] * N, m.chunk_tokens,
                N, 0);
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
      exchange_offset_of[m.sequence_index] = program.num_exchange_rows;
      if (hybrid) ring_members.emplace_back(program.num_segments(), m);
      add_segment(m, hybrid ? SegmentKind::kHybrid : SegmentKind::kUlysses, true,
                  program.num_exchange_rows, m.block_tokens, m.num_heads, m.head_offset);
      program.num_exchange_rows += m.block_tokens * m.num_heads;
    }
  }

  // ---- Ulysses exchange. Rows from rank a to rank b (same block of sequence i): sequences in
  // batch order, a's chunk tokens in order, b's heads in order (token-major). ----
  std::vector<std::vector<int64_t>> exchange_rows_to(num_ranks);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> exchange_from(num_ranks);  // (i, k')
  for (const Membership& m : exchanged) {                                          // batch order
    const Placement& p = *placement[m.sequence_index];
    const int64_t u = p.ulysses_degree;
    const std::vector<int64_t> heads = balanced_split(N, u);
    const int64_t held_first = held_offset_of[m.sequence_index];
    for (int64_t k = 0; k < u; ++k) {
      const int64_t peer = p.ranks[m.block * u + k];
      const int64_t head_first = prefix_before(heads, k);
      std::vector<int64_t>& rows = exchange_rows_to[peer];
      for (int64_t t = 0; t < m.chunk_tokens; ++t) {
        for (int64_t h = head_first; h < head_first + heads[k]; ++h) {
          rows.push_back((held_first + t) * N + h);
        }
      }
      exchange_from[peer].emplace_back(m.sequence_index, k);
    }
  }
  for (int64_t s = 0; s < num_ranks; ++s) {
    program.exchange_send_splits.push_back(static_cast<int64_t>(exchange_rows_to[s].size()));
    program.exchange_send_index.insert(program.exchange_send_index.end(),
                                       exchange_rows_to[s].begin(), exchange_rows_to[s].end());
  }
  program.exchange_recv_splits.assign(num_ranks, 0);
  program.exchange_recv_index.assign(program.num_exchange_rows, -1);
  {
    std::vector<int64_t> position_of(num_sequences, -1);
    for (const Membership& m : exchanged) position_of[m.sequence_index] = m.position;
    int64_t recv_row = 0;
    for (int64_t source = 0; source < num_ranks; ++source) {
      for (const auto& [i, k] : exchange_from[source]) {
        const Placement& p = *placement[i];
        const Membership mine = membership(attended[i], p, i, position_of[i], N);
        const Membership theirs =
            membership(attended[i], p, i, mine.block * p.ulysses_degree + k, N);
        const int64_t base = exchange_offset_of[i];
        for (int64_t t = 0; t < theirs.chunk_tokens; ++t) {
          for (int64_t h = 0; h < mine.num_heads; ++h) {
            program.exchange_recv_index[base + (theirs.chunk_offset + t) * mine.num_heads + h] =
                recv_row++;
          }
        }
        program.exchange_recv_splits[source] += theirs.chunk_tokens * mine.num_heads;
      }
    }
  }

  // ---- Ring table, in segment order. ----
  std::sort(ring_members.begin(), ring_members.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  program.ring_peer_offset.push_back(0);
  for (const auto& [segment, m] : ring_members) {
    const Placement& p = *placement[m.sequence_index];
    const std::vector<int64_t> blocks = balanced_split(attended[m.sequence_index], p.ring_degree);
    program.ring_segment.push_back(segment);
    program.ring_degree.push_back(p.ring_degree);
    program.ring_position.push_back(m.block);
    for (int64_t j = 0; j < p.ring_degree; ++j) {
      program.ring_peers.push_back(p.ranks[j * p.ulysses_degree + m.chunk]);
      program.ring_block_tokens.push_back(blocks[j]);
    }
    program.ring_peer_offset.push_back(static_cast<int64_t>(program.ring_peers.size()));
  }

  // ---- Dense groups of the local and Ulysses segments. ----
  for (const auto& [kind, groups] : {std::pair{SegmentKind::kLocal, &program.local_groups},
                                     std::pair{SegmentKind::kUlysses, &program.exchange_groups}}) {
    std::vector<int64_t> rows, tokens, heads;
    for (int64_t g = 0; g < program.num_segments(); ++g) {
      if (program.segment_kind[g] != static_cast<int64_t>(kind)) continue;
      rows.push_back(program.segment_row_offset[g]);
      tokens.push_back(program.segment_num_tokens[g]);
      heads.push_back(program.segment_num_heads[g]);
    }
    *groups = group_segments(rows, rows, tokens, tokens, heads);
  }

  // ---- Ring schedule: ring and hybrid segments in compact rows (own-row ones first). ----
  struct Entry {
    int64_t e, g, compact, rows;
  };
  std::vector<Entry> entries;
  for (int64_t in_exchange : {0, 1}) {
    for (int64_t e = 0; e < static_cast<int64_t>(program.ring_segment.size()); ++e) {
      const int64_t g = program.ring_segment[e];
      if (program.segment_in_exchange[g] != in_exchange) continue;
      const int64_t rows = program.segment_num_tokens[g] * program.segment_num_heads[g];
      std::vector<int64_t>& to = in_exchange ? program.ring_exchange_rows : program.ring_own_rows;
      for (int64_t r = 0; r < rows; ++r) to.push_back(program.segment_row_offset[g] + r);
      entries.push_back({e, g, program.ring_num_rows, rows});
      program.ring_num_rows += rows;
    }
  }
  {
    std::vector<int64_t> offsets, tokens, heads;
    for (const Entry& x : entries) {
      offsets.push_back(x.compact);
      tokens.push_back(program.segment_num_tokens[x.g]);
      heads.push_back(program.segment_num_heads[x.g]);
    }
    program.ring_step0_groups = group_segments(offsets, offsets, tokens, tokens, heads);
  }
  int64_t max_degree = 1;
  for (int64_t r : program.ring_degree) max_degree = std::max(max_degree, r);
  for (int64_t s = 1; s < max_degree; ++s) {
    // Messages to / from one peer carry their sequences in batch order on both ends.
    std::map<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>> send_to;
    std::map<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>> recv_from;
    for (const Entry& x : entries) {
      const int64_t r = program.ring_degree[x.e];
      if (r <= s || x.rows == 0) continue;  // an empty block neither sends nor needs anything
      const int64_t j = program.ring_position[x.e], base = program.ring_peer_offset[x.e];
      const int64_t sequence = program.segment_sequence_index[x.g];
      const int64_t dst = (j + s) % r, src = ((j - s) % r + r) % r;
      if (program.ring_block_tokens[base + dst] > 0) {
        send_to[program.ring_peers[base + dst]].emplace_back(sequence, x.compact, x.rows);
      }
      if (program.ring_block_tokens[base + src] > 0) {
        recv_from[program.ring_peers[base + src]].emplace_back(
            sequence, x.g, x.compact, program.ring_block_tokens[base + src]);
      }
    }
    RingStep step;
    for (auto& [peer, items] : send_to) {
      std::sort(items.begin(), items.end());
      PeerRows message{peer, {}};
      for (const auto& [sequence, compact, rows] : items) {
        message.rows.push_back({compact, compact + rows});
      }
      step.sends.push_back(std::move(message));
    }
    std::vector<int64_t> q_offsets, k_offsets, q_tokens, k_tokens, heads;
    for (auto& [peer, items] : recv_from) {
      std::sort(items.begin(), items.end());
      const int64_t start = step.num_recv_rows;
      for (const auto& [sequence, g, compact, block] : items) {
        q_offsets.push_back(compact);
        k_offsets.push_back(step.num_recv_rows);
        q_tokens.push_back(program.segment_num_tokens[g]);
        k_tokens.push_back(block);
        heads.push_back(program.segment_num_heads[g]);
        step.num_recv_rows += block * program.segment_num_heads[g];
      }
      step.recvs.push_back({peer, {{start, step.num_recv_rows}}});
    }
    step.groups = group_segments(q_offsets, k_offsets, q_tokens, k_tokens, heads);
    program.ring_steps.push_back(std::move(step));
  }

  // ---- Cross-attention: each nonempty chunk's queries against its sequence's text rows. ----
  {
    std::vector<int64_t> q_offsets, k_offsets, q_tokens, k_tokens, heads;
    for (int64_t c = 0; c < num_chunks; ++c) {
      q_offsets.push_back(program.chunk_held_offset[c] * N);
      k_offsets.push_back(program.chunk_cross_text_offset[c] * N);
      q_tokens.push_back(program.chunk_num_tokens[c]);
      k_tokens.push_back(program.chunk_cross_text_tokens[c]);
      heads.push_back(N);
    }
    program.cross_groups = group_segments(q_offsets, k_offsets, q_tokens, k_tokens, heads);
  }
  return program;
}

// ---- Binary form: a magic number, a version, then every field in declaration order. ----
namespace {

constexpr int64_t kProgramMagic = 0x5a5350524f47;  // "ZSPROG"
constexpr int64_t kProgramVersion = 1;

struct Writer {
  std::string bytes;
  static constexpr bool reading = false;
  void raw(void* data, size_t size) { bytes.append(static_cast<const char*>(data), size); }
  void check_count(int64_t, size_t) {}
};

struct Reader {
  const std::string& bytes;
  size_t at = 0;
  static constexpr bool reading = true;
  void raw(void* data, size_t size) {
    if (size > bytes.size() - at) {
      throw std::invalid_argument("step program bytes are truncated");
    }
    std::memcpy(data, bytes.data() + at, size);
    at += size;
  }
  // A count of items of at least `item_bytes` each must fit in what is left.
  void check_count(int64_t count, size_t item_bytes) {
    if (count < 0 || static_cast<uint64_t>(count) > (bytes.size() - at) / item_bytes) {
      throw std::invalid_argument("step program bytes are corrupted (a count of " +
                                  std::to_string(count) + " items)");
    }
  }
};

template <class A>
void io(A& a, int64_t& value) {
  a.raw(&value, sizeof value);
}
template <class A>
void io(A& a, bool& value) {
  int64_t word = value ? 1 : 0;
  io(a, word);
  value = word != 0;
}
template <class A>
void io(A& a, std::vector<int64_t>& values) {
  int64_t count = static_cast<int64_t>(values.size());
  io(a, count);
  a.check_count(count, sizeof(int64_t));
  if constexpr (A::reading) values.resize(count);
  if (count > 0) a.raw(values.data(), count * sizeof(int64_t));
}
template <class A>
void io(A& a, RowSlice& slice) {
  io(a, slice.begin);
  io(a, slice.end);
}
template <class A>
void io(A& a, PeerRows& message);
template <class A>
void io(A& a, SegmentGroup& group);
template <class A>
void io(A& a, RingStep& step);
template <class A, class T>
void io(A& a, std::vector<T>& items) {
  int64_t count = static_cast<int64_t>(items.size());
  io(a, count);
  a.check_count(count, sizeof(int64_t));  // every item is at least one word
  if constexpr (A::reading) items.resize(count);
  for (T& item : items) io(a, item);
}
template <class A>
void io(A& a, PeerRows& message) {
  io(a, message.peer);
  io(a, message.rows);
}
template <class A>
void io(A& a, SegmentGroup& group) {
  io(a, group.q_len);
  io(a, group.k_len);
  io(a, group.num_heads);
  io(a, group.q_row_offset);
  io(a, group.k_row_offset);
}
template <class A>
void io(A& a, RingStep& step) {
  io(a, step.sends);
  io(a, step.recvs);
  io(a, step.num_recv_rows);
  io(a, step.groups);
}
template <class A>
void io(A& a, TokenRoute& route) {
  io(a, route.num_source);
  io(a, route.num_held);
  io(a, route.send_index);
  io(a, route.send_splits);
  io(a, route.recv_splits);
  io(a, route.recv_index);
}

// Every field of StepProgram, once: adding a field is one line here.
template <class A>
void io(A& a, StepProgram& p) {
  for (int64_t* v : {&p.rank, &p.num_ranks, &p.num_heads}) io(a, *v);
  io(a, p.joint_attention);
  io(a, p.fingerprint);
  for (std::vector<int64_t>* v :
       {&p.chunk_sequence_index, &p.chunk_token_offset, &p.chunk_num_tokens,
        &p.chunk_num_text_tokens, &p.chunk_cross_text_tokens, &p.chunk_held_offset,
        &p.chunk_cross_text_offset}) {
    io(a, *v);
  }
  io(a, p.num_held_tokens);
  io(a, p.num_cross_text_rows);
  for (std::vector<int64_t>* v :
       {&p.token_sequence_index, &p.token_chunk_index, &p.token_position_thw, &p.token_modality,
        &p.held_visual_index, &p.held_text_index}) {
    io(a, *v);
  }
  for (TokenRoute* r : {&p.route, &p.visual_route, &p.text_route, &p.cross_text_route}) {
    io(a, *r);
  }
  io(a, p.world_has_exchange);
  for (std::vector<int64_t>* v :
       {&p.exchange_send_index, &p.exchange_send_splits, &p.exchange_recv_splits}) {
    io(a, *v);
  }
  io(a, p.num_exchange_rows);
  for (std::vector<int64_t>* v :
       {&p.exchange_recv_index, &p.segment_sequence_index, &p.segment_kind, &p.segment_in_exchange,
        &p.segment_row_offset, &p.segment_num_tokens, &p.segment_num_heads, &p.segment_head_offset,
        &p.ring_segment, &p.ring_degree, &p.ring_position, &p.ring_peer_offset, &p.ring_peers,
        &p.ring_block_tokens}) {
    io(a, *v);
  }
  io(a, p.local_groups);
  io(a, p.exchange_groups);
  io(a, p.ring_num_rows);
  io(a, p.ring_own_rows);
  io(a, p.ring_exchange_rows);
  io(a, p.ring_step0_groups);
  io(a, p.ring_steps);
  io(a, p.cross_groups);
}

}  // namespace

std::string serialize_step_program(const StepProgram& program) {
  Writer writer;
  int64_t magic = kProgramMagic, version = kProgramVersion;
  io(writer, magic);
  io(writer, version);
  io(writer, const_cast<StepProgram&>(program));  // the writer only reads
  return std::move(writer.bytes);
}

StepProgram deserialize_step_program(const std::string& bytes) {
  Reader reader{bytes};
  int64_t magic = 0, version = 0;
  io(reader, magic);
  io(reader, version);
  if (magic != kProgramMagic || version != kProgramVersion) {
    throw std::invalid_argument("not a step program of format version " +
                                std::to_string(kProgramVersion));
  }
  StepProgram program;
  io(reader, program);
  if (reader.at != bytes.size()) {
    throw std::invalid_argument("step program bytes are corrupted (trailing bytes)");
  }
  return program;
}

}  // namespace zellige
