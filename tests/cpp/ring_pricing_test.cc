// Ring and hybrid placements priced in time and memory linear in their ranks: a ring of r ranks
// has r steps on each rank, each a call of its own, so evaluate() counts them instead of listing
// r x r calls. Oracle: the count by hand, and the memoised evaluate() (a separate path).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "test_util.h"
#include "zellige/cost_model.h"
#include "zellige/plan.h"

namespace zellige {
namespace {

// Ranks 0..degree-1 of a ring (u == 1) or hybrid placement of sequence `id`.
Placement ring_placement(int64_t id, int64_t ulysses_degree, int64_t ring_degree) {
  std::vector<int64_t> ranks(static_cast<size_t>(ulysses_degree * ring_degree));
  std::iota(ranks.begin(), ranks.end(), 0);
  return ulysses_degree == 1 ? make_placement(id, Strategy::kRing, ranks)
                             : make_placement(id, Strategy::kHybrid, ranks, ulysses_degree);
}

void expect_same_ranks(const PlanCost& a, const PlanCost& b) {
  ASSERT_EQ(a.ranks.size(), b.ranks.size());
  for (size_t i = 0; i < a.ranks.size(); ++i) {
    SCOPED_TRACE("rank " + std::to_string(i));
    EXPECT_EQ(a.ranks[i].time_s, b.ranks[i].time_s);
    EXPECT_EQ(a.ranks[i].peak_bytes, b.ranks[i].peak_bytes);
    EXPECT_EQ(a.ranks[i].attention_s, b.ranks[i].attention_s);
    EXPECT_EQ(a.ranks[i].exchange_s, b.ranks[i].exchange_s);
    EXPECT_EQ(a.ranks[i].call_s, b.ranks[i].call_s);
    EXPECT_EQ(a.ranks[i].launch_floor_s, b.ranks[i].launch_floor_s);
    EXPECT_EQ(a.ranks[i].attention_calls, b.ranks[i].attention_calls);
  }
  EXPECT_EQ(a.makespan_s, b.makespan_s);
}

TEST(RingPricing, EachRankCallsOncePerNonemptyBlockAndOnceForItsText) {
  const CostModel model(model_preset("wan-14b"), test_util::seeded_profile(), make_cluster(16, 8));
  for (const int64_t text_tokens : {int64_t{0}, int64_t{77}}) {
    for (const int64_t tokens : {int64_t{3}, int64_t{7}, int64_t{64}, int64_t{1001}}) {
      for (const auto [u, r] : {std::pair<int64_t, int64_t>{1, 2}, {1, 5}, {1, 8}, {1, 16},
                                {2, 2}, {2, 3}, {4, 4}, {8, 2}}) {
        SCOPED_TRACE(std::to_string(tokens) + " tokens, u " + std::to_string(u) + ", r " +
                     std::to_string(r) + ", text " + std::to_string(text_tokens));
        const Batch batch = test_util::batch_of({tokens}, text_tokens);
        Plan plan;
        plan.num_ranks = 16;
        plan.placements = {ring_placement(0, u, r)};
        const PlanCost cost = model.evaluate(batch, plan);
        const int64_t nonempty_blocks = std::min(tokens, r);
        for (int64_t j = 0; j < r; ++j) {
          const int64_t block = tokens / r + (j < tokens % r ? 1 : 0);
          for (int64_t k = 0; k < u; ++k) {
            const int64_t chunk = block / u + (k < block % u ? 1 : 0);
            const int64_t expected =
                (block > 0 ? nonempty_blocks : 0) + (text_tokens > 0 && chunk > 0 ? 1 : 0);
            EXPECT_EQ(cost.ranks[j * u + k].attention_calls, expected) << "position " << j * u + k;
            EXPECT_EQ(cost.ranks[j * u + k].call_s, 0);
          }
        }
        EvaluationCache cache;
        expect_same_ranks(model.evaluate(batch, plan, cache), cost);
        expect_same_ranks(model.evaluate(batch, plan, cache), cost);  // the memoised entry
      }
    }
  }
}

TEST(RingPricing, RingStepsBesideLocalSequencesAddTheirOwnCalls) {
  const CostModel model(model_preset("wan-14b"), test_util::seeded_profile(), make_cluster(8, 8));
  // Sequence 1's length equals sequence 0's ring block: its call still never joins a ring step.
  const Batch batch = test_util::batch_of({4000, 1000, 1000}, /*text_tokens=*/512);
  Plan plan;
  plan.num_ranks = 8;
  plan.placements = {ring_placement(0, 1, 4), make_placement(1, Strategy::kLocal, {0}),
                     make_placement(2, Strategy::kLocal, {0})};
  const PlanCost cost = model.evaluate(batch, plan);
  // Rank 0: four ring steps, one self-attention call of sequences 1 and 2 together, one
  // cross-attention call of all three (1000 query tokens against 512 text tokens each).
  EXPECT_EQ(cost.ranks[0].attention_calls, 4 + 1 + 1);
  EXPECT_EQ(cost.ranks[1].attention_calls, 4 + 1);
  EvaluationCache cache;
  expect_same_ranks(model.evaluate(batch, plan, cache), cost);
}

// Sizing a sequence prices every degree up to the rank count: its largest share's memory takes
// O(1) per shape. Oracle: the shares themselves, bit for bit.
TEST(RingPricing, TheLargestShareMemoryIsTheSharesMaximum) {
  for (const char* preset : {"wan-14b", "tiny", "mmdit-tiny"}) {
    const CostModel model(model_preset(preset), test_util::seeded_profile(), make_cluster(64, 8));
    const int64_t heads = model.model().num_heads;
    for (const int64_t text_tokens : {int64_t{0}, int64_t{77}}) {
      for (const int64_t tokens : {int64_t{3}, int64_t{7}, int64_t{1001}, int64_t{65537}}) {
        const Sequence sequence = sequence_from_tokens(0, "video", tokens, text_tokens, 0);
        for (int64_t u = 1; u <= std::min<int64_t>(heads, 8); ++u) {
          for (const int64_t r : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{8}}) {
            if (u * r == 1) continue;
            std::vector<int64_t> ranks(static_cast<size_t>(u * r));
            std::iota(ranks.begin(), ranks.end(), 0);
            const Placement placement = r == 1 ? make_placement(0, Strategy::kUlysses, ranks)
                                                : ring_placement(0, u, r);
            double most_bytes = 0;
            for (const RankShare& share : model.shares(sequence, placement)) {
              most_bytes = std::max(most_bytes, share.memory_bytes);
            }
            EXPECT_EQ(model.max_share_memory_bytes(sequence, u, r), most_bytes)
                << preset << " " << tokens << " tokens, u " << u << ", r " << r;
          }
        }
        const double local_bytes = model.shares(sequence, make_placement(0, Strategy::kLocal, {0}))[0]
                                 .memory_bytes;
        EXPECT_EQ(model.max_share_memory_bytes(sequence, 1, 1), std::max(0.0, local_bytes));
      }
    }
  }
}

// A ring over the most ranks allowed: r x r step calls (2^28) would take gigabytes.
TEST(RingPricing, AWideRingIsPricedInMemoryLinearInItsRanks) {
  constexpr int64_t kRanks = 16384;
  const CostModel model(model_preset("wan-14b"), test_util::seeded_profile(),
                        make_cluster(kRanks, 8));
  const Batch batch = test_util::batch_of({int64_t{1} << 20}, /*text_tokens=*/512);
  Plan plan;
  plan.num_ranks = kRanks;
  plan.placements = {ring_placement(0, 1, kRanks)};
  const PlanCost cost = model.evaluate(batch, plan);
  EvaluationCache cache;
  const PlanCost cached = model.evaluate(batch, plan, cache);
  for (int64_t rank : {int64_t{0}, kRanks / 2, kRanks - 1}) {
    EXPECT_EQ(cost.ranks[rank].attention_calls, kRanks + 1);  // every block, and the text
    EXPECT_EQ(cached.ranks[rank].attention_calls, kRanks + 1);
  }
  EXPECT_EQ(cost.makespan_s, cached.makespan_s);
  EXPECT_GT(cost.makespan_s, 0);
}

// busiest_share_s visits a few positions of a ring instead of all of them: it must give the largest
// estimate over every share that shares() lists, for rings whose blocks are all equal, mostly big
// or mostly small, for one or two big blocks, within a node and across nodes, and for hybrids.
TEST(RingPricing, TheBusiestShareIsTheLargestOfTheListedShares) {
  const CostModel model = test_util::make_model("wan-14b", 64, 8);
  const double s_per_token = 3e-6;
  for (int64_t tokens : {4096, 4097, 4099, 65536, 65537, 65543, 100003}) {
    for (int64_t text_tokens : {0, 512}) {
      const Sequence sequence = sequence_from_tokens(0, "video", tokens, text_tokens, 0);
      for (int64_t ulysses : {1, 2, 4}) {
        for (int64_t ring : {2, 3, 7, 8, 12, 16}) {
          SCOPED_TRACE(std::to_string(tokens) + " tokens, " + std::to_string(ulysses) + " x " +
                       std::to_string(ring));
          const Placement placement = ring_placement(0, ulysses, ring);
          double expected_s = 0;
          for (const RankShare& share : model.shares(sequence, placement)) {
            expected_s = std::max(expected_s, static_cast<double>(share.tokens) * s_per_token +
                                                  share.attention_s + share.exchange_s);
          }
          EXPECT_EQ(model.busiest_share_s(sequence, placement, s_per_token), expected_s);
        }
      }
    }
  }
}

// share_runs lists a ring's shares as runs of alike positions: expanded, the runs must give every
// field of every share that shares() lists, rank included, for the rings above, placed within a
// node, across a node boundary and over many nodes; without Ulysses in at most four runs.
TEST(RingPricing, ShareRunsExpandToTheListedShares) {
  const CostModel model = test_util::make_model("wan-14b", 1024, 8);
  for (int64_t tokens : {4096, 4097, 4099, 65536, 65537, 65543, 100003, 764114}) {
    for (int64_t text_tokens : {0, 512}) {
      const Sequence sequence = sequence_from_tokens(0, "video", tokens, text_tokens, 0);
      for (int64_t ulysses : {1, 2}) {
        for (int64_t ring : {2, 3, 7, 8, 12, 16, 64, 512}) {
          for (int64_t first_rank : {0, 4, 6}) {
            SCOPED_TRACE(std::to_string(tokens) + " tokens, " + std::to_string(ulysses) + " x " +
                         std::to_string(ring) + " from rank " + std::to_string(first_rank));
            std::vector<int64_t> ranks(static_cast<size_t>(ulysses * ring));
            std::iota(ranks.begin(), ranks.end(), first_rank);
            const Placement placement =
                ulysses == 1 ? make_placement(0, Strategy::kRing, ranks)
                             : make_placement(0, Strategy::kHybrid, ranks, ulysses);
            const std::vector<RankShare> listed = model.shares(sequence, placement);
            const auto runs = model.share_runs(sequence, placement);
            if (ulysses == 1) EXPECT_LE(runs.size(), 4u);
            size_t position = 0;
            for (const auto& [count, share] : runs) {
              ASSERT_GT(count, 0);
              for (int64_t k = 0; k < count; ++k, ++position) {
                ASSERT_LT(position, listed.size());
                const RankShare& expected = listed[position];
                EXPECT_EQ(share.rank + k, expected.rank);
                EXPECT_EQ(share.tokens, expected.tokens);
                EXPECT_EQ(share.attention_s, expected.attention_s);
                EXPECT_EQ(share.exchange_s, expected.exchange_s);
                EXPECT_EQ(share.memory_bytes, expected.memory_bytes);
                EXPECT_EQ(share.layer_activation_bytes, expected.layer_activation_bytes);
                EXPECT_EQ(share.layer_checkpoint_bytes, expected.layer_checkpoint_bytes);
                EXPECT_EQ(share.layer_input_bytes, expected.layer_input_bytes);
                EXPECT_EQ(share.buffer_bytes, expected.buffer_bytes);
                EXPECT_EQ(share.recompute_s, expected.recompute_s);
                EXPECT_EQ(share.recompute_exchange_s, expected.recompute_exchange_s);
                EXPECT_EQ(share.attention_recompute_s, expected.attention_recompute_s);
                EXPECT_EQ(share.attention_recompute_exchange_s,
                          expected.attention_recompute_exchange_s);
              }
            }
            EXPECT_EQ(position, listed.size());
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace zellige
