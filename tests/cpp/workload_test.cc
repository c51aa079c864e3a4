#include "zellige/workload.h"

#include "zellige/cluster.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <stdexcept>

namespace zellige {
namespace {

TEST(LatentGeometry, Video720p81FramesIs75600Tokens) {
  const Sequence seq = sequence_from_pixels(7, "video", 81, 720, 1280, 512, 2, LatentGeometry{});
  EXPECT_EQ(seq.num_tokens, 75600);
  EXPECT_EQ(seq.grid_t, 21);
  EXPECT_EQ(seq.grid_h, 45);
  EXPECT_EQ(seq.grid_w, 80);
  EXPECT_EQ(seq.id, 7);
  EXPECT_EQ(seq.text_tokens, 512);
  EXPECT_EQ(seq.source_rank, 2);
}

TEST(LatentGeometry, ReferenceExamples) {
  const LatentGeometry g;
  EXPECT_EQ(sequence_from_pixels(0, "image", 1, 256, 256, 0, 0, g).num_tokens, 256);
  EXPECT_EQ(sequence_from_pixels(0, "image", 1, 720, 1280, 0, 0, g).num_tokens, 3600);
  EXPECT_EQ(sequence_from_pixels(0, "video", 129, 720, 1280, 0, 0, g).num_tokens, 118800);
  EXPECT_EQ(sequence_from_pixels(0, "video", 81, 480, 832, 0, 0, g).num_tokens, 32760);
}

TEST(LatentGeometry, CustomStridesAndPatches) {
  LatentGeometry g;
  g.temporal_stride = 8;
  g.patch_t = 2;
  g.patch_hw = 1;
  // latent frames (41-1)/8+1 = 6, /2 = 3; 64/8 = 8 per side
  const Sequence seq = sequence_from_pixels(0, "video", 41, 64, 64, 0, 0, g);
  EXPECT_EQ(seq.grid_t, 3);
  EXPECT_EQ(seq.grid_h, 8);
  EXPECT_EQ(seq.num_tokens, 192);
}

TEST(LatentGeometry, RejectsBadSizes) {
  const LatentGeometry g;
  EXPECT_THROW(sequence_from_pixels(0, "image", 0, 256, 256, 0, 0, g), std::invalid_argument);
  EXPECT_THROW(sequence_from_pixels(0, "image", 1, -16, 256, 0, 0, g), std::invalid_argument);
  EXPECT_THROW(sequence_from_pixels(0, "image", 1, 8, 256, 0, 0, g), std::invalid_argument);
}

// Sizes the VAE or the patchify would not divide evenly are refused, never rounded down.
TEST(LatentGeometry, RefusesSizesThatAreNotWholeMultiples) {
  LatentGeometry g;  // 4x8x8 VAE, 1x2x2 patch: 16 pixels per token side
  EXPECT_THROW(sequence_from_pixels(0, "image", 1, 100, 256, 0, 0, g), std::invalid_argument);
  EXPECT_THROW(sequence_from_pixels(0, "image", 1, 256, 250, 0, 0, g), std::invalid_argument);
  EXPECT_THROW(sequence_from_pixels(0, "video", 80, 256, 256, 0, 0, g), std::invalid_argument);
  g.patch_t = 2;  // 81 frames: 21 latent frames, odd
  EXPECT_THROW(sequence_from_pixels(0, "video", 81, 256, 256, 0, 0, g), std::invalid_argument);
  EXPECT_EQ(sequence_from_pixels(0, "video", 85, 256, 256, 0, 0, g).grid_t, 11);
}

// The documented limits: sizes whose token count would overflow int64 (or just be absurd) are
// refused, as are token counts whose square-grid search would take seconds.
TEST(WorkloadLimits, RefusesSizesBeyondTheLimits) {
  const LatentGeometry g;
  // 2^40 x 2^40 pixels used to overflow int64 into a small positive token count.
  EXPECT_THROW(sequence_from_pixels(0, "image", 1, int64_t{1} << 40, int64_t{1} << 40, 0, 0, g),
               std::invalid_argument);
  // Within kMaxPixels per side, but more tokens than kMaxSequenceTokens.
  EXPECT_THROW(sequence_from_pixels(0, "video", kMaxPixels - 3, kMaxPixels, kMaxPixels, 0, 0, g),
               std::invalid_argument);
  EXPECT_THROW(sequence_from_tokens(0, "image", kMaxSequenceTokens + 1, 0, 0),
               std::invalid_argument);
  EXPECT_THROW(sequence_from_tokens(0, "image", (int64_t{1} << 62) + 1, 0, 0),
               std::invalid_argument);
  // The largest prime below 2^32 takes the whole 2^16-step search, still instantly.
  const Sequence prime = sequence_from_tokens(0, "image", 4294967291, 0, 0);
  EXPECT_EQ(prime.grid_h, 1);
  EXPECT_EQ(prime.grid_w, 4294967291);
  const Sequence largest = sequence_from_tokens(0, "image", kMaxSequenceTokens, 0, 0);
  EXPECT_EQ(largest.grid_h, 65536);
}

TEST(WorkloadLimits, ValidateBatchRefusesOverflowingGridsAndBounds) {
  Batch batch;
  batch.sequences.push_back(sequence_from_tokens(0, "image", 4096, 0, 0));
  validate_batch(batch, 8);
  // A grid whose product wraps around int64 to exactly num_tokens must not pass.
  // (2^62 + 1) x 4 x 1024 = 2^74 + 4096, which wraps to 4096.
  batch.sequences[0].grid_t = (int64_t{1} << 62) + 1;
  batch.sequences[0].grid_h = 4;
  batch.sequences[0].grid_w = 1024;
  EXPECT_THROW(validate_batch(batch, 8), std::invalid_argument);
  batch.sequences[0] = sequence_from_tokens(0, "image", 4096, kMaxTextTokens + 1, 0);
  EXPECT_THROW(validate_batch(batch, 8), std::invalid_argument);
  batch.sequences[0] = sequence_from_tokens(0, "image", 4096, 0, 0);
  EXPECT_THROW(validate_batch(batch, kMaxGpus + 1), std::invalid_argument);
}

TEST(WorkloadLimits, ClusterAndGenerationRefuseTooManyGpus) {
  EXPECT_THROW(make_cluster(kMaxGpus + 8, 8), std::invalid_argument);
  EXPECT_THROW(make_cluster(1000000, 8), std::invalid_argument);
  EXPECT_EQ(make_cluster(kMaxGpus, 8).num_ranks(), kMaxGpus);
  Recipe recipe;
  recipe.name = "r";
  recipe.per_rank_groups = {RankGroup{1, 1, 256}};
  EXPECT_THROW(generate_batch(recipe, kMaxGpus + 1, 0), std::invalid_argument);
  recipe.per_rank_groups = {RankGroup{1, kMaxBatchSequences, 256}};
  EXPECT_THROW(generate_batch(recipe, 2, 0), std::invalid_argument);
}

TEST(SequenceFromTokens, GridIsNearSquareDivisor) {
  Sequence seq = sequence_from_tokens(1, "image", 256, 0, 0);
  EXPECT_EQ(seq.grid_t, 1);
  EXPECT_EQ(seq.grid_h, 16);
  EXPECT_EQ(seq.grid_w, 16);
  seq = sequence_from_tokens(1, "image", 1560, 0, 0);  // 39 x 40
  EXPECT_EQ(seq.grid_h, 39);
  EXPECT_EQ(seq.grid_w, 40);
  seq = sequence_from_tokens(1, "image", 251, 0, 0);  // prime
  EXPECT_EQ(seq.grid_h, 1);
  EXPECT_EQ(seq.grid_w, 251);
  EXPECT_THROW(sequence_from_tokens(1, "image", 0, 0, 0), std::invalid_argument);
}

void expect_invalid(const Batch& batch, int64_t num_ranks, const std::string& needle) {
  try {
    validate_batch(batch, num_ranks);
    FAIL() << "expected invalid_argument containing '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(ValidateBatch, NamesTheOffendingSequence) {
  Batch batch;
  expect_invalid(batch, 0, "no sequences");
  batch.sequences = {sequence_from_tokens(0, "image", 256, 8, 0),
                     sequence_from_tokens(1, "image", 256, 8, 3)};
  validate_batch(batch, 4);
  expect_invalid(batch, 3, "sequence 1: source_rank 3");
  Batch dup = batch;
  dup.sequences[1].id = 0;
  expect_invalid(dup, 0, "duplicate id 0");
  Batch bad = batch;
  bad.sequences[1].num_tokens = 0;
  expect_invalid(bad, 0, "sequence 1: num_tokens");
  bad = batch;
  bad.sequences[0].text_tokens = -1;
  expect_invalid(bad, 0, "sequence 0: text_tokens");
  bad = batch;
  bad.sequences[0].grid_w = 15;
  expect_invalid(bad, 0, "sequence 0: grid");
  bad = batch;
  bad.sequences[0].source_rank = -1;
  expect_invalid(bad, 0, "sequence 0: source_rank");
}

Recipe bucket_recipe() {
  Recipe recipe;
  recipe.name = "test-buckets";
  recipe.text_tokens = 512;
  recipe.buckets = {{"256px", 1, 10, 250, 260, 1.0}, {"768px", 33, 2, 2294, 2312, 3.0}};
  return recipe;
}

TEST(GenerateBatch, DeterministicForSeedAndVariesWithSeed) {
  const Recipe recipe = bucket_recipe();
  const Batch a = generate_batch(recipe, 16, 42);
  const Batch b = generate_batch(recipe, 16, 42);
  const Batch c = generate_batch(recipe, 16, 43);
  ASSERT_EQ(a.sequences.size(), b.sequences.size());
  for (size_t i = 0; i < a.sequences.size(); ++i) {
    EXPECT_EQ(a.sequences[i].num_tokens, b.sequences[i].num_tokens);
    EXPECT_EQ(a.sequences[i].source_rank, b.sequences[i].source_rank);
  }
  bool differs = a.sequences.size() != c.sequences.size();
  for (size_t i = 0; !differs && i < a.sequences.size(); ++i) {
    differs = a.sequences[i].num_tokens != c.sequences[i].num_tokens;
  }
  EXPECT_TRUE(differs);
}

TEST(GenerateBatch, BucketsGiveOneMicroBatchPerRank) {
  const Recipe recipe = bucket_recipe();
  const int64_t num_ranks = 64;
  const Batch batch = generate_batch(recipe, num_ranks, 7);
  validate_batch(batch, num_ranks);
  std::map<int64_t, std::vector<Sequence>> by_rank;
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    EXPECT_EQ(batch.sequences[i].id, static_cast<int64_t>(i));
    by_rank[batch.sequences[i].source_rank].push_back(batch.sequences[i]);
  }
  ASSERT_EQ(static_cast<int64_t>(by_rank.size()), num_ranks);
  int64_t prev_rank = -1;
  for (const Sequence& seq : batch.sequences) {  // rank order
    EXPECT_GE(seq.source_rank, prev_rank);
    prev_rank = seq.source_rank;
  }
  int video_ranks = 0;
  for (const auto& [rank, seqs] : by_rank) {
    const bool video = seqs[0].grid_t > 1;
    video_ranks += video;
    EXPECT_EQ(seqs.size(), video ? 2u : 10u) << "rank " << rank;
    const int64_t tokens_per_frame = seqs[0].grid_h * seqs[0].grid_w;
    EXPECT_GE(tokens_per_frame, video ? 2294 : 250);
    EXPECT_LE(tokens_per_frame, video ? 2312 : 260);
    for (const Sequence& seq : seqs) {
      EXPECT_EQ(seq.num_tokens, seqs[0].num_tokens);  // drawn once per micro-batch
      EXPECT_EQ(seq.grid_t, video ? 9 : 1);           // (33-1)/4+1
      EXPECT_EQ(seq.kind, video ? "video" : "image");
      EXPECT_EQ(seq.text_tokens, 512);
    }
  }
  // weight 3 vs 1: about 48 of 64 ranks draw the video bucket
  EXPECT_GT(video_ranks, 32);
  EXPECT_LT(video_ranks, 60);
}

TEST(GenerateBatch, MixImagesCarryTheLargestVideosTokens) {
  Recipe recipe;
  recipe.name = "test-mix";
  recipe.text_tokens = 512;
  recipe.mix = {{"image", 0, 1, 480, 832, 0.5}, {"video", 0, 81, 480, 832, 0.5}};
  const Batch batch = generate_batch(recipe, 32, 3);
  validate_batch(batch, 32);
  std::map<int64_t, std::vector<Sequence>> by_rank;
  for (const Sequence& seq : batch.sequences) by_rank[seq.source_rank].push_back(seq);
  ASSERT_EQ(by_rank.size(), 32u);
  std::set<size_t> counts;
  for (const auto& [rank, seqs] : by_rank) {
    counts.insert(seqs.size());
    if (seqs[0].kind == "video") {
      EXPECT_EQ(seqs.size(), 1u);
      EXPECT_EQ(seqs[0].num_tokens, 32760);
    } else {
      EXPECT_EQ(seqs.size(), 21u);  // 32760 / 1560
      EXPECT_EQ(seqs[0].num_tokens, 1560);
    }
  }
  EXPECT_EQ(counts, (std::set<size_t>{1, 21}));
}

TEST(GenerateBatch, MixTokensGivenDirectlyAndTextRange) {
  Recipe recipe;
  recipe.name = "test-mix-tokens";
  recipe.text_tokens_min = 0;
  recipe.text_tokens_max = 10;
  recipe.mix = {{"image", 300, 1, 0, 0, 1.0}};
  const Batch batch = generate_batch(recipe, 4, 1);
  ASSERT_EQ(batch.sequences.size(), 4u);  // no video: one image per rank
  for (const Sequence& seq : batch.sequences) {
    EXPECT_EQ(seq.num_tokens, 300);
    EXPECT_GE(seq.text_tokens, 0);
    EXPECT_LE(seq.text_tokens, 10);
  }
}

TEST(GenerateBatch, RankGroupsLaidOutInOrderWithJitter) {
  Recipe recipe;
  recipe.name = "test-groups";
  recipe.text_tokens_min = 0;
  recipe.text_tokens_max = 392;
  recipe.per_rank_groups = {{2, 4, 256}, {1, 1, 16384}};
  const Batch batch = generate_batch(recipe, 6, 11);  // slots: 256, 256, 16384, repeated
  validate_batch(batch, 6);
  std::map<int64_t, std::vector<Sequence>> by_rank;
  for (const Sequence& seq : batch.sequences) by_rank[seq.source_rank].push_back(seq);
  for (int64_t rank = 0; rank < 6; ++rank) {
    const bool large = rank % 3 == 2;
    const double nominal = large ? 16384 : 256;
    ASSERT_EQ(by_rank[rank].size(), large ? 1u : 4u) << "rank " << rank;
    for (const Sequence& seq : by_rank[rank]) {
      EXPECT_GE(seq.num_tokens, static_cast<int64_t>(nominal * 0.96) - 1);
      EXPECT_LE(seq.num_tokens, static_cast<int64_t>(nominal * 1.04) + 1);
      EXPECT_LE(seq.text_tokens, 392);
    }
  }
}

TEST(GenerateBatch, RejectsBadArguments) {
  EXPECT_THROW(generate_batch(bucket_recipe(), 0, 1), std::invalid_argument);
  Recipe empty;
  EXPECT_THROW(generate_batch(empty, 4, 1), std::invalid_argument);
  Recipe zero = bucket_recipe();
  for (Bucket& b : zero.buckets) b.weight = 0;
  EXPECT_THROW(generate_batch(zero, 4, 1), std::invalid_argument);
}

TEST(TotalTokens, Sums) {
  Batch batch;
  batch.sequences = {sequence_from_tokens(0, "image", 256, 0, 0),
                     sequence_from_tokens(1, "image", 1000, 0, 0)};
  EXPECT_EQ(total_tokens(batch), 1256);
}

}  // namespace
}  // namespace zellige
