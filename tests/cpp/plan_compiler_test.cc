// Plan compiler: layouts of all ranks together must move every token (and every token x head row)
// exactly once to where the placement contract says, with matching split sizes on both ends.
#include "zellige/plan_compiler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <tuple>

namespace zellige {
namespace {

Sequence make_sequence(int64_t id, int64_t grid_t, int64_t grid_h, int64_t grid_w,
                       int64_t source_rank) {
  Sequence seq;
  seq.id = id;
  seq.num_tokens = grid_t * grid_h * grid_w;
  seq.source_rank = source_rank;
  seq.grid_t = grid_t;
  seq.grid_h = grid_h;
  seq.grid_w = grid_w;
  return seq;
}

// Random batch + random valid plan covering every strategy, overlapping rank sets, 1-token
// sequences, lengths not divisible by the degree and degrees not dividing the head count.
std::pair<Batch, Plan> random_case(std::mt19937_64& rng, int64_t num_ranks, int64_t num_heads) {
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Batch batch;
  Plan plan;
  plan.num_ranks = num_ranks;
  const int64_t num_sequences = uniform(1, 7);
  for (int64_t i = 0; i < num_sequences; ++i) {
    const int64_t id = 100 + 3 * i;  // ids differ from batch indices on purpose
    Sequence seq = uniform(0, 4) == 0 ? make_sequence(id, 1, 1, 1, uniform(0, num_ranks - 1))
                                      : make_sequence(id, uniform(1, 3), uniform(1, 4),
                                                      uniform(1, 5), uniform(0, num_ranks - 1));
    batch.sequences.push_back(seq);
    std::vector<int64_t> ranks(num_ranks);
    std::iota(ranks.begin(), ranks.end(), 0);
    std::shuffle(ranks.begin(), ranks.end(), rng);
    const int64_t kind = uniform(0, 3);
    const int64_t max_ulysses = std::min(num_ranks, num_heads);
    if (kind == 0 || num_ranks == 1) {
      ranks.resize(1);
      plan.placements.push_back(make_placement(id, Strategy::kLocal, ranks));
    } else if (kind == 1 && max_ulysses >= 2) {
      ranks.resize(uniform(2, max_ulysses));
      plan.placements.push_back(make_placement(id, Strategy::kUlysses, ranks));
    } else if (kind == 3 && num_ranks >= 4 && num_heads >= 2) {
      const int64_t u = uniform(2, std::min(max_ulysses, num_ranks / 2));
      const int64_t r = uniform(2, num_ranks / u);
      ranks.resize(u * r);
      plan.placements.push_back(make_placement(id, Strategy::kHybrid, ranks, u));
    } else {
      ranks.resize(uniform(2, num_ranks));
      plan.placements.push_back(make_placement(id, Strategy::kRing, ranks));
    }
  }
  return {batch, plan};
}

using Row = std::tuple<int64_t, int64_t, int64_t>;  // (sequence index, token, head)

void check_execution(const Batch& batch, const std::vector<StepProgram>& programs, bool joint);

// Attended tokens of a sequence: text first for joint attention.
int64_t attended(const Sequence& seq, bool joint) {
  return seq.num_tokens + (joint ? seq.text_tokens : 0);
}

void check_all_ranks(const Batch& batch, const Plan& plan, int64_t num_heads, bool joint = false) {
  const int64_t num_ranks = plan.num_ranks;
  std::vector<StepProgram> layouts;
  for (int64_t r = 0; r < num_ranks; ++r) {
    layouts.push_back(compile_step_program(batch, plan, r, num_heads, joint));
  }
  check_execution(batch, layouts, joint);
  // The tables below see a sequence as its attended tokens (joint: text then visual).
  std::vector<Sequence> seqs = batch.sequences;
  for (Sequence& seq : seqs) seq.num_tokens = attended(seq, joint);

  // Held tokens: every token of every sequence exactly once, positions from the grid.
  std::map<std::pair<int64_t, int64_t>, int> held_count;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> held(num_ranks);  // (seq, token)
  for (const StepProgram& layout : layouts) {
    for (size_t c = 0; c < layout.chunk_num_tokens.size(); ++c) {
      EXPECT_EQ(layout.chunk_held_offset[c], static_cast<int64_t>(held[layout.rank].size()));
      for (int64_t t = 0; t < layout.chunk_num_tokens[c]; ++t) {
        const int64_t i = layout.chunk_sequence_index[c];
        const int64_t token = layout.chunk_token_offset[c] + t;
        held[layout.rank].emplace_back(i, token);
        ++held_count[{i, token}];
      }
    }
    ASSERT_EQ(static_cast<int64_t>(held[layout.rank].size()), layout.num_held_tokens);
    for (int64_t p = 0; p < layout.num_held_tokens; ++p) {
      const auto [i, token] = held[layout.rank][p];
      const Sequence& seq = batch.sequences[i];
      const int64_t text = joint ? seq.text_tokens : 0;
      EXPECT_EQ(layout.token_sequence_index[p], i);
      EXPECT_EQ(layout.token_modality[p], token < text ? 1 : 0);
      const int64_t v = token - text;  // visual token index
      const std::vector<int64_t> thw =
          token < text ? std::vector<int64_t>{token, 0, 0}
                       : std::vector<int64_t>{v / (seq.grid_h * seq.grid_w),
                                              (v / seq.grid_w) % seq.grid_h, v % seq.grid_w};
      for (int axis = 0; axis < 3; ++axis) {
        EXPECT_EQ(layout.token_position_thw[3 * p + axis], thw[axis]);
      }
    }
  }
  int64_t total = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    total += seqs[i].num_tokens;
    for (int64_t t = 0; t < seqs[i].num_tokens; ++t) {
      EXPECT_EQ((held_count[{static_cast<int64_t>(i), t}]), 1) << "seq " << i << " token " << t;
    }
  }
  EXPECT_EQ(static_cast<int64_t>(held_count.size()), total);

  // Route: simulate the all_to_all on (seq, token) labels.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> source(num_ranks);
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int64_t t = 0; t < seqs[i].num_tokens; ++t) {
      source[seqs[i].source_rank].emplace_back(i, t);
    }
  }
  std::vector<std::vector<std::vector<std::pair<int64_t, int64_t>>>> route_sent(
      num_ranks, std::vector<std::vector<std::pair<int64_t, int64_t>>>(num_ranks));
  for (const StepProgram& layout : layouts) {
    ASSERT_EQ(layout.route.num_source, static_cast<int64_t>(source[layout.rank].size()));
    std::vector<int64_t> sorted = layout.route.send_index;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t k = 0; k < static_cast<int64_t>(sorted.size()); ++k) ASSERT_EQ(sorted[k], k);
    int64_t row = 0;
    for (int64_t s = 0; s < num_ranks; ++s) {
      for (int64_t n = 0; n < layout.route.send_splits[s]; ++n) {
        route_sent[layout.rank][s].push_back(source[layout.rank][layout.route.send_index[row++]]);
      }
    }
  }
  for (const StepProgram& layout : layouts) {
    std::vector<std::pair<int64_t, int64_t>> received;
    for (int64_t q = 0; q < num_ranks; ++q) {
      EXPECT_EQ(layout.route.recv_splits[q], layouts[q].route.send_splits[layout.rank]);
      const auto& part = route_sent[q][layout.rank];
      received.insert(received.end(), part.begin(), part.end());
    }
    for (int64_t p = 0; p < layout.num_held_tokens; ++p) {
      EXPECT_EQ(received[layout.route.recv_index[p]], held[layout.rank][p]);
    }
  }

  // Ulysses exchange: simulate on (seq, token, head) labels of own rows.
  std::vector<std::vector<std::vector<Row>>> exchange_sent(
      num_ranks, std::vector<std::vector<Row>>(num_ranks));
  for (const StepProgram& layout : layouts) {
    EXPECT_EQ(layout.world_has_exchange, layouts[0].world_has_exchange);
    int64_t row = 0;
    for (int64_t s = 0; s < num_ranks; ++s) {
      for (int64_t n = 0; n < layout.exchange_send_splits[s]; ++n) {
        const int64_t own_row = layout.exchange_send_index[row++];
        const auto [i, token] = held[layout.rank][own_row / num_heads];
        exchange_sent[layout.rank][s].emplace_back(i, token, own_row % num_heads);
      }
    }
  }
  std::vector<std::vector<Row>> exchange_rows(num_ranks);
  for (const StepProgram& layout : layouts) {
    std::vector<Row> received;
    for (int64_t q = 0; q < num_ranks; ++q) {
      EXPECT_EQ(layout.exchange_recv_splits[q], layouts[q].exchange_send_splits[layout.rank]);
      const auto& part = exchange_sent[q][layout.rank];
      received.insert(received.end(), part.begin(), part.end());
    }
    ASSERT_EQ(static_cast<int64_t>(received.size()), layout.num_exchange_rows);
    for (int64_t b = 0; b < layout.num_exchange_rows; ++b) {
      exchange_rows[layout.rank].push_back(received[layout.exchange_recv_index[b]]);
    }
  }

  // Segments: labels of every row must be (seq, block token, head) as the segment says, and every
  // (seq, token, head) must be a query row exactly once across ranks.
  std::map<Row, int> query_count;
  std::map<std::pair<int64_t, int64_t>, int64_t> first_token_of_segment;  // (rank, segment)
  for (const StepProgram& layout : layouts) {
    for (int64_t g = 0; g < layout.num_segments(); ++g) {
      const int64_t n = layout.segment_num_heads[g];
      const int64_t kind = layout.segment_kind[g];
      const bool in_exchange = layout.segment_in_exchange[g] == 1;
      EXPECT_EQ(in_exchange, kind == static_cast<int64_t>(SegmentKind::kUlysses) ||
                                 kind == static_cast<int64_t>(SegmentKind::kHybrid));
      int64_t first_token = -1;
      for (int64_t t = 0; t < layout.segment_num_tokens[g]; ++t) {
        for (int64_t h = 0; h < n; ++h) {
          const int64_t row = layout.segment_row_offset[g] + t * n + h;
          Row label;
          if (in_exchange) {
            label = exchange_rows[layout.rank][row];
          } else {
            const auto [i, token] = held[layout.rank][row / num_heads];
            label = {i, token, row % num_heads};
          }
          const auto [i, token, head] = label;
          EXPECT_EQ(i, layout.segment_sequence_index[g]);
          EXPECT_EQ(head, layout.segment_head_offset[g] + h);
          if (t == 0 && h == 0) first_token = token;
          EXPECT_EQ(token, first_token + t);
          ++query_count[label];
        }
      }
      first_token_of_segment[{layout.rank, g}] = first_token;
    }
  }
  int64_t total_rows = 0;
  for (const auto& [row, count] : query_count) EXPECT_EQ(count, 1);
  for (const Sequence& seq : seqs) total_rows += seq.num_tokens * num_heads;
  EXPECT_EQ(static_cast<int64_t>(query_count.size()), total_rows);

  // Ring table: peers agree on the ring, block sizes match the peers' segments, and the blocks
  // seen over all steps cover the sequence.
  for (const StepProgram& layout : layouts) {
    for (size_t e = 0; e < layout.ring_segment.size(); ++e) {
      const int64_t g = layout.ring_segment[e];
      const int64_t r = layout.ring_degree[e];
      const int64_t j = layout.ring_position[e];
      const int64_t begin = layout.ring_peer_offset[e];
      ASSERT_EQ(layout.ring_peer_offset[e + 1] - begin, r);
      EXPECT_EQ(layout.ring_peers[begin + j], layout.rank);
      EXPECT_EQ(layout.ring_block_tokens[begin + j], layout.segment_num_tokens[g]);
      int64_t covered = 0;
      for (int64_t jj = 0; jj < r; ++jj) {
        const StepProgram& peer = layouts[layout.ring_peers[begin + jj]];
        bool found = false;
        for (size_t f = 0; f < peer.ring_segment.size(); ++f) {
          const int64_t pg = peer.ring_segment[f];
          if (peer.segment_sequence_index[pg] != layout.segment_sequence_index[g]) continue;
          found = true;
          EXPECT_EQ(peer.ring_position[f], jj);
          EXPECT_EQ(peer.segment_num_heads[pg], layout.segment_num_heads[g]);
          EXPECT_EQ(peer.segment_head_offset[pg], layout.segment_head_offset[g]);
          EXPECT_EQ(peer.segment_num_tokens[pg], layout.ring_block_tokens[begin + jj]);
          if (peer.segment_num_tokens[pg] > 0) {  // a block may be empty when L < r
            EXPECT_EQ((first_token_of_segment[{peer.rank, pg}]), covered);
          }
        }
        EXPECT_TRUE(found);
        covered += layout.ring_block_tokens[begin + jj];
      }
      EXPECT_EQ(covered, seqs[layout.segment_sequence_index[g]].num_tokens);
    }
  }
}

// Everything the runtime executes, simulated on labels on every rank: the per-modality and
// cross-attention text routes deliver the right rows; the dense groups (local, Ulysses, ring step
// 0 and every ring step's messages, cross-attention) attend each (sequence, query token, head) to
// every key token of its sequence exactly once (text rows for cross-attention).
using Label = std::tuple<int64_t, int64_t, int64_t>;  // (sequence index, token, head)

// Rows [offset, offset + len * heads) as labels must be one sequence's tokens [t0, t0 + len) x
// heads [h0, h0 + heads), token-major. Returns (sequence, t0, h0).
Label check_span(const std::vector<Label>& rows, int64_t offset, int64_t len, int64_t heads) {
  EXPECT_LE(offset + len * heads, static_cast<int64_t>(rows.size()));
  const auto [i, t0, h0] = rows[offset];
  for (int64_t t = 0; t < len; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      EXPECT_EQ(rows[offset + t * heads + h], (Label{i, t0 + t, h0 + h}));
    }
  }
  return {i, t0, h0};
}

void check_execution(const Batch& batch, const std::vector<StepProgram>& programs, bool joint) {
  const int64_t num_ranks = static_cast<int64_t>(programs.size());
  const auto& seqs = batch.sequences;
  const int64_t N = programs[0].num_heads;

  // ---- Source rows per rank and modality, as labels (sequence, token in its attended list).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> src_all(num_ranks), src_mod[2];
  src_mod[0].resize(num_ranks);
  src_mod[1].resize(num_ranks);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> src_text(num_ranks);  // (seq, text k)
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t text = joint ? seqs[i].text_tokens : 0;
    for (int64_t t = 0; t < attended(seqs[i], joint); ++t) {
      src_all[seqs[i].source_rank].emplace_back(i, t);
      src_mod[t < text ? 1 : 0][seqs[i].source_rank].emplace_back(i, t);
    }
    for (int64_t k = 0; k < seqs[i].text_tokens; ++k)
      src_text[seqs[i].source_rank].emplace_back(i, k);
  }
  // Simulates one route on every rank: destination labels per rank.
  auto simulate = [&](const TokenRoute StepProgram::* which,
                      const std::vector<std::vector<std::pair<int64_t, int64_t>>>& source) {
    std::vector<std::vector<std::vector<std::pair<int64_t, int64_t>>>> sent(
        num_ranks, std::vector<std::vector<std::pair<int64_t, int64_t>>>(num_ranks));
    for (const StepProgram& p : programs) {
      const TokenRoute& r = p.*which;
      EXPECT_EQ(r.num_source, static_cast<int64_t>(source[p.rank].size()));
      int64_t row = 0;
      for (int64_t s = 0; s < num_ranks; ++s) {
        for (int64_t n = 0; n < r.send_splits[s]; ++n) {
          sent[p.rank][s].push_back(source[p.rank].at(r.send_index[row++]));
        }
      }
      EXPECT_EQ(row, static_cast<int64_t>(r.send_index.size()));
    }
    std::vector<std::vector<std::pair<int64_t, int64_t>>> out(num_ranks);
    for (const StepProgram& p : programs) {
      const TokenRoute& r = p.*which;
      std::vector<std::pair<int64_t, int64_t>> received;
      for (int64_t q = 0; q < num_ranks; ++q) {
        EXPECT_EQ(r.recv_splits[q], (programs[q].*which).send_splits[p.rank]);
        received.insert(received.end(), sent[q][p.rank].begin(), sent[q][p.rank].end());
      }
      EXPECT_EQ(r.num_held, static_cast<int64_t>(r.recv_index.size()));
      for (int64_t d = 0; d < r.num_held; ++d) out[p.rank].push_back(received.at(r.recv_index[d]));
    }
    return out;
  };
  const auto held_all = simulate(&StepProgram::route, src_all);
  const auto held_visual = simulate(&StepProgram::visual_route, src_mod[0]);
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> nothing(num_ranks);
  const auto held_text = simulate(&StepProgram::text_route, joint ? src_mod[1] : nothing);
  const auto cross_text = simulate(&StepProgram::cross_text_route, joint ? nothing : src_text);

  std::vector<std::vector<Label>> own(num_ranks), text_rows(num_ranks);
  for (const StepProgram& p : programs) {
    const int64_t r = p.rank;
    ASSERT_EQ(static_cast<int64_t>(held_all[r].size()), p.num_held_tokens);
    // Held visual / text tokens in held order are what the modality routes deliver.
    for (size_t k = 0; k < p.held_visual_index.size(); ++k) {
      EXPECT_EQ(p.token_modality[p.held_visual_index[k]], 0);
      EXPECT_EQ(held_visual[r].at(k), held_all[r][p.held_visual_index[k]]);
    }
    for (size_t k = 0; k < p.held_text_index.size(); ++k) {
      EXPECT_EQ(p.token_modality[p.held_text_index[k]], 1);
      EXPECT_EQ(held_text[r].at(k), held_all[r][p.held_text_index[k]]);
    }
    EXPECT_EQ(p.held_visual_index.size() + p.held_text_index.size(),
              static_cast<size_t>(p.num_held_tokens));
    // Chunks: tokens, text counts, chunk index per token, and the cross-attention text.
    for (size_t c = 0; c < p.chunk_num_tokens.size(); ++c) {
      const int64_t i = p.chunk_sequence_index[c];
      const int64_t text = joint ? seqs[i].text_tokens : 0;
      const int64_t first = p.chunk_token_offset[c], count = p.chunk_num_tokens[c];
      EXPECT_EQ(p.chunk_num_text_tokens[c],
                std::max<int64_t>(0, std::min(first + count, text) - first));
      EXPECT_EQ(p.chunk_cross_text_tokens[c], (!joint && count > 0) ? seqs[i].text_tokens : 0);
      for (int64_t t = 0; t < count; ++t) {
        EXPECT_EQ(p.token_chunk_index[p.chunk_held_offset[c] + t], static_cast<int64_t>(c));
      }
      for (int64_t k = 0; k < p.chunk_cross_text_tokens[c]; ++k) {
        EXPECT_EQ(cross_text[r].at(p.chunk_cross_text_offset[c] + k),
                  (std::pair<int64_t, int64_t>{i, k}));
      }
    }
    for (const auto& [i, t] : held_all[r]) {
      for (int64_t h = 0; h < N; ++h) own[r].emplace_back(i, t, h);
    }
    for (const auto& [i, k] : cross_text[r]) {
      for (int64_t h = 0; h < N; ++h) text_rows[r].emplace_back(i, k, h);
    }
  }

  // ---- Exchange rows (the Ulysses all_to_all, simulated on own-row labels). ----
  std::vector<std::vector<Label>> exchange(num_ranks);
  {
    std::vector<std::vector<std::vector<Label>>> sent(num_ranks,
                                                      std::vector<std::vector<Label>>(num_ranks));
    for (const StepProgram& p : programs) {
      int64_t row = 0;
      for (int64_t s = 0; s < num_ranks; ++s) {
        for (int64_t n = 0; n < p.exchange_send_splits[s]; ++n) {
          sent[p.rank][s].push_back(own[p.rank].at(p.exchange_send_index[row++]));
        }
      }
    }
    for (const StepProgram& p : programs) {
      std::vector<Label> received;
      for (int64_t q = 0; q < num_ranks; ++q) {
        received.insert(received.end(), sent[q][p.rank].begin(), sent[q][p.rank].end());
      }
      for (int64_t b = 0; b < p.num_exchange_rows; ++b) {
        exchange[p.rank].push_back(received.at(p.exchange_recv_index[b]));
      }
    }
  }

  // ---- Coverage: (rank, sequence, first query token, first head) -> key token intervals. ----
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>>
      keys_seen;
  std::map<std::pair<int64_t, int64_t>, int64_t> query_rows;  // (sequence, token) -> heads seen
  auto attend = [&](int64_t rank, const std::vector<SegmentGroup>& groups,
                    const std::vector<Label>& q_rows, const std::vector<Label>& k_rows,
                    bool count_queries) {
    for (const SegmentGroup& g : groups) {
      ASSERT_EQ(g.q_row_offset.size(), g.k_row_offset.size());
      for (size_t m = 0; m < g.q_row_offset.size(); ++m) {
        const auto [i, t0, h0] = check_span(q_rows, g.q_row_offset[m], g.q_len, g.num_heads);
        const auto [ki, k0, kh0] = check_span(k_rows, g.k_row_offset[m], g.k_len, g.num_heads);
        EXPECT_EQ(ki, i);
        EXPECT_EQ(kh0, h0);
        keys_seen[{rank, i, t0, h0}].emplace_back(k0, k0 + g.k_len);
        if (count_queries) {
          for (int64_t t = t0; t < t0 + g.q_len; ++t) query_rows[{i, t}] += g.num_heads;
        }
      }
    }
  };
  for (const StepProgram& p : programs) {
    const int64_t r = p.rank;
    attend(r, p.local_groups, own[r], own[r], true);
    attend(r, p.exchange_groups, exchange[r], exchange[r], true);
    // Ring: compact rows are the own-row blocks then the exchange-row blocks.
    std::vector<Label> compact;
    for (int64_t row : p.ring_own_rows) compact.push_back(own[r].at(row));
    for (int64_t row : p.ring_exchange_rows) compact.push_back(exchange[r].at(row));
    ASSERT_EQ(static_cast<int64_t>(compact.size()), p.ring_num_rows);
    attend(r, p.ring_step0_groups, compact, compact, true);
  }
  // Ring steps: what a rank receives from a peer is what that peer sends it at the same step.
  for (const StepProgram& p : programs) {
    const int64_t r = p.rank;
    for (size_t s = 0; s < p.ring_steps.size(); ++s) {
      const RingStep& step = p.ring_steps[s];
      std::vector<Label> buffer(step.num_recv_rows);
      for (const PeerRows& recv : step.recvs) {
        const StepProgram& peer = programs[recv.peer];
        ASSERT_LT(s, peer.ring_steps.size());
        std::vector<Label> message;
        std::vector<Label> peer_compact;
        for (int64_t row : peer.ring_own_rows) peer_compact.push_back(own[peer.rank].at(row));
        for (int64_t row : peer.ring_exchange_rows)
          peer_compact.push_back(exchange[peer.rank].at(row));
        int found = 0;
        for (const PeerRows& send : peer.ring_steps[s].sends) {
          if (send.peer != r) continue;
          ++found;
          for (const RowSlice& slice : send.rows) {
            for (int64_t row = slice.begin; row < slice.end; ++row)
              message.push_back(peer_compact.at(row));
          }
        }
        EXPECT_EQ(found, 1);
        ASSERT_EQ(recv.rows.size(), 1u);
        ASSERT_EQ(recv.rows[0].end - recv.rows[0].begin, static_cast<int64_t>(message.size()));
        std::copy(message.begin(), message.end(), buffer.begin() + recv.rows[0].begin);
      }
      std::vector<Label> compact;
      for (int64_t row : p.ring_own_rows) compact.push_back(own[r].at(row));
      for (int64_t row : p.ring_exchange_rows) compact.push_back(exchange[r].at(row));
      attend(r, step.groups, compact, buffer, false);
    }
  }
  // Every query row exactly once; its keys cover its whole sequence exactly once.
  int64_t total_rows = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int64_t t = 0; t < attended(seqs[i], joint); ++t) {
      EXPECT_EQ((query_rows[{static_cast<int64_t>(i), t}]), N) << "seq " << i << " token " << t;
      ++total_rows;
    }
  }
  EXPECT_EQ(static_cast<int64_t>(query_rows.size()), total_rows);
  for (auto& [key, intervals] : keys_seen) {
    std::sort(intervals.begin(), intervals.end());
    int64_t covered = 0;
    for (const auto& [begin, end] : intervals) {
      EXPECT_EQ(begin, covered);
      covered = end;
    }
    EXPECT_EQ(covered, attended(seqs[std::get<1>(key)], joint));
  }
  // Cross-attention: every nonempty chunk's queries against its sequence's whole text.
  for (const StepProgram& p : programs) {
    if (joint) EXPECT_TRUE(p.cross_groups.empty());
    int64_t rows = 0;
    for (const SegmentGroup& g : p.cross_groups) {
      for (size_t m = 0; m < g.q_row_offset.size(); ++m) {
        const auto [i, t0, h0] = check_span(own[p.rank], g.q_row_offset[m], g.q_len, g.num_heads);
        const auto [ki, k0, kh0] =
            check_span(text_rows[p.rank], g.k_row_offset[m], g.k_len, g.num_heads);
        EXPECT_EQ(ki, i);
        EXPECT_EQ(k0, 0);
        EXPECT_EQ(h0, 0);
        EXPECT_EQ(g.num_heads, N);
        EXPECT_EQ(g.k_len, seqs[i].text_tokens);
        rows += g.q_len;
      }
    }
    if (!joint) {
      int64_t expected = 0;
      for (size_t c = 0; c < p.chunk_num_tokens.size(); ++c) {
        if (p.chunk_cross_text_tokens[c] > 0) expected += p.chunk_num_tokens[c];
      }
      EXPECT_EQ(rows, expected);
    }
  }
}

TEST(PlanCompiler, RandomPlansConserveTokensAndRows) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t num_ranks = std::uniform_int_distribution<int64_t>(1, 8)(rng);
    const int64_t num_heads = std::uniform_int_distribution<int64_t>(1, 7)(rng);
    auto [batch, plan] = random_case(rng, num_ranks, num_heads);
    for (Sequence& seq : batch.sequences) {  // text of 0..9 tokens, some far longer than video
      seq.text_tokens = std::uniform_int_distribution<int64_t>(0, trial % 3 == 0 ? 30 : 9)(rng);
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    check_all_ranks(batch, plan, num_heads, /*joint=*/false);
    check_all_ranks(batch, plan, num_heads, /*joint=*/true);
  }
}

TEST(PlanCompiler, UnevenHeadsAndOneSequenceOverEveryRank) {
  Batch batch;
  batch.sequences.push_back(make_sequence(0, 3, 2, 5, 1));  // 30 tokens
  batch.sequences.push_back(make_sequence(1, 1, 1, 1, 0));  // 1 token
  Plan plan;
  plan.num_ranks = 5;
  plan.placements.push_back(make_placement(0, Strategy::kUlysses, {4, 2, 0, 1, 3}));
  plan.placements.push_back(make_placement(1, Strategy::kLocal, {2}));
  check_all_ranks(batch, plan, 24);
  const StepProgram last = compile_step_program(batch, plan, 3, 24, false);  // position 4: 4 heads
  ASSERT_EQ(last.num_segments(), 1);
  EXPECT_EQ(last.segment_num_heads[0], 4);
  EXPECT_EQ(last.segment_head_offset[0], 20);
  EXPECT_EQ(last.segment_num_tokens[0], 30);
  EXPECT_EQ(last.num_held_tokens, 6);
}

TEST(PlanCompiler, HybridBlocksAndRanksWithoutWork) {
  Batch batch;
  batch.sequences.push_back(make_sequence(7, 1, 1, 13, 0));
  Plan plan;
  plan.num_ranks = 8;
  plan.placements.push_back(make_placement(7, Strategy::kHybrid, {0, 1, 2, 3, 4, 5}, 2));
  check_all_ranks(batch, plan, 3);
  const StepProgram idle = compile_step_program(batch, plan, 7, 3, false);
  EXPECT_EQ(idle.num_held_tokens, 0);
  EXPECT_EQ(idle.num_segments(), 0);
  EXPECT_TRUE(idle.world_has_exchange);  // it still joins the collective, with zero splits
  const StepProgram r3 =
      compile_step_program(batch, plan, 3, 3, false);  // block 1 (5 tokens), chunk 1
  ASSERT_EQ(r3.ring_segment.size(), 1u);
  EXPECT_EQ(r3.ring_position[0], 1);
  EXPECT_EQ(r3.ring_peers, (std::vector<int64_t>{1, 3, 5}));
  EXPECT_EQ(r3.ring_block_tokens, (std::vector<int64_t>{5, 4, 4}));
  EXPECT_EQ(r3.segment_num_heads[0], 1);  // heads 2,1 over u = 2
}

TEST(PlanCompiler, RejectsMismatchedInput) {
  Batch batch;
  batch.sequences.push_back(make_sequence(0, 1, 2, 2, 0));
  Plan plan;
  plan.num_ranks = 2;
  plan.placements.push_back(make_placement(0, Strategy::kUlysses, {0, 1}));
  EXPECT_THROW(compile_step_program(batch, plan, 2, 4, false), std::invalid_argument);  // rank
  EXPECT_THROW(compile_step_program(batch, plan, 0, 0, false), std::invalid_argument);  // heads
  EXPECT_THROW(compile_step_program(batch, plan, 0, 1, false), std::invalid_argument);  // u > heads
  batch.sequences[0].id = 5;
  EXPECT_THROW(compile_step_program(batch, plan, 0, 4, false),
               std::invalid_argument);  // no placement
  batch.sequences[0].id = 0;
  batch.sequences[0].source_rank = 3;
  EXPECT_THROW(compile_step_program(batch, plan, 0, 4, false),
               std::invalid_argument);  // source rank
}

}  // namespace
}  // namespace zellige

namespace zellige {
namespace {

TEST(PlanCompiler, JointTextLeadsItsSequenceAndTravelsWithIt) {
  Batch batch;
  batch.sequences.push_back(make_sequence(0, 1, 2, 3, 1));  // 6 visual tokens
  batch.sequences[0].text_tokens = 4;                       // attended: 4 text + 6 visual
  Plan plan;
  plan.num_ranks = 2;
  plan.placements.push_back(make_placement(0, Strategy::kRing, {1, 0}));
  const StepProgram first = compile_step_program(batch, plan, 1, 2, true);  // block 0: 5 tokens
  EXPECT_EQ(first.num_held_tokens, 5);
  EXPECT_EQ(first.chunk_num_text_tokens, (std::vector<int64_t>{4}));
  EXPECT_EQ(first.token_modality, (std::vector<int64_t>{1, 1, 1, 1, 0}));
  EXPECT_EQ(first.token_position_thw,
            (std::vector<int64_t>{0, 0, 0, 1, 0, 0, 2, 0, 0, 3, 0, 0, 0, 0, 0}));
  EXPECT_EQ(first.held_text_index, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(first.route.num_source, 10);  // rank 1 loaded the sequence: text then visual
  EXPECT_EQ(first.text_route.num_source, 4);
  EXPECT_EQ(first.visual_route.num_source, 6);
  EXPECT_EQ(first.route.send_splits, (std::vector<int64_t>{5, 5}));
  EXPECT_EQ(first.text_route.send_splits, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(first.cross_text_route.send_index.empty());
  const StepProgram second = compile_step_program(batch, plan, 0, 2, true);
  EXPECT_EQ(second.chunk_num_text_tokens, (std::vector<int64_t>{0}));
  EXPECT_EQ(second.token_position_thw[0], 0);  // visual token 1: (0, 0, 1)
  EXPECT_EQ(second.token_position_thw[2], 1);
  check_all_ranks(batch, plan, 2, true);
  // Cross-attention: the same sequence holds visual tokens only; both ranks get the text.
  const StepProgram cross = compile_step_program(batch, plan, 0, 2, false);
  EXPECT_EQ(cross.num_held_tokens, 3);
  EXPECT_EQ(cross.chunk_cross_text_tokens, (std::vector<int64_t>{4}));
  EXPECT_EQ(cross.cross_text_route.recv_splits, (std::vector<int64_t>{0, 4}));
}

TEST(PlanCompiler, GroupSegmentsByShapeLargestFirst) {
  const auto groups = group_segments({30, 0, 60, 90, 7}, {30, 0, 60, 90, 7}, {5, 5, 10, 5, 0},
                                     {5, 5, 10, 5, 3}, {2, 2, 3, 2, 2});
  ASSERT_EQ(groups.size(), 2u);  // the empty segment is dropped
  EXPECT_EQ(groups[0].q_len, 10);
  EXPECT_EQ(groups[1].q_row_offset, (std::vector<int64_t>{0, 30, 90}));
  EXPECT_THROW(group_segments({0}, {}, {1}, {1}, {1}), std::invalid_argument);
}

TEST(PlanCompiler, ProgramRoundTripsThroughItsBinaryForm) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    auto [batch, plan] = random_case(rng, 4, 3);
    for (Sequence& seq : batch.sequences) seq.text_tokens = trial % 5;
    const StepProgram program = compile_step_program(batch, plan, trial % 4, 3, trial % 2 == 0);
    const std::string bytes = serialize_step_program(program);
    EXPECT_EQ(deserialize_step_program(bytes), program);
    EXPECT_THROW(deserialize_step_program(bytes.substr(0, bytes.size() - 1)),
                 std::invalid_argument);
    EXPECT_THROW(deserialize_step_program(bytes + "x"), std::invalid_argument);
    std::string corrupted = bytes;
    corrupted[0] ^= 1;  // the magic number
    EXPECT_THROW(deserialize_step_program(corrupted), std::invalid_argument);
  }
}

TEST(PlanCompiler, RefusesTextNoRankCanHold) {
  Batch batch;
  batch.sequences.push_back(make_sequence(0, 1, 2, 2, 0));
  batch.sequences[0].text_tokens = int64_t{1} << 40;
  Plan plan;
  plan.num_ranks = 2;
  plan.placements.push_back(make_placement(0, Strategy::kLocal, {1}));
  EXPECT_THROW(compile_step_program(batch, plan, 0, 4, true), std::invalid_argument);
  EXPECT_THROW(compile_step_program(batch, plan, 1, 4, false), std::invalid_argument);
  batch.sequences[0].text_tokens = std::numeric_limits<int64_t>::max();  // overflows with tokens
  EXPECT_THROW(compile_step_program(batch, plan, 1, 4, true), std::invalid_argument);
}

}  // namespace
}  // namespace zellige
