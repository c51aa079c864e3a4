// Plan compiler: layouts of all ranks together must move every token (and every token x head row)
// exactly once to where the placement contract says, with matching split sizes on both ends.
#include "zellige/plan_compiler.h"

#include <gtest/gtest.h>

#include <algorithm>
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

void check_all_ranks(const Batch& batch, const Plan& plan, int64_t num_heads) {
  const int64_t num_ranks = plan.num_ranks;
  std::vector<StepProgram> layouts;
  for (int64_t r = 0; r < num_ranks; ++r) {
    layouts.push_back(compile_step_program(batch, plan, r, num_heads, false));
  }
  const auto& seqs = batch.sequences;

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
      const Sequence& seq = seqs[i];
      EXPECT_EQ(layout.token_sequence_index[p], i);
      EXPECT_EQ(layout.token_position_thw[3 * p], token / (seq.grid_h * seq.grid_w));
      EXPECT_EQ(layout.token_position_thw[3 * p + 1], (token / seq.grid_w) % seq.grid_h);
      EXPECT_EQ(layout.token_position_thw[3 * p + 2], token % seq.grid_w);
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

TEST(PlanCompiler, RandomPlansConserveTokensAndRows) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t num_ranks = std::uniform_int_distribution<int64_t>(1, 8)(rng);
    const int64_t num_heads = std::uniform_int_distribution<int64_t>(1, 7)(rng);
    auto [batch, plan] = random_case(rng, num_ranks, num_heads);
    SCOPED_TRACE("trial " + std::to_string(trial));
    check_all_ranks(batch, plan, num_heads);
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
  const StepProgram r3 = compile_step_program(batch, plan, 3, 3, false);  // block 1 (5 tokens), chunk 1
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
  EXPECT_THROW(compile_step_program(batch, plan, 0, 4, false), std::invalid_argument);  // no placement
  batch.sequences[0].id = 0;
  batch.sequences[0].source_rank = 3;
  EXPECT_THROW(compile_step_program(batch, plan, 0, 4, false), std::invalid_argument);  // source rank
}

}  // namespace
}  // namespace zellige
