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

using test_util::brute_force_makespan;
using test_util::seeded_profile;

CostModel make_model(const std::string& model, int64_t gpus, int64_t gpus_per_node,
                     bool checkpointing = true) {
  CostOptions options;
  options.activation_checkpointing = checkpointing;
  return CostModel(model_preset(model), seeded_profile(), make_cluster(gpus, gpus_per_node),
                   options);
}

// wan-1.3b on `cluster` with `memory_bytes` a GPU, under an analytic profile: the checkpointing
// tests size memory against its activations.
CostModel wan_1p3b_model(Cluster cluster, bool adaptive_checkpointing, int64_t memory_bytes) {
  cluster.gpu_memory_bytes = memory_bytes;
  CostOptions options;
  options.adaptive_checkpointing = adaptive_checkpointing;
  return CostModel(model_preset("wan-1.3b"), analytic_profile("t", 700e12, 550e12, 4.2e12),
                   cluster, options);
}

double share_time(const CostModel& cost_model, const RankShare& share) {
  return cost_model.rank_time_s(share.tokens, share.attention_s, share.exchange_s);
}

double bottleneck_s(const CostModel& cost_model, const std::vector<RankShare>& shares) {
  double worst = 0;
  for (const RankShare& share : shares) worst = std::max(worst, share_time(cost_model, share));
  return worst;
}

std::vector<int64_t> iota_ranks(int64_t first, int64_t count) {
  std::vector<int64_t> ranks(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) ranks[i] = first + i;
  return ranks;
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

TEST(LowerBound, NeverAboveBruteForceOptimum) {
  // 2 nodes x 2 GPUs so that placements can cross a node; tiny model (4 heads, cross-attention).
  const ModelSpec tiny = model_preset("tiny");
  const std::vector<std::vector<int64_t>> cases = {
      {4096}, {100000}, {300, 5000}, {20000, 20000}, {64, 2000, 30000}, {500, 500, 500}};
  // A profile whose attention efficiency rises, dips and rises again, with a measured all-to-all
  // table for pairs: the bound must not assume monotone tables.
  HardwareProfile bumpy = analytic_profile("bumpy", 1e12, 1e12, 1e11);
  bumpy.attention_forward_s_per_head = {
      {100, 1000, 3000, 10000}, {1e-7, 2e-6, 4e-5, 2e-4}, "measured"};
  bumpy.attention_backward_s_per_head = {{50, 5000}, {1e-6, 1e-3}, "measured"};
  bumpy.matmul_forward_flops_per_s = {{10, 100, 1000}, {1e11, 8e11, 5e11}, "measured"};
  bumpy.exchange_group_sizes = {2};
  bumpy.exchange_intra_node_s = {{{1e3, 1e7}, {1e-5, 1e-2}, "measured"}};
  for (const HardwareProfile& profile :
       {seeded_profile(), analytic_profile("a", 1e12, 1e12, 1e11), bumpy}) {
    Cluster cluster = make_cluster(4, 2);
    cluster.intra_node_bytes_per_s = 1e9;  // slow links, so that sharding is not free
    cluster.inter_node_bytes_per_s = 1e8;
    const CostModel cost_model(tiny, profile, cluster);
    for (const auto& lengths : cases) {
      Batch batch;
      for (size_t i = 0; i < lengths.size(); ++i) {
        batch.sequences.push_back(sequence_from_tokens(static_cast<int64_t>(i), "video", lengths[i],
                                                       8, static_cast<int64_t>(i)));
      }
      const double bound = makespan_lower_bound(batch, cost_model);
      const double optimum = brute_force_makespan(batch, cost_model);
      EXPECT_GT(bound, 0);
      EXPECT_LE(bound, optimum * (1 + 1e-12)) << profile.device_name << " " << lengths.size();
    }
  }
}

TEST(LowerBound, NeverAboveBruteForceOptimumOnRandomBatches) {
  std::mt19937_64 random(7);
  const ModelSpec tiny = model_preset("tiny");
  for (int trial = 0; trial < 12; ++trial) {
    Cluster cluster = make_cluster(4, trial % 2 == 0 ? 2 : 4);
    cluster.intra_node_bytes_per_s = trial % 3 == 0 ? 1e8 : 1e10;
    cluster.inter_node_bytes_per_s = cluster.intra_node_bytes_per_s / 10;
    cluster.gpu_memory_bytes = int64_t{3400} << 20;  // tight: long sequences must be split
    const CostModel cost_model(tiny, seeded_profile(), cluster,
                               CostOptions{trial % 4 != 1, 2, 18.0, 0.05});
    Batch batch;
    const int64_t num_sequences = 1 + static_cast<int64_t>(random() % 3);
    for (int64_t i = 0; i < num_sequences; ++i) {
      const int64_t tokens = int64_t{1} << (3 + random() % 15);  // 8 .. 131072
      batch.sequences.push_back(
          sequence_from_tokens(i, "video", tokens + static_cast<int64_t>(random() % 7), 8, i % 4));
    }
    const double bound = makespan_lower_bound(batch, cost_model);
    const double optimum = brute_force_makespan(batch, cost_model);
    EXPECT_TRUE(std::isfinite(bound));  // even when nothing fits (then the plan is refused)
    if (std::isfinite(optimum)) EXPECT_LE(bound, optimum * (1 + 1e-12)) << "trial " << trial;
  }
}

// The bound's call excess, launch floor and per-token rate under the makespan (issue 15): a
// profile whose calls of few heads are slower per head (so grouping equal segments matters),
// with a launch floor and a GEMM rate that peaks at a size no rank of these batches reaches.
// Repeated lengths and texts let segments of several sequences share a call.
// With ragged calls (profile.attention_ragged) too: the bound stays below the optimum, and no
// planner's plan beats it.
class LowerBoundRagged : public ::testing::TestWithParam<bool> {};

TEST_P(LowerBoundRagged, WithCallTablesLaunchFloorAndGemmPeakNeverAboveBruteForceOptimum) {
  HardwareProfile profile = seeded_profile();
  profile.attention_ragged = GetParam();
  const std::vector<double> call_heads = {1, 2, 4, 8, 64};
  for (double length : {64.0, 4096.0, 65536.0}) {
    Table table{call_heads, {}, "measured"};
    // Per head, a call of h heads is (1 + 2 / h) x the largest call's, and a bit slower for
    // short segments (the slowdown varies with the length too).
    for (double h : call_heads) {
      table.y.push_back(h * 1e-9 * length * length * (1.0 + (2.0 + 1e3 / length) / h));
    }
    profile.attention_call_lengths.push_back(length);
    profile.attention_call_forward_s.push_back(table);
    profile.attention_call_backward_s.push_back(table);
  }
  profile.matmul_forward_flops_per_s = {{64, 4096, 1 << 22}, {2e13, 3e14, 9e14}, "measured"};
  profile.memory_models = {"tiny"};
  profile.activation_bytes_per_token_layer = {0};
  profile.checkpoint_bytes_per_token_layer = {0};
  profile.launch_s_per_layer = {2e-4};
  profile.launch_s_per_attention_call = {5e-5};
  profile.validate();
  const ModelSpec tiny = model_preset("tiny");
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> cases = {
      {{300, 8}, {300, 8}, {300, 8}},    {{64, 8}, {64, 8}, {5000, 8}},
      {{4096, 16}, {4096, 8}},           {{20000, 8}, {20000, 8}, {900, 8}},
      {{100000, 8}},                     {{2000, 8}, {3000, 16}, {2000, 16}},
      {{128, 0}, {128, 0}, {128, 0}}};
  for (int64_t gpus_per_node : {2, 4}) {
    Cluster cluster = make_cluster(4, gpus_per_node);
    cluster.intra_node_bytes_per_s = 1e9;
    cluster.inter_node_bytes_per_s = 1e8;
    for (bool checkpointing : {true, false}) {
      CostOptions options;
      options.activation_checkpointing = checkpointing;
      const CostModel cost_model(tiny, profile, cluster, options);
      for (const auto& lengths : cases) {
        Batch batch;
        for (size_t i = 0; i < lengths.size(); ++i) {
          batch.sequences.push_back(sequence_from_tokens(static_cast<int64_t>(i), "video",
                                                         lengths[i].first, lengths[i].second,
                                                         static_cast<int64_t>(i)));
        }
        const double bound = makespan_lower_bound(batch, cost_model);
        const double optimum = brute_force_makespan(batch, cost_model);
        EXPECT_GT(bound, 0);
        EXPECT_LE(bound, optimum * (1 + 1e-12))
            << gpus_per_node << " " << checkpointing << " " << lengths.size() << " "
            << lengths[0].first;
        for (const char* name : {"dp-tokens", "dp-cost", "megatron-dcp", "static-cp:2",
                                 "zellige"}) {
          Plan plan;
          try {
            plan = make_plan(name, batch, cost_model);
          } catch (const PlanMemoryError&) {
            continue;
          }
          const double makespan_s = cost_model.evaluate(batch, plan).makespan_s;
          EXPECT_EQ(plan.predicted.makespan_s, makespan_s) << name;
          EXPECT_GE(makespan_s, optimum * (1 - 1e-12)) << name;
          EvaluationCache cache;
          EXPECT_LE(cost_model.makespan_floor(batch, plan, cache), makespan_s * (1 + 1e-12))
              << name;
        }
      }
    }
  }
  // More equal sequences than ranks: the optimum groups their segments into shared calls.
  const std::vector<std::pair<int64_t, int64_t>> crowded = {{300, 5}, {4096, 5}, {40000, 4}};
  for (const auto& [length, count] : crowded) {
    const CostModel cost_model(tiny, profile, make_cluster(2, 2));
    Batch batch;
    for (int64_t i = 0; i < count; ++i) {
      batch.sequences.push_back(sequence_from_tokens(i, "video", length, 8, i % 2));
    }
    EXPECT_LE(makespan_lower_bound(batch, cost_model),
              brute_force_makespan(batch, cost_model) * (1 + 1e-12))
        << length;
  }
  // Distinct lengths, more than ranks: the optimum shares a rank between different lengths,
  // whose table a ragged call runs without any call's excess.
  {
    const CostModel cost_model(tiny, profile, make_cluster(2, 2));
    Batch batch;
    for (int64_t i = 0; i < 4; ++i) {
      batch.sequences.push_back(sequence_from_tokens(i, "video", 40000 + 1000 * i, 0, i % 2));
    }
    EXPECT_LE(makespan_lower_bound(batch, cost_model),
              brute_force_makespan(batch, cost_model) * (1 + 1e-12));
  }
  // The terms bite: without call tables, launch floor and GEMM peak the bound is lower.
  HardwareProfile plain = seeded_profile();
  plain.matmul_forward_flops_per_s = {{64, 1 << 22}, {2e13, 9e14}, "measured"};
  const Cluster cluster = make_cluster(4, 4);
  Batch batch;
  for (int64_t i = 0; i < 3; ++i) {
    batch.sequences.push_back(sequence_from_tokens(i, "video", 300, 8, i));
  }
  EXPECT_GT(makespan_lower_bound(batch, CostModel(tiny, profile, cluster)),
            1.05 * makespan_lower_bound(batch, CostModel(tiny, plain, cluster)));
}

INSTANTIATE_TEST_SUITE_P(CostModel, LowerBoundRagged, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "ragged" : "dense"; });

TEST(LowerBound, BelowHandMadePlansAtScale) {
  const CostModel cost_model = make_model("wan-14b", 32, 8);
  Batch batch;
  const std::vector<int64_t> lengths = {118800, 75600, 75600, 32760, 14040, 3600, 3600, 1024,
                                        1024,   1024,  256,   256,   256,   256,  256,  256};
  for (size_t i = 0; i < lengths.size(); ++i) {
    batch.sequences.push_back(sequence_from_tokens(static_cast<int64_t>(i), "video", lengths[i],
                                                   512, static_cast<int64_t>(i) % 32));
  }
  const double bound = makespan_lower_bound(batch, cost_model);
  Plan dp, ulysses, ring, mixed;
  for (Plan* plan : {&dp, &ulysses, &ring, &mixed}) plan->num_ranks = 32;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t id = static_cast<int64_t>(i);
    dp.placements.push_back(make_placement(id, Strategy::kLocal, {id}));
    ulysses.placements.push_back(
        make_placement(id, Strategy::kUlysses, iota_ranks((id % 4) * 8, 8)));
    ring.placements.push_back(make_placement(id, Strategy::kRing, iota_ranks((id % 2) * 16, 16)));
    if (i < 3) {
      mixed.placements.push_back(make_placement(id, Strategy::kUlysses, iota_ranks(id * 8, 8)));
    } else {
      mixed.placements.push_back(make_placement(id, Strategy::kLocal, {24 + id % 8}));
    }
  }
  for (const Plan* plan : {&dp, &ulysses, &ring, &mixed}) {
    const PlanCost cost = cost_model.evaluate(batch, *plan);
    if (cost.fits) EXPECT_LE(bound, cost.makespan_s);
  }
  // The 118,800-token clip alone needs at least its best split over 32 ranks.
  EXPECT_GT(bound, cost_model.linear_time_s(118800) / 32);
}

// The peak over the backward's progress, by hand: 3 layers, per layer A = 10, C = 1, buffer 5,
// gradients g per layer. Layer j's backward holds the kept activations of layers below j, its own
// full activations (recomputed around its checkpoint, which is part of them), the buffer and the
// gradients above j.
TEST(CostModel, PeakIsTheMaximumOverTheBackwardsProgress) {
  ModelSpec spec = model_preset("wan-1.3b");
  spec.num_layers = 3;
  const CostModel cost_model(spec, analytic_profile("t", 700e12, 550e12, 4.2e12),
                             make_cluster(1, 1));
  const double held = cost_model.fixed_bytes() - cost_model.gradient_bytes();
  const double root_grads = static_cast<double>(spec.param_count - block_param_count(spec)) * 4.0;
  const double g = (cost_model.gradient_bytes() - root_grads) / 3.0;
  ASSERT_GT(g, 0);
  const double a = 10, c = 1, buffer = 5;
  // none checkpointed: at layer 2 (first in the backward) 2a below + a own; grads grow after
  const double none = std::max({held + cost_model.gradient_bytes(), held + 2 * a + a + buffer,
                                held + g + a + a + buffer, held + 2 * g + a + buffer});
  EXPECT_NEAR(cost_model.rank_peak_bytes(a, c, buffer, 0), none, 1e-3);
  // the first 2 checkpointed: layer 1 recomputes a above the checkpoint of layer 0
  const double two = std::max({held + cost_model.gradient_bytes(), held + 2 * c + a + buffer,
                               held + g + c + a + buffer, held + 2 * g + a + buffer});
  EXPECT_NEAR(cost_model.rank_peak_bytes(a, c, buffer, 2), two, 1e-3);
  // and the first of them a full recompute keeping only its input i: below layer 1, i not c
  const double i = 0.25;
  const double full = std::max({held + cost_model.gradient_bytes(), held + i + c + a + buffer,
                                held + g + i + a + buffer, held + 2 * g + a + buffer});
  EXPECT_NEAR(cost_model.rank_peak_bytes(a, c, i, buffer, 2, 1), full, 1e-3);
  // more checkpointing never needs more memory when activations outweigh checkpoints
  const double big_a = 4e9;
  for (int64_t k = 1; k <= 3; ++k) {
    EXPECT_LE(cost_model.rank_peak_bytes(big_a, c, buffer, k),
              cost_model.rank_peak_bytes(big_a, c, buffer, k - 1));
  }
}

// mmdit-11b cut to the validation harness's 3 blocks (one double, two single), its weights the
// blocks' alone: the memory tests below price one rank of it.
ModelSpec mmdit_three_blocks() {
  ModelSpec spec = model_preset("mmdit-11b");
  spec.num_layers = 3;
  spec.num_double_layers = 1;
  spec.param_count = block_param_count(spec);
  return spec;
}

// An analytic profile with measured-looking memory rows for mmdit-11b: activations and
// checkpoints per token and layer as the MMDiT probes measured them, and the backward's
// buffers per token and layer as given.
HardwareProfile mmdit_memory_profile(double backward_bytes_per_token_layer) {
  HardwareProfile profile = analytic_profile("t", 700e12, 550e12, 4.2e12);
  profile.memory_models = {"mmdit-11b"};
  profile.activation_bytes_per_token_layer = {150000};
  profile.checkpoint_bytes_per_token_layer = {12000};
  profile.backward_bytes_per_token_layer = {backward_bytes_per_token_layer};
  return profile;
}

// The profile's reduce rows add the step's second peak moment: right after the backward of a
// layer of the largest kind (an MMDiT's double blocks, which come first), its gradients being
// reduced (reduce_fixed_bytes in place of step_fixed_bytes), the kept bytes below it, the
// gradients above it and reduce_bytes_per_token per held token. A small rank peaks there, a
// large one at the backward as before; without the rows nothing changes.
TEST(CostModel, GradientReductionIsTheSmallRanksPeak) {
  const ModelSpec spec = mmdit_three_blocks();
  HardwareProfile profile = mmdit_memory_profile(80000);
  profile.step_fixed_bytes = {1.0e9};
  const CostModel backward_only(spec, profile, make_cluster(8, 8));
  profile.reduce_fixed_bytes = {2.5e9};
  profile.reduce_bytes_per_token = {90000};
  const CostModel with_reduce(spec, profile, make_cluster(8, 8));
  EXPECT_DOUBLE_EQ(with_reduce.fixed_bytes(), backward_only.fixed_bytes());

  const double held = with_reduce.fixed_bytes() - with_reduce.gradient_bytes();
  // one gradient share per layer unit, a double block counting twice (4 units here)
  const double g = with_reduce.gradient_bytes() / 4.0;
  const auto rank_with = [](int64_t tokens) {
    Batch batch;
    batch.sequences = {sequence_from_tokens(0, "image", tokens - 512, 512, 0)};
    Plan plan;
    plan.num_ranks = 8;
    plan.placements = {make_placement(0, Strategy::kLocal, {0})};
    return std::pair{batch, plan};
  };
  for (const int64_t tokens : {2048, 60000}) {
    const auto [batch, plan] = rank_with(tokens);
    const double n = static_cast<double>(tokens);
    const double before = backward_only.evaluate(batch, plan).ranks[0].peak_bytes;
    const double after = with_reduce.evaluate(batch, plan).ranks[0].peak_bytes;
    // the backward of the last layer: two checkpoints below, its activations and buffers
    const double backward_peak = held + n * (2 * 12000.0 + 150000.0 + 80000.0);
    // after the double block (layer 0): nothing kept below, the two single blocks' gradients
    const double reduce_peak = held - 1.0e9 + 2.5e9 + 2 * g + n * 90000.0;
    EXPECT_NEAR(after, std::max(before, reduce_peak), 1.0);
    if (tokens == 2048) {
      EXPECT_NEAR(after, reduce_peak, 1.0);
      EXPECT_GT(after, before + 1e9);
    } else {
      EXPECT_NEAR(after, backward_peak, 1.0);
      EXPECT_DOUBLE_EQ(after, before);
    }
  }
}

// The profile's backward_peak_bytes table (the backward's fixed bytes and buffers measured at
// several token counts) replaces the rows' line through two of them, read linearly between the
// packs and along the end segments: a rank between two packs gets their interpolation, one
// beyond them the last segment's extension; equal to the rows where the table meets them.
TEST(CostModel, MeasuredBackwardPeakReplacesTheRowsLine) {
  const ModelSpec spec = mmdit_three_blocks();
  HardwareProfile profile = mmdit_memory_profile(60000);
  profile.step_fixed_bytes = {1.0e9};
  const CostModel rows_only(spec, profile, make_cluster(8, 8));
  // measured: on the rows' line at 16k and 64k, 0.2 GB below it at 32k, 0.3 GB above at 96k
  const auto line = [](double x) { return 1.0e9 + 60000.0 * x; };
  profile.backward_peak_bytes = {Table{{16384, 32768, 65536, 98304},
                                       {line(16384), line(32768) - 2e8, line(65536),
                                        line(98304) + 3e8},
                                       "measured"}};
  const CostModel measured(spec, profile, make_cluster(8, 8));
  const auto peak = [](const CostModel& model, int64_t tokens) {
    Batch batch;
    batch.sequences = {sequence_from_tokens(0, "video", tokens - 512, 512, 0)};
    Plan plan;
    plan.num_ranks = 8;
    plan.placements = {make_placement(0, Strategy::kLocal, {0})};
    return model.evaluate(batch, plan).ranks[0].peak_bytes;
  };
  EXPECT_NEAR(peak(measured, 16384), peak(rows_only, 16384), 1.0);
  EXPECT_NEAR(peak(measured, 65536), peak(rows_only, 65536), 1.0);
  EXPECT_NEAR(peak(measured, 32768), peak(rows_only, 32768) - 2e8, 1.0);
  EXPECT_NEAR(peak(measured, 49152), peak(rows_only, 49152) - 1e8, 1.0);    // halfway
  EXPECT_NEAR(peak(measured, 81920), peak(rows_only, 81920) + 1.5e8, 1.0);  // halfway
  EXPECT_NEAR(peak(measured, 114688), peak(rows_only, 114688) + 4.5e8, 1.0);  // beyond
  EXPECT_NEAR(measured.rank_peak_bytes(1e6, 1e4, 0.0, 1e6, 3, 0),
              rows_only.rank_peak_bytes(1e6, 1e4, 0.0, 1e6, 3, 0), 1.0);  // no tokens: rows
}

// A Ulysses shard over u ranks exchanges (u - 1) / u of its q/k/v/o and their gradients:
// ulysses_exchanged_bytes_per_token charges the share beyond the measured 2 ranks' half, per
// held token; 2 ranks as before, 8 ranks 3/8 of it more.
TEST(CostModel, UlyssesBuffersGrowWithTheShareExchanged) {
  HardwareProfile profile = mmdit_memory_profile(80000);
  profile.ulysses_bytes_per_token = {50000};
  const Sequence sequence = sequence_from_tokens(0, "video", 64000, 512, 0);
  const auto buffer = [&](const HardwareProfile& p, int64_t degree) {
    const CostModel model(model_preset("mmdit-11b"), p, make_cluster(8, 8));
    std::vector<int64_t> ranks(static_cast<size_t>(degree));
    for (int64_t r = 0; r < degree; ++r) ranks[static_cast<size_t>(r)] = r;
    const RankShare share =
        model.shares(sequence, make_placement(0, Strategy::kUlysses, ranks))[0];
    return std::pair{share.buffer_bytes, static_cast<double>(share.tokens)};
  };
  HardwareProfile wider = profile;
  wider.ulysses_exchanged_bytes_per_token = {40000};
  for (const int64_t degree : {2, 4, 8}) {
    const auto [before, n] = buffer(profile, degree);
    const auto [after, n_after] = buffer(wider, degree);
    ASSERT_EQ(n, n_after);
    const double share = (static_cast<double>(degree) - 1.0) / static_cast<double>(degree);
    EXPECT_NEAR(after - before, n * 40000.0 * (share - 0.5), 1.0) << degree;
  }
  EXPECT_GT(buffer(wider, 8).first, buffer(profile, 8).first);
}

// A rank's attention backward runs in phases (local calls, Ulysses-exchanged calls, ring
// steps) whose buffers never coexist: attention_phase_bytes_per_token comes off the rank's
// backward buffers for every held token outside its largest phase. A rank of one phase (local
// sequences of any lengths, or one shard) is priced as before; the planners' additive sizing,
// which keeps every share's buffers, is unchanged and so stays at or above evaluate's peak.
TEST(CostModel, AttentionPhasesHoldTheirBuffersOneAtATime) {
  HardwareProfile profile = mmdit_memory_profile(60000);
  profile.ulysses_bytes_per_token = {50000};
  profile.ring_bytes_per_token = {80000};
  HardwareProfile phased = profile;
  phased.attention_phase_bytes_per_token = {25000};
  Batch batch;
  batch.sequences = {sequence_from_tokens(0, "video", 30000, 512, 0),   // local, rank 0
                     sequence_from_tokens(1, "video", 9000, 256, 0),    // local, rank 0
                     sequence_from_tokens(2, "video", 40000, 512, 0),   // ring over 0, 1
                     sequence_from_tokens(3, "video", 20000, 512, 2),   // Ulysses over 2, 3
                     sequence_from_tokens(4, "video", 12000, 256, 2),   // local, rank 2
                     sequence_from_tokens(5, "video", 16000, 512, 4)};  // local, rank 4
  Plan plan;
  plan.num_ranks = 8;
  plan.placements = {make_placement(0, Strategy::kLocal, {0}),
                     make_placement(1, Strategy::kLocal, {0}),
                     make_placement(2, Strategy::kRing, {0, 1}),
                     make_placement(3, Strategy::kUlysses, {2, 3}),
                     make_placement(4, Strategy::kLocal, {2}),
                     make_placement(5, Strategy::kLocal, {4})};
  const CostModel before(model_preset("mmdit-11b"), profile, make_cluster(8, 8));
  const CostModel after(model_preset("mmdit-11b"), phased, make_cluster(8, 8));
  const PlanCost was = before.evaluate(batch, plan);
  const PlanCost now = after.evaluate(batch, plan);
  const auto tokens = [&](int64_t sequence, const Placement& placement, size_t position) {
    return static_cast<double>(
        before.shares(batch.sequences[static_cast<size_t>(sequence)], placement)[position]
            .tokens);
  };
  // rank 0: local phase (both local sequences) beside the ring phase (its ring shard)
  const double local0 = tokens(0, plan.placements[0], 0) + tokens(1, plan.placements[1], 0);
  const double ring0 = tokens(2, plan.placements[2], 0);
  ASSERT_EQ(was.ranks[0].checkpointed_layers, now.ranks[0].checkpointed_layers);
  EXPECT_NEAR(was.ranks[0].peak_bytes - now.ranks[0].peak_bytes,
              25000.0 * std::min(local0, ring0), 1.0);
  // rank 2: a local sequence beside a Ulysses shard
  const double local2 = tokens(4, plan.placements[4], 0);
  const double ulysses2 = tokens(3, plan.placements[3], 0);
  EXPECT_NEAR(was.ranks[2].peak_bytes - now.ranks[2].peak_bytes,
              25000.0 * std::min(local2, ulysses2), 1.0);
  // one phase: the ring's other rank, the Ulysses group's other rank, a rank of local sequences
  for (const int rank : {1, 3, 4}) {
    EXPECT_DOUBLE_EQ(was.ranks[rank].peak_bytes, now.ranks[rank].peak_bytes) << rank;
  }
  // two local sequences of distinct lengths are one phase too
  Plan local_only = plan;
  local_only.placements[2] = make_placement(2, Strategy::kLocal, {1});
  EXPECT_DOUBLE_EQ(before.evaluate(batch, local_only).ranks[0].peak_bytes,
                   after.evaluate(batch, local_only).ranks[0].peak_bytes);
  // the shares (the planners' additive sizing) are unchanged: they keep every phase's buffers,
  // at or above the peak before (EvaluateAddsMemoryAndSumsRanks), which is above the peak now
  for (size_t p = 0; p < plan.placements.size(); ++p) {
    const auto a = before.shares(batch.sequences[p], plan.placements[p]);
    const auto b = after.shares(batch.sequences[p], plan.placements[p]);
    for (size_t k = 0; k < a.size(); ++k) EXPECT_DOUBLE_EQ(a[k].memory_bytes, b[k].memory_bytes);
  }
}

// Weights kept from the forward to the backward (zellige.train on one rank): before layer j's
// backward the gathered bf16 weights of layers 0..j are held, two of which the fixed bytes count
// already. With 4 layers and large activations the peak is at layer 3: two layers' weights more.
TEST(CostModel, KeptWeightsAddTheGatheredLayersAboveTwo) {
  ModelSpec spec = model_preset("wan-1.3b");
  spec.num_layers = 4;
  const auto model_with = [&](bool kept) {
    CostOptions options;
    options.weights_kept_to_backward = kept;
    return CostModel(spec, analytic_profile("t", 700e12, 550e12, 4.2e12), make_cluster(1, 1),
                     options);
  };
  const CostModel gathered = model_with(false);
  const CostModel kept = model_with(true);
  const double layer_weights = static_cast<double>(block_param_count(spec)) * 2.0 / 4.0;
  const double a = 4e9, c = 1, buffer = 5;
  EXPECT_NEAR(kept.rank_peak_bytes(a, c, buffer, 0) - gathered.rank_peak_bytes(a, c, buffer, 0),
              2 * layer_weights, 1e-3 * layer_weights);
  // fixed bytes alone (no activations): the end of the backward, where nothing is kept
  EXPECT_DOUBLE_EQ(kept.rank_peak_bytes(0, 0, 0, 0), gathered.rank_peak_bytes(0, 0, 0, 0));
}

// One rank's copying AdamW writes the next forward's bf16 copy of every weight while the
// gradients are held: with few tokens that optimizer step is the peak (state + copies + the
// runtime's reserve, nothing of the backward), with many the backward still is.
TEST(CostModel, CopyingOptimizerStepHoldsTheStateAndEveryCopy) {
  ModelSpec spec = model_preset("wan-1.3b");
  spec.num_layers = 8;
  // the blocks alone: the fixed bytes' two gathered layers and one layer's fp32 gradients are
  // then 8 x a layer's parameters = 1 byte a parameter, under the copies' 2
  spec.param_count = block_param_count(spec);
  HardwareProfile profile = analytic_profile("t", 700e12, 550e12, 4.2e12);
  profile.runtime_reserved_bytes = int64_t{1} << 30;
  const auto model_with = [&](double copy_bytes) {
    CostOptions options;
    options.weights_kept_to_backward = true;
    options.state_bytes_per_param = 14;  // bf16 gradients, as zellige.train on one rank
    options.gradient_bytes_per_param = 2;
    options.optimizer_copy_bytes_per_param = copy_bytes;
    return CostModel(spec, profile, make_cluster(1, 1), options);
  };
  const CostModel plain = model_with(0);
  const CostModel copying = model_with(2);
  const double params = static_cast<double>(spec.param_count);
  const double optimizer_step = params * 16 + static_cast<double>(int64_t{1} << 30);
  ASSERT_GT(optimizer_step, plain.fixed_bytes());  // the copies outweigh two gathered layers
  EXPECT_DOUBLE_EQ(plain.rank_peak_bytes(0, 0, 0, 0), plain.fixed_bytes());
  EXPECT_DOUBLE_EQ(copying.rank_peak_bytes(0, 0, 0, 0), optimizer_step);
  const double a = 4e9, c = 1, buffer = 5;
  ASSERT_GT(plain.rank_peak_bytes(a, c, buffer, 0), optimizer_step);
  EXPECT_DOUBLE_EQ(copying.rank_peak_bytes(a, c, buffer, 0),
                   plain.rank_peak_bytes(a, c, buffer, 0));
  CostOptions negative;
  negative.optimizer_copy_bytes_per_param = -1;
  EXPECT_THROW(CostModel(spec, profile, make_cluster(1, 1), negative), std::invalid_argument);
}

// Adaptive checkpointing: a rank with room keeps every layer's activations and pays no
// recompute; a rank without room checkpoints the fewest layers whose peak fits.
TEST(CostModel, AdaptiveCheckpointingRecomputesOnlyWhatMemoryNeeds) {
  Batch batch;
  batch.sequences = {sequence_from_tokens(0, "video", 30000, 512, 0)};
  Plan plan;
  plan.num_ranks = 1;
  plan.placements = {make_placement(0, Strategy::kLocal, {0})};
  const auto model_with = [](bool adaptive, int64_t memory_bytes) {
    return wan_1p3b_model(make_cluster(1, 1), adaptive, memory_bytes);
  };
  const PlanCost all = model_with(false, int64_t{141} << 30).evaluate(batch, plan);
  const PlanCost roomy = model_with(true, int64_t{400} << 30).evaluate(batch, plan);
  EXPECT_EQ(all.ranks[0].checkpointed_layers, 30);
  EXPECT_EQ(roomy.ranks[0].checkpointed_layers, 0);
  const CostModel plain = model_with(false, int64_t{141} << 30);
  EXPECT_NEAR(all.ranks[0].linear_s - roomy.ranks[0].linear_s,
              plain.linear_recompute_s(30000), 1e-12);
  EXPECT_LT(roomy.ranks[0].attention_s, all.ranks[0].attention_s);
  EXPECT_GT(roomy.ranks[0].peak_bytes, all.ranks[0].peak_bytes);

  // Room for about half the layers' activations: some but not all layers checkpointed, the
  // chosen count fits, and one fewer would not.
  const CostModel probe = model_with(true, int64_t{400} << 30);
  const RankShare share = probe.shares(batch.sequences[0], plan.placements[0])[0];
  const double half = probe.rank_peak_bytes(share.layer_activation_bytes,
                                            share.layer_checkpoint_bytes, share.buffer_bytes, 15);
  const CostModel tight = model_with(true, static_cast<int64_t>(half / 0.95) + 1);
  const PlanCost cost = tight.evaluate(batch, plan);
  const int64_t k = cost.ranks[0].checkpointed_layers;
  EXPECT_GT(k, 0);
  EXPECT_LT(k, 30);
  EXPECT_LE(cost.ranks[0].peak_bytes, tight.memory_capacity_bytes());
  EXPECT_GT(tight.rank_peak_bytes(share.layer_activation_bytes, share.layer_checkpoint_bytes,
                                  share.buffer_bytes, k - 1),
            tight.memory_capacity_bytes());
  EXPECT_TRUE(cost.fits);
}

// Where keeping every checkpointed layer's attention outputs does not fit, the first layers
// recompute in full (keeping only their input) and pay attention's forward again; the planners
// size shares by that smallest footprint.
TEST(CostModel, FullRecomputeWhereKeptOutputsDoNotFit) {
  Batch batch;
  batch.sequences = {sequence_from_tokens(0, "video", 60000, 512, 0)};
  Plan plan;
  plan.num_ranks = 1;
  plan.placements = {make_placement(0, Strategy::kLocal, {0})};
  const auto model_with = [](bool adaptive, int64_t memory_bytes) {
    return wan_1p3b_model(make_cluster(1, 1), adaptive, memory_bytes);
  };
  const CostModel roomy = model_with(false, int64_t{400} << 30);
  const RankShare share = roomy.shares(batch.sequences[0], plan.placements[0])[0];
  EXPECT_NEAR(share.memory_bytes,
              30 * share.layer_input_bytes + share.layer_activation_bytes + share.buffer_bytes,
              1.0);
  EXPECT_NEAR(share.layer_input_bytes, 60000.0 * 1536 * 2, 1e-6);
  const auto peak = [&](const CostModel& model, int64_t full) {
    return model.rank_peak_bytes(share.layer_activation_bytes, share.layer_checkpoint_bytes,
                                 share.layer_input_bytes, share.buffer_bytes, 30, full);
  };
  ASSERT_LT(peak(roomy, 30), peak(roomy, 0));
  const PlanCost selective = roomy.evaluate(batch, plan);
  EXPECT_EQ(selective.ranks[0].full_recompute_layers, 0);
  for (bool adaptive : {false, true}) {
    const CostModel tight =
        model_with(adaptive, static_cast<int64_t>((peak(roomy, 30) + peak(roomy, 0)) / 2 / 0.95));
    const PlanCost cost = tight.evaluate(batch, plan);
    const int64_t f = cost.ranks[0].full_recompute_layers;
    EXPECT_EQ(cost.ranks[0].checkpointed_layers, 30);
    EXPECT_GT(f, 0);
    EXPECT_LT(f, 30);
    EXPECT_TRUE(cost.fits);
    EXPECT_NEAR(cost.ranks[0].peak_bytes, peak(tight, f), 1.0);
    EXPECT_GT(peak(tight, f - 1), tight.memory_capacity_bytes());
    EXPECT_GT(share.attention_recompute_s, 0);
    EXPECT_NEAR(cost.ranks[0].attention_s - selective.ranks[0].attention_s,
                static_cast<double>(f) / 30 * share.attention_recompute_s, 1e-12);
  }
}

// A Ulysses placement makes the recompute of every checkpointed layer a world all-to-all, so
// every rank must recompute the same layers: the most any rank needs.
TEST(CostModel, AdaptiveCheckpointingIsUniformUnderAWorldExchange) {
  Batch batch;
  batch.sequences = {sequence_from_tokens(0, "video", 20000, 512, 0),
                     sequence_from_tokens(1, "video", 60000, 512, 2)};
  const auto model_with = [](int64_t memory_bytes) {
    return wan_1p3b_model(make_cluster(4, 4), true, memory_bytes);
  };
  const Placement big = make_placement(1, Strategy::kLocal, {2});
  const CostModel probe = model_with(int64_t{400} << 30);
  const RankShare share = probe.shares(batch.sequences[1], big)[0];
  const double half = probe.rank_peak_bytes(share.layer_activation_bytes,
                                            share.layer_checkpoint_bytes, share.buffer_bytes, 15);
  const CostModel tight = model_with(static_cast<int64_t>(half / 0.95) + 1);
  Plan plan;
  plan.num_ranks = 4;
  plan.placements = {make_placement(0, Strategy::kLocal, {0}), big};
  const PlanCost local = tight.evaluate(batch, plan);
  const int64_t needed = local.ranks[2].checkpointed_layers;
  EXPECT_GT(needed, 0);
  EXPECT_EQ(local.ranks[0].checkpointed_layers, 0);  // no world exchange: each rank its own
  plan.placements[0] = make_placement(0, Strategy::kUlysses, {0, 1});
  const PlanCost ulysses = tight.evaluate(batch, plan);
  for (const RankCost& rank : ulysses.ranks) EXPECT_EQ(rank.checkpointed_layers, needed);
  // rank 0 pays the recompute it would otherwise skip
  EXPECT_GT(ulysses.ranks[0].linear_s, tight.linear_time_s(10000) -
                                           tight.linear_recompute_s(10000) + 1e-9);
  EXPECT_TRUE(ulysses.fits);
}

// Selective checkpointing (docs/training.md): a checkpointed layer keeps its attention outputs,
// so its recompute is the per-token forward (with the text k/v projections), never attention.
TEST(CostModel, SelectiveRecomputeRunsNoAttention) {
  const Sequence sequence = sequence_from_tokens(0, "video", 30000, 512, 0);
  const Placement local = make_placement(0, Strategy::kLocal, {0});
  for (const char* name : {"wan-1.3b", "mmdit-11b"}) {
    const CostModel with = make_model(name, 8, 8, true);
    const CostModel without = make_model(name, 8, 8, false);
    const RankShare a = with.shares(sequence, local)[0];
    const RankShare b = without.shares(sequence, local)[0];
    EXPECT_NEAR(a.attention_s - b.attention_s, a.recompute_s, 1e-12 * a.attention_s) << name;
    EXPECT_EQ(a.exchange_s, b.exchange_s) << name;
    EXPECT_EQ(a.recompute_exchange_s, 0) << name;
    EXPECT_NEAR(with.linear_time_s(30000) - without.linear_time_s(30000),
                with.linear_recompute_s(30000), 1e-12)
        << name;
  }
  // Wan's recompute adds only the text k/v projections (4 d^2 flops a text token) to attention_s;
  // the MMDiT has none (text tokens are per-token rows of its blocks).
  const ModelSpec wan = model_preset("wan-1.3b");
  const CostModel analytic(wan, analytic_profile("t", 700e12, 550e12, 4.2e12), make_cluster(8, 8));
  const double d = static_cast<double>(wan.width);
  EXPECT_NEAR(analytic.shares(sequence, local)[0].recompute_s,
              static_cast<double>(wan.num_layers) * 4.0 * d * d * 512 / 700e12, 1e-15);
  EXPECT_EQ(make_model("mmdit-11b", 8, 8).shares(sequence, local)[0].recompute_s, 0);
}

// Ulysses: the recompute sends q, k, v again (the backward attends the received rows), not the
// output: 3 of a pass's 4 all-to-alls. Ring: nothing (its outputs are kept).
TEST(CostModel, SelectiveRecomputeResendsOnlyUlyssesQkv) {
  const Sequence sequence = sequence_from_tokens(0, "video", 75600, 512, 0);
  const CostModel with = make_model("wan-14b", 8, 8, true);
  const CostModel without = make_model("wan-14b", 8, 8, false);
  const Placement ulysses = make_placement(0, Strategy::kUlysses, iota_ranks(0, 8));
  const auto a = with.shares(sequence, ulysses), b = without.shares(sequence, ulysses);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_GT(a[i].recompute_exchange_s, 0);
    EXPECT_NEAR(a[i].exchange_s - b[i].exchange_s, a[i].recompute_exchange_s, 1e-12);
    // b: forward and backward passes of 4 equal all-to-alls each (even split)
    EXPECT_NEAR(a[i].recompute_exchange_s / b[i].exchange_s, 3.0 / 8.0, 1e-9);
  }
  const double n = 75600.0 / 8, d = 5120;
  EXPECT_NEAR(with.exchange_bytes(sequence, ulysses) - without.exchange_bytes(sequence, ulysses),
              8 * 3 * n * d * 2 * (7.0 / 8.0) * 40, 1.0);

  const Placement ring = make_placement(0, Strategy::kRing, iota_ranks(0, 4));
  const auto ring_a = with.shares(sequence, ring), ring_b = without.shares(sequence, ring);
  for (size_t i = 0; i < ring_a.size(); ++i) {
    EXPECT_EQ(ring_a[i].recompute_exchange_s, 0);
    EXPECT_DOUBLE_EQ(ring_a[i].exchange_s, ring_b[i].exchange_s);
  }
  EXPECT_DOUBLE_EQ(with.exchange_bytes(sequence, ring), without.exchange_bytes(sequence, ring));
}

// A checkpointed layer keeps its input and o + lse of each attention (analytic: self and cross
// for Wan, joint for the MMDiT); a Ulysses rank also keeps the exchanged layout's o and lse of
// its heads, a ring rank the merged lse of its rows.
TEST(CostModel, CheckpointKeepsTheAttentionOutputs) {
  const HardwareProfile profile = analytic_profile("t", 700e12, 550e12, 4.2e12);
  const Placement local = make_placement(0, Strategy::kLocal, {0});
  for (const char* name : {"wan-1.3b", "mmdit-11b"}) {
    const ModelSpec spec = model_preset(name);
    const CostModel cost_model(spec, profile, make_cluster(8, 8));
    const double d = static_cast<double>(spec.width), heads = static_cast<double>(spec.num_heads);
    const double attentions = spec.joint_attention ? 1.0 : 2.0;
    const Sequence sequence = sequence_from_tokens(0, "video", 1000, 0, 0);
    EXPECT_NEAR(cost_model.shares(sequence, local)[0].layer_checkpoint_bytes,
                1000 * (2 * d + attentions * (2 * d + 4 * heads)), 1e-6)
        << name;
  }
  const ModelSpec spec = model_preset("wan-14b");
  const CostModel cost_model(spec, profile, make_cluster(8, 8));
  const double hd = static_cast<double>(spec.head_dim);
  const double per_token = cost_model.shares(sequence_from_tokens(0, "video", 9450, 0, 0),
                                             local)[0].layer_checkpoint_bytes / 9450;
  const Sequence clip = sequence_from_tokens(0, "video", 75600, 0, 0);
  // 40 heads over 8: 5 each, of all 75,600 tokens
  const RankShare ulysses =
      cost_model.shares(clip, make_placement(0, Strategy::kUlysses, iota_ranks(0, 8)))[0];
  EXPECT_NEAR(ulysses.layer_checkpoint_bytes, 9450 * per_token + 75600 * 5 * (2 * hd + 4), 1e-3);
  const RankShare ring =
      cost_model.shares(clip, make_placement(0, Strategy::kRing, iota_ranks(0, 8)))[0];
  EXPECT_NEAR(ring.layer_checkpoint_bytes, 9450 * per_token + 9450 * 40 * 4, 1e-3);
}

}  // namespace
}  // namespace zellige
