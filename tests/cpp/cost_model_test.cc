#include "zellige/cost_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "test_util.h"
#include "zellige/planners.h"
#include "zellige/simulator.h"

namespace zellige {
namespace {

using test_util::seeded_profile;

using test_util::iota_ranks;
using test_util::make_model;

double share_time(const CostModel& cost_model, const RankShare& share) {
  return cost_model.rank_time_s(share.tokens, share.attention_s, share.exchange_s);
}

double bottleneck_s(const CostModel& cost_model, const std::vector<RankShare>& shares) {
  double worst = 0;
  for (const RankShare& share : shares) worst = std::max(worst, share_time(cost_model, share));
  return worst;
}

TEST(Table, InterpolatesAndExtrapolatesInLogLogSpace) {
  const Table table{{10, 100, 1000}, {1, 100, 1000}, "measured"};
  EXPECT_DOUBLE_EQ(table(10), 1);
  EXPECT_DOUBLE_EQ(table(100), 100);
  EXPECT_NEAR(table(std::sqrt(10.0 * 100.0)), 10, 1e-9);  // slope 2 on the first segment
  EXPECT_NEAR(table(1), 0.01, 1e-12);                     // extends the first segment
  EXPECT_NEAR(table(10000), 10000, 1e-6);                 // extends the last segment (slope 1)
  const Table single{{5}, {3}, "measured"};
  EXPECT_DOUBLE_EQ(single(1e6), 3);
}

TEST(Table, ValidateRejectsBadTables) {
  EXPECT_THROW((Table{{1, 2}, {1}, "measured"}).validate("t"), std::invalid_argument);
  EXPECT_THROW((Table{{2, 1}, {1, 1}, "measured"}).validate("t"), std::invalid_argument);
  EXPECT_THROW((Table{{1, 2}, {0, 1}, "measured"}).validate("t"), std::invalid_argument);
  EXPECT_THROW((Table{{1, 2}, {1, 2}, "guessed"}).validate("t"), std::invalid_argument);
  EXPECT_NO_THROW((Table{{1, 2}, {1, 2}, "seeded"}).validate("t"));
  EXPECT_NO_THROW(Table{}.validate("empty"));
}

TEST(Profile, ValidateRejectsMissingRates) {
  EXPECT_THROW(analytic_profile("x", 0, 1, 1), std::invalid_argument);
  HardwareProfile profile = seeded_profile();
  profile.exchange_group_sizes = {4};
  EXPECT_THROW(profile.validate(), std::invalid_argument);  // no table for the group size
  profile = seeded_profile();
  profile.exchange_overlap = 1.0;
  EXPECT_THROW(profile.validate(), std::invalid_argument);
  profile = seeded_profile();
  profile.memory_models = {"wan-14b"};
  EXPECT_THROW(profile.validate(), std::invalid_argument);
}

TEST(CostModel, MeasuredStepFixedBytesReplaceTheAnalyticLayerBuffers) {
  const ModelSpec model = model_preset("wan-14b");
  HardwareProfile profile = seeded_profile();
  profile.memory_models = {"wan-14b", "tiny"};
  profile.activation_bytes_per_token_layer = {0, 0};
  profile.checkpoint_bytes_per_token_layer = {0, 0};
  const double analytic = CostModel(model, profile, make_cluster(8, 8)).fixed_bytes();
  profile.step_fixed_bytes = {1.5e9, 0};
  const double layer_params = static_cast<double>(model.param_count) / model.num_layers;
  // the analytic two gathered bf16 layers and one layer's fp32 gradients give way to 1.5 GB
  EXPECT_NEAR(CostModel(model, profile, make_cluster(8, 8)).fixed_bytes(),
              analytic - 8.0 * layer_params + 1.5e9, 1.0);
  profile.step_fixed_bytes = {0, 1.5e9};  // another model's row changes nothing
  EXPECT_DOUBLE_EQ(CostModel(model, profile, make_cluster(8, 8)).fixed_bytes(), analytic);
  profile.step_fixed_bytes = {1.5e9};  // not one per model
  EXPECT_THROW(profile.validate(), std::invalid_argument);
  profile.step_fixed_bytes = {-1.0, 0};
  EXPECT_THROW(profile.validate(), std::invalid_argument);
}

TEST(CostModel, MeasuredShardBytesPerTokenReplaceTheAnalyticExchangeBuffers) {
  const ModelSpec model = model_preset("wan-14b");
  HardwareProfile profile = seeded_profile();
  profile.memory_models = {"wan-14b"};
  profile.activation_bytes_per_token_layer = {0};
  profile.checkpoint_bytes_per_token_layer = {0};
  const Sequence sequence = sequence_from_tokens(0, "video", 32768, 512, 0);
  auto shard_bytes = [&](double ulysses, double ring, Strategy strategy) {
    profile.ulysses_bytes_per_token = {ulysses};
    profile.ring_bytes_per_token = {ring};
    const CostModel cost_model(model, profile, make_cluster(8, 8));
    return cost_model.shares(sequence, make_placement(0, strategy, {0, 1}))[0].memory_bytes;
  };
  // 16384 held tokens each: the measured rate is charged per held token, in place of the
  // analytic buffers, and a negative rate lowers the peak
  EXPECT_NEAR(shard_bytes(3000, 0, Strategy::kUlysses) - shard_bytes(1000, 0, Strategy::kUlysses),
              16384.0 * 2000, 1e-3);
  EXPECT_NEAR(shard_bytes(0, -500, Strategy::kRing) - shard_bytes(0, 1500, Strategy::kRing),
              -16384.0 * 2000, 1e-3);
  EXPECT_DOUBLE_EQ(shard_bytes(0, 7, Strategy::kUlysses), shard_bytes(0, 9, Strategy::kUlysses));
  profile.ring_bytes_per_token = {std::nan("")};
  EXPECT_THROW(profile.validate(), std::invalid_argument);
  profile.ring_bytes_per_token = {1.0, 2.0};
  EXPECT_THROW(profile.validate(), std::invalid_argument);
}

TEST(CostModel, ParametersOutsideTheBlocksStayGatheredInBf16) {
  ModelSpec model = model_preset("wan-14b");
  EXPECT_EQ(block_param_count(model), model.param_count);  // a preset counts its blocks only
  const double blocks_only = CostModel(model, seeded_profile(), make_cluster(8, 8)).fixed_bytes();
  const double root = 2.0e8;  // embeddings, time and text MLPs, final layer of a real module
  model.param_count += static_cast<int64_t>(root);
  const CostOptions options;
  // its shard of state (as every parameter's) and its gathered bf16 copy; the layer buffers
  // still follow the blocks' own size
  EXPECT_NEAR(CostModel(model, seeded_profile(), make_cluster(8, 8)).fixed_bytes() - blocks_only,
              root * options.state_bytes_per_param / 8.0 + 2.0 * root, 1.0);
}

TEST(CostModel, RejectsModelWithoutHeads) {
  ModelSpec model = model_preset("tiny");
  model.num_heads = 0;
  EXPECT_THROW(CostModel(model, seeded_profile(), make_cluster(8, 8)), std::invalid_argument);
}

TEST(CostModel, AnalyticAttentionMatchesFlops) {
  const ModelSpec model = model_preset("wan-14b");
  const CostModel cost_model(model, analytic_profile("a", 750e12, 640e12, 4.2e12),
                             make_cluster(8, 8));
  const Sequence sequence = sequence_from_tokens(0, "video", 20000, 0, 0);
  const auto shares = cost_model.shares(sequence, make_placement(0, Strategy::kLocal, {0}));
  // fwd + bwd (2.5x) of 4 L^2 d per layer; selective checkpointing recomputes no attention.
  const double expected = 3.5 * 4.0 * 20000.0 * 20000.0 * static_cast<double>(model.width) *
                          static_cast<double>(model.num_layers) / 640e12;
  EXPECT_NEAR(shares[0].attention_s, expected, expected * 1e-9);
  EXPECT_EQ(shares[0].exchange_s, 0);
}

TEST(CostModel, TimeAndMemoryGrowWithLength) {
  const CostModel cost_model = make_model("wan-14b", 8, 8);
  double previous_linear = 0, previous_attention = 0, previous_memory = 0;
  for (int64_t tokens : {100, 256, 1000, 4096, 30000, 75600, 200000}) {
    const Sequence sequence = sequence_from_tokens(0, "video", tokens, 512, 0);
    const RankShare share =
        cost_model.shares(sequence, make_placement(0, Strategy::kLocal, {0}))[0];
    const double linear = cost_model.linear_time_s(tokens);
    EXPECT_GT(linear, previous_linear) << tokens;
    EXPECT_GT(share.attention_s, previous_attention) << tokens;
    EXPECT_GT(share.memory_bytes, previous_memory) << tokens;
    previous_linear = linear;
    previous_attention = share.attention_s;
    previous_memory = share.memory_bytes;
  }
  EXPECT_EQ(cost_model.linear_time_s(0), 0);
  EXPECT_LE(cost_model.min_linear_time_per_token_s() * 75600, cost_model.linear_time_s(75600));
  EXPECT_LE(cost_model.min_linear_time_per_token_s() * 1e7, cost_model.linear_time_s(10000000));
}

TEST(CostModel, DegreeOneEqualsLocal) {
  const CostModel cost_model = make_model("mmdit-11b", 8, 8);
  const Sequence sequence = sequence_from_tokens(0, "video", 30000, 512, 0);
  const RankShare local = cost_model.shares(sequence, make_placement(0, Strategy::kLocal, {3}))[0];
  for (Strategy strategy : {Strategy::kUlysses, Strategy::kRing}) {
    const RankShare one = cost_model.shares(sequence, make_placement(0, strategy, {3}))[0];
    EXPECT_EQ(one.tokens, local.tokens);
    EXPECT_DOUBLE_EQ(one.attention_s, local.attention_s);
    EXPECT_DOUBLE_EQ(one.exchange_s, local.exchange_s);
    EXPECT_DOUBLE_EQ(one.memory_bytes, local.memory_bytes);
  }
  EXPECT_EQ(local.tokens, 30512);  // joint attention: text tokens are in the unit
}

TEST(CostModel, UlyssesExchangeOnlyWhenShardedAndSlowerAcrossNodes) {
  const CostModel cost_model = make_model("wan-14b", 16, 8);
  const Sequence sequence = sequence_from_tokens(0, "video", 75600, 512, 0);
  const auto local = cost_model.shares(sequence, make_placement(0, Strategy::kLocal, {0}));
  EXPECT_EQ(local[0].exchange_s, 0);
  EXPECT_EQ(cost_model.exchange_bytes(sequence, make_placement(0, Strategy::kLocal, {0})), 0);
  const Placement inside = make_placement(0, Strategy::kUlysses, iota_ranks(0, 8));
  const Placement across = make_placement(0, Strategy::kUlysses, iota_ranks(4, 8));
  const auto inside_shares = cost_model.shares(sequence, inside);
  const auto across_shares = cost_model.shares(sequence, across);
  for (size_t i = 0; i < inside_shares.size(); ++i) {
    EXPECT_GT(inside_shares[i].exchange_s, 0);
    EXPECT_GT(across_shares[i].exchange_s, 2 * inside_shares[i].exchange_s);
    EXPECT_DOUBLE_EQ(across_shares[i].attention_s, inside_shares[i].attention_s);
  }
  // Same bytes either way, apart from routing (source rank 0 is not in the second set).
  EXPECT_GT(cost_model.exchange_bytes(sequence, across),
            cost_model.exchange_bytes(sequence, inside));
  // Bytes: 4 n d (1 - 1/u) per layer and pass (fwd, bwd), 3 n d (1 - 1/u) for the recompute's
  // q, k, v, plus routing 7/8 of L.
  const double n = 75600.0 / 8, d = 5120;
  const double expected = 8 * (n * d * 2 * (7.0 / 8.0) * 40 * (4 * 2 + 3)) + 2 * 512 * 7 * n;
  EXPECT_NEAR(cost_model.exchange_bytes(sequence, inside), expected, expected * 1e-9);
  // Splitting 8 ways beats the single rank by far on a 75k-token clip.
  EXPECT_LT(bottleneck_s(cost_model, inside_shares), bottleneck_s(cost_model, local) / 5);
}

TEST(CostModel, UnevenHeadSplitLoadsRanksWithMoreHeads) {
  const CostModel cost_model = make_model("mmdit-11b", 8, 8);  // 24 heads over 5: 5,5,5,5,4
  const Sequence sequence = sequence_from_tokens(0, "video", 50000, 0, 0);
  const auto shares =
      cost_model.shares(sequence, make_placement(0, Strategy::kUlysses, iota_ranks(0, 5)));
  ASSERT_EQ(shares.size(), 5u);
  EXPECT_NEAR(shares[0].attention_s / shares[4].attention_s, 5.0 / 4.0, 1e-9);
  EXPECT_GT(share_time(cost_model, shares[0]), share_time(cost_model, shares[4]));
  EXPECT_GT(shares[0].memory_bytes, shares[4].memory_bytes);
}

TEST(CostModel, RingHidesTransfersBehindLongBlocksOnly) {
  const CostModel cost_model = make_model("mmdit-11b", 16, 8);
  const Sequence long_sequence = sequence_from_tokens(0, "video", 120000, 0, 0);
  const auto long_shares =
      cost_model.shares(long_sequence, make_placement(0, Strategy::kRing, iota_ranks(0, 4)));
  // Only the step latencies remain: 3 steps x 2 passes (forward, backward: the recompute keeps
  // the ring's outputs) x 57 layers x 15 us.
  const double latency_s = 3 * 2 * 57 * cost_model.cluster().intra_node_latency_s;
  EXPECT_NEAR(long_shares[0].exchange_s, latency_s, latency_s * 1e-9);
  const Sequence short_sequence = sequence_from_tokens(0, "image", 4096, 0, 0);
  const auto short_shares = cost_model.shares(
      short_sequence, make_placement(0, Strategy::kRing, {0, 8, 1, 9}));  // crosses nodes
  double ring_latency_s = 3 * 2 * 57 * cost_model.cluster().inter_node_latency_s;
  EXPECT_GT(short_shares[0].exchange_s, ring_latency_s * 1.01);
}

TEST(CostModel, HybridExchangeSitsBetweenUlyssesAndRing) {
  const CostModel cost_model = make_model("wan-14b", 16, 8);
  const Sequence sequence = sequence_from_tokens(0, "video", 118800, 512, 0);
  const double ulysses_bytes =
      cost_model.exchange_bytes(sequence, make_placement(0, Strategy::kUlysses, iota_ranks(0, 16)));
  const double ring_bytes =
      cost_model.exchange_bytes(sequence, make_placement(0, Strategy::kRing, iota_ranks(0, 16)));
  const Placement hybrid = make_placement(0, Strategy::kHybrid, iota_ranks(0, 16), 8);
  ASSERT_EQ(hybrid.ring_degree, 2);
  const double hybrid_bytes = cost_model.exchange_bytes(sequence, hybrid);
  EXPECT_GT(hybrid_bytes, ulysses_bytes);
  EXPECT_LT(hybrid_bytes, ring_bytes);
  // Ulysses 16 crosses the node; hybrid(8, 2) keeps its all-to-alls inside each node.
  const auto ulysses_shares =
      cost_model.shares(sequence, make_placement(0, Strategy::kUlysses, iota_ranks(0, 16)));
  const auto hybrid_shares = cost_model.shares(sequence, hybrid);
  EXPECT_LT(hybrid_shares[0].exchange_s, ulysses_shares[0].exchange_s);
}

TEST(CostModel, CheckpointingTradesTimeForMemory) {
  const CostModel with = make_model("wan-14b", 8, 8, true);
  const CostModel without = make_model("wan-14b", 8, 8, false);
  const Sequence sequence = sequence_from_tokens(0, "video", 30000, 512, 0);
  const Placement local = make_placement(0, Strategy::kLocal, {0});
  const RankShare a = with.shares(sequence, local)[0];
  const RankShare b = without.shares(sequence, local)[0];
  EXPECT_GT(share_time(with, a), share_time(without, b));
  EXPECT_LT(a.memory_bytes, b.memory_bytes / 5);
}

TEST(CostModel, EvaluateAddsMemoryAndSumsRanks) {
  const CostModel cost_model = make_model("wan-1.3b", 8, 8);
  Batch batch;
  batch.sequences = {sequence_from_tokens(0, "video", 20000, 512, 0),
                     sequence_from_tokens(1, "image", 1024, 512, 1),
                     sequence_from_tokens(2, "video", 40000, 512, 2)};
  Plan plan;
  plan.num_ranks = 8;
  plan.placements = {make_placement(0, Strategy::kLocal, {0}),
                     make_placement(1, Strategy::kLocal, {0}),
                     make_placement(2, Strategy::kUlysses, {2, 3, 4, 5})};
  const PlanCost cost = cost_model.evaluate(batch, plan);
  const RankShare a = cost_model.shares(batch.sequences[0], plan.placements[0])[0];
  const RankShare b = cost_model.shares(batch.sequences[1], plan.placements[1])[0];
  // The peak is the maximum over the backward's progress of the two shares' per-layer sums
  // (gradients appear layer by layer). With a full recompute of every layer (the least memory)
  // it is never above the planners' additive sum of always-held state and every share's memory.
  EXPECT_DOUBLE_EQ(cost.ranks[0].peak_bytes,
                   cost_model.rank_peak_bytes(a.layer_activation_bytes + b.layer_activation_bytes,
                                              a.layer_checkpoint_bytes + b.layer_checkpoint_bytes,
                                              a.buffer_bytes + b.buffer_bytes, 30));
  EXPECT_EQ(cost.ranks[0].full_recompute_layers, 0);
  EXPECT_LE(cost_model.rank_peak_bytes(a.layer_activation_bytes + b.layer_activation_bytes,
                                       a.layer_checkpoint_bytes + b.layer_checkpoint_bytes,
                                       a.layer_input_bytes + b.layer_input_bytes,
                                       a.buffer_bytes + b.buffer_bytes, 30, 30),
            cost_model.fixed_bytes() + a.memory_bytes + b.memory_bytes);
  EXPECT_EQ(cost.ranks[0].checkpointed_layers, 30);
  EXPECT_EQ(cost.ranks[0].tokens, 21024);
  EXPECT_DOUBLE_EQ(cost.ranks[0].time_s,
                   cost_model.rank_time_s(21024, a.attention_s + b.attention_s, 0.0));
  EXPECT_DOUBLE_EQ(cost.ranks[1].time_s, 0);
  EXPECT_DOUBLE_EQ(cost.ranks[1].peak_bytes, cost_model.fixed_bytes());  // every gradient
  double makespan = 0;
  for (const RankCost& rank : cost.ranks) makespan = std::max(makespan, rank.time_s);
  EXPECT_DOUBLE_EQ(cost.makespan_s, makespan);
  EXPECT_TRUE(cost.fits);
  // Sequence 1 moves from rank 1 to rank 0 and back; sequence 2 leaves rank 2 on 3 of 4 ranks.
  const double exchanges = cost_model.exchange_bytes(batch.sequences[2], plan.placements[2]);
  EXPECT_DOUBLE_EQ(cost.exchange_bytes, 2 * 512 * 1024 + exchanges);

  plan.num_ranks = 16;
  EXPECT_THROW(cost_model.evaluate(batch, plan), std::invalid_argument);
}

TEST(CostModel, OversizedSequenceDoesNotFit) {
  // Without checkpointing a 129-frame 720p clip keeps ~160 GB of wan-14b activations.
  const CostModel cost_model = make_model("wan-14b", 16, 8, false);
  Batch batch;
  batch.sequences = {sequence_from_tokens(0, "video", 118800, 512, 0)};
  Plan plan;
  plan.num_ranks = 16;
  plan.placements = {make_placement(0, Strategy::kUlysses, iota_ranks(0, 8))};
  EXPECT_FALSE(cost_model.evaluate(batch, plan).fits);
  plan.placements = {make_placement(0, Strategy::kUlysses, iota_ranks(0, 16))};
  EXPECT_TRUE(cost_model.evaluate(batch, plan).fits);
}

TEST(Simulator, TimelineEndsAtRankTimes) {
  const CostModel cost_model = make_model("wan-1.3b", 8, 8);
  Batch batch;
  batch.sequences = {sequence_from_tokens(0, "video", 20000, 512, 0),
                     sequence_from_tokens(1, "image", 1024, 512, 1),
                     sequence_from_tokens(2, "video", 40000, 512, 2)};
  Plan plan;
  plan.num_ranks = 8;
  plan.placements = {make_placement(0, Strategy::kLocal, {0}),
                     make_placement(1, Strategy::kLocal, {0}),
                     make_placement(2, Strategy::kHybrid, {2, 3, 4, 5}, 2)};
  const PlanCost cost = cost_model.evaluate(batch, plan);
  const auto segments = simulate(batch, plan, cost_model);
  std::vector<double> end(8, 0.0);
  for (const TimelineSegment& segment : segments) {
    EXPECT_LT(segment.start_s, segment.end_s);
    EXPECT_NEAR(segment.start_s, end[segment.rank], 1e-12);  // back to back
    end[segment.rank] = segment.end_s;
  }
  for (int64_t rank = 0; rank < 8; ++rank) {
    EXPECT_NEAR(end[rank], cost.ranks[rank].time_s, 1e-9) << rank;
  }
  plan.placements.pop_back();
  EXPECT_THROW(simulate(batch, plan, cost_model), std::invalid_argument);
}

}  // namespace
}  // namespace zellige
