// A rank's peak memory over the step (the backward's progress, gradient reduction, measured
// rows, kept weights, the optimizer step) and activation checkpointing: selective, adaptive
// and full recompute.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "test_util.h"
#include "zellige/cost_model.h"
#include "zellige/planners.h"
#include "zellige/simulator.h"

namespace zellige {
namespace {

using test_util::iota_ranks;
using test_util::make_model;

// wan-1.3b on `cluster` with `memory_bytes` a GPU, under an analytic profile: the checkpointing
// tests size memory against its activations.
CostModel wan_1p3b_model(Cluster cluster, bool adaptive_checkpointing, int64_t memory_bytes) {
  cluster.gpu_memory_bytes = memory_bytes;
  CostOptions options;
  options.adaptive_checkpointing = adaptive_checkpointing;
  return CostModel(model_preset("wan-1.3b"), analytic_profile("t", 700e12, 550e12, 4.2e12),
                   cluster, options);
}

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
// A micro-batch after the first of an accumulating step: the gradients the earlier ones added
// are held from the backward's start, not grown layer by layer.
TEST(CostModel, AccumulatingMicroBatchHoldsEveryGradientFromTheBackwardsStart) {
  ModelSpec spec = model_preset("wan-1.3b");
  spec.num_layers = 3;
  const CostModel cost_model(spec, analytic_profile("t", 700e12, 550e12, 4.2e12),
                             make_cluster(1, 1));
  const CostModel accumulating = cost_model.accumulating_view();
  EXPECT_FALSE(cost_model.options().accumulating_gradients);
  EXPECT_TRUE(accumulating.options().accumulating_gradients);
  EXPECT_EQ(accumulating.fixed_bytes(), cost_model.fixed_bytes());  // planners size ranks alike
  const double held = cost_model.fixed_bytes() - cost_model.gradient_bytes();
  const double grads = cost_model.gradient_bytes();
  const double a = 10, c = 1, buffer = 5;
  const double none = std::max({held + grads, held + grads + 2 * a + a + buffer,
                                held + grads + a + a + buffer, held + grads + a + buffer});
  EXPECT_NEAR(accumulating.rank_peak_bytes(a, c, buffer, 0), none, 1e-3);
  // Large activations peak at the first layer of the backward, where a step of one holds no
  // gradient yet: the micro-batch holds exactly every gradient more.
  const double big_a = 4e9;
  EXPECT_NEAR(accumulating.rank_peak_bytes(big_a, c, buffer, 0) -
                  cost_model.rank_peak_bytes(big_a, c, buffer, 0),
              grads, 1e-3);
}

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
