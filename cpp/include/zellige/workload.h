// Workload: sequences, batches, latent geometry and the seeded recipe generators.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zellige {

// Documented limits (README, "Limits"). Inputs beyond them are refused up front with
// std::invalid_argument: every size product below then fits in int64, the square-grid search of
// sequence_from_tokens stays under 2^16 steps, and no request runs for minutes before failing.
inline constexpr int64_t kMaxSequenceTokens = int64_t{1} << 32;  // latent tokens of one sequence
inline constexpr int64_t kMaxTextTokens = int64_t{1} << 20;      // text tokens of one sequence
inline constexpr int64_t kMaxPixels = int64_t{1} << 20;          // frames, height or width
inline constexpr int64_t kMaxBatchSequences = int64_t{1} << 20;  // sequences in one batch
inline constexpr int64_t kMaxBatchTokens = int64_t{1} << 40;     // latent tokens of one batch

// Pixels -> latent tokens: a causal VAE (temporal_stride x spatial_stride^2) then a patchify
// (patch_t x patch_hw^2). Defaults are the 4x8x8 VAE and 1x2x2 patch of most video DiTs.
struct LatentGeometry {
  int64_t temporal_stride = 4;
  int64_t spatial_stride = 8;
  int64_t patch_t = 1;
  int64_t patch_hw = 2;
};

struct Sequence {
  int64_t id = 0;
  std::string kind = "video";  // "image" or "video"; informative only
  int64_t num_tokens = 0;      // latent tokens after VAE and patchify
  int64_t text_tokens = 0;
  int64_t source_rank = 0;  // rank whose loader produced it
  // Latent token grid for 3D RoPE; grid_t * grid_h * grid_w == num_tokens.
  int64_t grid_t = 1;
  int64_t grid_h = 1;
  int64_t grid_w = 1;
};

struct Batch {
  std::vector<Sequence> sequences;
};

// A sequence from pixels: latent frames = (frames - 1) / temporal_stride + 1 (images: frames = 1),
// grid_t = latent frames / patch_t, grid_h = height / (spatial_stride * patch_hw), likewise
// grid_w. Throws std::invalid_argument for sizes that are not positive, above kMaxPixels, not
// whole multiples of the geometry (frames - 1 of temporal_stride, latent frames of patch_t,
// height and width of spatial_stride * patch_hw: nothing is rounded away silently), or that give
// more than kMaxSequenceTokens tokens.
Sequence sequence_from_pixels(int64_t id, const std::string& kind, int64_t frames, int64_t height,
                              int64_t width, int64_t text_tokens, int64_t source_rank,
                              const LatentGeometry& geometry);

// A sequence given by its token count: grid (1, h, w) with h the largest divisor of num_tokens
// not above sqrt(num_tokens). Throws std::invalid_argument for num_tokens outside
// [1, kMaxSequenceTokens].
Sequence sequence_from_tokens(int64_t id, const std::string& kind, int64_t num_tokens,
                              int64_t text_tokens, int64_t source_rank);

// Throws std::invalid_argument naming the offending sequence: empty batch, more than
// kMaxBatchSequences sequences or kMaxBatchTokens tokens, duplicate id, num_tokens outside
// [1, kMaxSequenceTokens], text_tokens outside [0, kMaxTextTokens], source_rank < 0 or
// >= num_ranks (when num_ranks > 0), grid that does not multiply to num_tokens.
void validate_batch(const Batch& batch, int64_t num_ranks = 0);

int64_t total_tokens(const Batch& batch);

// ---- Recipes (shared/workloads/recipes.json, parsed in Python into these structs) ----

struct Bucket {  // a bucketed loader's micro-batch: `batch` sequences of one resolution x frames
  std::string resolution;
  int64_t frames = 1;
  int64_t batch = 1;
  int64_t tokens_per_latent_frame_min = 0;  // the class's aspect ratios vary the frame size
  int64_t tokens_per_latent_frame_max = 0;
  double weight = 1.0;
};

struct MixEntry {  // one kind of sample of a mix recipe; tokens from pixels or given directly
  std::string kind;
  int64_t num_tokens = 0;  // when > 0, used as is
  int64_t frames = 1, height = 0, width = 0;
  double share = 0.0;
};

struct RankGroup {  // knapformer-style: `ranks` consecutive ranks each load `batch` x `tokens`
  int64_t ranks = 0;
  int64_t batch = 0;
  int64_t tokens = 0;
};

struct Recipe {
  std::string name;
  std::string model;
  int64_t text_tokens = 0;                            // fixed text length, or
  int64_t text_tokens_min = -1, text_tokens_max = -1;  // uniform range when min >= 0
  LatentGeometry geometry;
  std::vector<Bucket> buckets;           // bucket recipes (Open-Sora)
  std::vector<MixEntry> mix;             // mix recipes (Wan)
  std::vector<RankGroup> per_rank_groups;  // rank-group recipes (KnapFormer)
};

// The batch of one training step on num_ranks ranks, as a loader would produce it; ids are
// 0..n-1 in rank order; source_rank is the rank that drew the sequence. Deterministic for seed.
//  - buckets: each rank draws one bucket (weighted) and emits its `batch` sequences, the tokens
//    per latent frame drawn once per micro-batch uniformly within the class's range;
//  - mix: each rank draws one entry by share; a video entry gives one sequence, an image entry
//    gives as many images as carry the tokens of the mix's largest video (token-budget
//    bucketing, at least one);
//  - per_rank_groups: rank r takes the group at position r mod (sum of group ranks), laid out in
//    order; tokens jitter by a uniform aspect factor in [0.96, 1.04].
// Throws std::invalid_argument for num_ranks outside [1, kMaxGpus], an empty recipe, or a batch
// beyond the limits above.
Batch generate_batch(const Recipe& recipe, int64_t num_ranks, uint64_t seed);

}  // namespace zellige
