#include "zellige/workload.h"

#include "zellige/cluster.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <unordered_set>

namespace zellige {
namespace {

std::string seq_prefix(int64_t id) { return "sequence " + std::to_string(id) + ": "; }

// Random draws built from raw mt19937_64 output only, so that batches are identical across
// standard libraries (std::*_distribution is implementation-defined).
double uniform01(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
}

int64_t uniform_int(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // inclusive
  const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
  return lo + static_cast<int64_t>(rng() % span);
}

double uniform_real(std::mt19937_64& rng, double lo, double hi) {
  return lo + (hi - lo) * uniform01(rng);
}

size_t weighted_index(std::mt19937_64& rng, const std::vector<double>& weights,
                      const std::string& what) {
  double total = 0;
  for (double w : weights) {
    if (!(w >= 0) || !std::isfinite(w)) {
      throw std::invalid_argument(what + " weights must be finite and non-negative");
    }
    total += w;
  }
  if (total <= 0) throw std::invalid_argument(what + " weights sum to zero");
  double target = uniform01(rng) * total;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (target < weights[i]) return i;
    target -= weights[i];
  }
  // Rounding can leave target just above the last positive weight.
  for (size_t i = weights.size(); i-- > 0;) {
    if (weights[i] > 0) return i;
  }
  return weights.size() - 1;
}

int64_t draw_text_tokens(std::mt19937_64& rng, const Recipe& recipe) {
  if (recipe.text_tokens_min >= 0) {
    if (recipe.text_tokens_max < recipe.text_tokens_min) {
      throw std::invalid_argument("recipe '" + recipe.name +
                                  "': text_tokens_max is below text_tokens_min");
    }
    return uniform_int(rng, recipe.text_tokens_min, recipe.text_tokens_max);
  }
  return recipe.text_tokens;
}

std::string in_range(int64_t low, int64_t high) {
  return "[" + std::to_string(low) + ", " + std::to_string(high) + "]";
}

// tokens_per_frame <= kMaxSequenceTokens = 2^32, so h <= 2^16 and the search below takes at most
// 2^16 divisions (a prime takes them all: well under a millisecond).
void set_square_grid(Sequence* seq, int64_t grid_t, int64_t tokens_per_frame) {
  if (tokens_per_frame <= 0 || tokens_per_frame > kMaxSequenceTokens) {
    throw std::invalid_argument(seq_prefix(seq->id) + "tokens per frame must be in " +
                                in_range(1, kMaxSequenceTokens) + ", got " +
                                std::to_string(tokens_per_frame));
  }
  int64_t h = static_cast<int64_t>(std::sqrt(static_cast<double>(tokens_per_frame)));
  while (h * h > tokens_per_frame) --h;
  while ((h + 1) * (h + 1) <= tokens_per_frame) ++h;
  while (tokens_per_frame % h != 0) --h;
  seq->grid_t = grid_t;
  seq->grid_h = h;
  seq->grid_w = tokens_per_frame / h;
  seq->num_tokens = grid_t * tokens_per_frame;
}

Sequence make_entry_sequence(int64_t id, const MixEntry& entry, int64_t text_tokens,
                             int64_t source_rank, const LatentGeometry& geometry) {
  if (entry.num_tokens > 0) {
    return sequence_from_tokens(id, entry.kind, entry.num_tokens, text_tokens, source_rank);
  }
  return sequence_from_pixels(id, entry.kind, entry.frames, entry.height, entry.width, text_tokens,
                              source_rank, geometry);
}

int64_t latent_frames(int64_t frames, const LatentGeometry& geometry) {
  return (frames - 1) / geometry.temporal_stride + 1;
}

}  // namespace

Sequence sequence_from_pixels(int64_t id, const std::string& kind, int64_t frames, int64_t height,
                              int64_t width, int64_t text_tokens, int64_t source_rank,
                              const LatentGeometry& geometry) {
  const std::string sizes =
      std::to_string(frames) + " x " + std::to_string(height) + " x " + std::to_string(width);
  if (frames <= 0 || height <= 0 || width <= 0) {
    throw std::invalid_argument(seq_prefix(id) + "frames, height and width must be positive, got " +
                                sizes);
  }
  if (frames > kMaxPixels || height > kMaxPixels || width > kMaxPixels) {
    throw std::invalid_argument(seq_prefix(id) + "frames, height and width must be at most " +
                                std::to_string(kMaxPixels) + ", got " + sizes);
  }
  if (geometry.temporal_stride <= 0 || geometry.spatial_stride <= 0 || geometry.patch_t <= 0 ||
      geometry.patch_hw <= 0 || geometry.temporal_stride > kMaxPixels ||
      geometry.spatial_stride > kMaxPixels || geometry.patch_t > kMaxPixels ||
      geometry.patch_hw > kMaxPixels) {
    throw std::invalid_argument("latent geometry strides and patch sizes must be in " +
                                in_range(1, kMaxPixels));
  }
  const int64_t pixels_per_token = geometry.spatial_stride * geometry.patch_hw;
  // A size the VAE and patchify would not divide evenly is refused, not rounded down: the
  // latents a real pipeline makes from it would differ from what the plan assumes.
  if ((frames - 1) % geometry.temporal_stride != 0) {
    throw std::invalid_argument(seq_prefix(id) + std::to_string(frames) +
                                " frames: frames - 1 must be a multiple of the VAE's temporal "
                                "stride " + std::to_string(geometry.temporal_stride));
  }
  if (latent_frames(frames, geometry) % geometry.patch_t != 0) {
    throw std::invalid_argument(seq_prefix(id) + std::to_string(frames) + " frames give " +
                                std::to_string(latent_frames(frames, geometry)) +
                                " latent frames, not a multiple of the temporal patch " +
                                std::to_string(geometry.patch_t));
  }
  if (height % pixels_per_token != 0 || width % pixels_per_token != 0) {
    throw std::invalid_argument(seq_prefix(id) + "height and width must be multiples of " +
                                std::to_string(pixels_per_token) + " (VAE stride " +
                                std::to_string(geometry.spatial_stride) + " x patch " +
                                std::to_string(geometry.patch_hw) + "), got " +
                                std::to_string(height) + " x " + std::to_string(width));
  }
  Sequence seq;
  seq.id = id;
  seq.kind = kind;
  seq.text_tokens = text_tokens;
  seq.source_rank = source_rank;
  seq.grid_t = latent_frames(frames, geometry) / geometry.patch_t;
  seq.grid_h = height / pixels_per_token;
  seq.grid_w = width / pixels_per_token;
  if (seq.grid_t <= 0 || seq.grid_h <= 0 || seq.grid_w <= 0) {
    throw std::invalid_argument(
        seq_prefix(id) + std::to_string(frames) + " x " + std::to_string(height) + " x " +
        std::to_string(width) +
        " pixels give an empty latent grid (height and width must be at least " +
        std::to_string(pixels_per_token) + ")");
  }
  // Each factor is at most kMaxPixels = 2^20, so the product cannot overflow int64.
  seq.num_tokens = seq.grid_t * seq.grid_h * seq.grid_w;
  if (seq.num_tokens > kMaxSequenceTokens) {
    throw std::invalid_argument(seq_prefix(id) + sizes + " pixels give " +
                                std::to_string(seq.num_tokens) + " tokens, above the limit of " +
                                std::to_string(kMaxSequenceTokens));
  }
  return seq;
}

Sequence sequence_from_tokens(int64_t id, const std::string& kind, int64_t num_tokens,
                              int64_t text_tokens, int64_t source_rank) {
  if (num_tokens <= 0 || num_tokens > kMaxSequenceTokens) {
    throw std::invalid_argument(seq_prefix(id) + "num_tokens must be in " +
                                in_range(1, kMaxSequenceTokens) + ", got " +
                                std::to_string(num_tokens));
  }
  Sequence seq;
  seq.id = id;
  seq.kind = kind;
  seq.text_tokens = text_tokens;
  seq.source_rank = source_rank;
  set_square_grid(&seq, 1, num_tokens);
  return seq;
}

void validate_batch(const Batch& batch, int64_t num_ranks) {
  if (batch.sequences.empty()) throw std::invalid_argument("the batch has no sequences");
  if (static_cast<int64_t>(batch.sequences.size()) > kMaxBatchSequences) {
    throw std::invalid_argument("the batch has " + std::to_string(batch.sequences.size()) +
                                " sequences, above the limit of " +
                                std::to_string(kMaxBatchSequences));
  }
  if (num_ranks > kMaxGpus) {
    throw std::invalid_argument("num_ranks must be at most " + std::to_string(kMaxGpus) +
                                ", got " + std::to_string(num_ranks));
  }
  int64_t total = 0;
  // Batches of tens of thousands of sequences are checked per step: ids are looked up in a hash
  // set only when a sorted copy shows a duplicate (to name the first one in batch order), and a
  // sequence's error prefix is built only for an error.
  std::vector<int64_t> sorted_ids;
  sorted_ids.reserve(batch.sequences.size());
  for (const Sequence& seq : batch.sequences) sorted_ids.push_back(seq.id);
  std::sort(sorted_ids.begin(), sorted_ids.end());
  const bool has_duplicate =
      std::adjacent_find(sorted_ids.begin(), sorted_ids.end()) != sorted_ids.end();
  std::unordered_set<int64_t> ids;
  for (const Sequence& seq : batch.sequences) {
    const auto prefix = [&seq] { return seq_prefix(seq.id); };
    if (has_duplicate && !ids.insert(seq.id).second) {
      throw std::invalid_argument(prefix() + "duplicate id " + std::to_string(seq.id));
    }
    if (seq.num_tokens <= 0 || seq.num_tokens > kMaxSequenceTokens) {
      throw std::invalid_argument(prefix() + "num_tokens must be in " +
                                  in_range(1, kMaxSequenceTokens) + ", got " +
                                  std::to_string(seq.num_tokens));
    }
    if (seq.text_tokens < 0 || seq.text_tokens > kMaxTextTokens) {
      throw std::invalid_argument(prefix() + "text_tokens must be in " +
                                  in_range(0, kMaxTextTokens) + ", got " +
                                  std::to_string(seq.text_tokens));
    }
    if (seq.source_rank < 0 || (num_ranks > 0 && seq.source_rank >= num_ranks)) {
      throw std::invalid_argument(prefix() + "source_rank " + std::to_string(seq.source_rank) +
                                  " is outside [0, " +
                                  (num_ranks > 0 ? std::to_string(num_ranks) : "inf") + ")");
    }
    // Each factor is checked against num_tokens before the product, which then cannot overflow.
    if (seq.grid_t <= 0 || seq.grid_h <= 0 || seq.grid_w <= 0 || seq.grid_t > seq.num_tokens ||
        seq.grid_h > seq.num_tokens || seq.grid_w > seq.num_tokens ||
        seq.grid_t * seq.grid_h > seq.num_tokens ||
        seq.grid_t * seq.grid_h * seq.grid_w != seq.num_tokens) {
      throw std::invalid_argument(prefix() + "grid " + std::to_string(seq.grid_t) + " x " +
                                  std::to_string(seq.grid_h) + " x " + std::to_string(seq.grid_w) +
                                  " does not multiply to num_tokens " +
                                  std::to_string(seq.num_tokens));
    }
    total += seq.num_tokens;  // at most 2^20 x 2^32: no overflow
  }
  if (total > kMaxBatchTokens) {
    throw std::invalid_argument("the batch has " + std::to_string(total) +
                                " tokens, above the limit of " + std::to_string(kMaxBatchTokens));
  }
}

int64_t total_tokens(const Batch& batch) {
  int64_t total = 0;
  for (const Sequence& seq : batch.sequences) total += seq.num_tokens;
  return total;
}

Batch generate_batch(const Recipe& recipe, int64_t num_ranks, uint64_t seed) {
  if (num_ranks <= 0 || num_ranks > kMaxGpus) {
    throw std::invalid_argument("num_ranks must be in " + in_range(1, kMaxGpus) + ", got " +
                                std::to_string(num_ranks));
  }
  const int num_forms =
      !recipe.buckets.empty() + !recipe.mix.empty() + !recipe.per_rank_groups.empty();
  if (num_forms != 1) {
    throw std::invalid_argument("recipe '" + recipe.name +
                                "' must have exactly one of buckets, mix, per_rank_groups");
  }
  std::mt19937_64 rng(seed);
  Batch batch;
  auto next_id = [&batch]() { return static_cast<int64_t>(batch.sequences.size()); };
  auto add = [&batch, &recipe](const Sequence& seq) {  // refused before it grows without bound
    if (static_cast<int64_t>(batch.sequences.size()) >= kMaxBatchSequences) {
      throw std::invalid_argument("recipe '" + recipe.name + "' gives more than " +
                                  std::to_string(kMaxBatchSequences) +
                                  " sequences on this many ranks, above the limit");
    }
    batch.sequences.push_back(seq);
  };

  if (!recipe.buckets.empty()) {
    std::vector<double> weights;
    for (const Bucket& bucket : recipe.buckets) {
      if (bucket.frames <= 0 || bucket.batch <= 0 || bucket.tokens_per_latent_frame_min <= 0 ||
          bucket.tokens_per_latent_frame_max < bucket.tokens_per_latent_frame_min) {
        throw std::invalid_argument("recipe '" + recipe.name + "': bucket " + bucket.resolution +
                                    " x " + std::to_string(bucket.frames) +
                                    " needs positive frames, batch and token range");
      }
      weights.push_back(bucket.weight);
    }
    for (int64_t rank = 0; rank < num_ranks; ++rank) {
      const Bucket& bucket = recipe.buckets[weighted_index(rng, weights, "bucket")];
      const int64_t tokens_per_frame =
          uniform_int(rng, bucket.tokens_per_latent_frame_min, bucket.tokens_per_latent_frame_max);
      const int64_t grid_t = latent_frames(bucket.frames, recipe.geometry);
      for (int64_t i = 0; i < bucket.batch; ++i) {
        Sequence seq;
        seq.id = next_id();
        seq.kind = bucket.frames == 1 ? "image" : "video";
        seq.text_tokens = draw_text_tokens(rng, recipe);
        seq.source_rank = rank;
        set_square_grid(&seq, grid_t, tokens_per_frame);
        add(seq);
      }
    }
  } else if (!recipe.mix.empty()) {
    std::vector<double> weights;
    int64_t largest_video_tokens = 0;
    for (const MixEntry& entry : recipe.mix) {
      weights.push_back(entry.share);
      if (entry.kind == "video") {
        const Sequence probe = make_entry_sequence(0, entry, 0, 0, recipe.geometry);
        largest_video_tokens = std::max(largest_video_tokens, probe.num_tokens);
      }
    }
    for (int64_t rank = 0; rank < num_ranks; ++rank) {
      const MixEntry& entry = recipe.mix[weighted_index(rng, weights, "mix share")];
      const Sequence first = make_entry_sequence(next_id(), entry, draw_text_tokens(rng, recipe),
                                                 rank, recipe.geometry);
      const int64_t count =
          entry.kind == "video" ? 1 : std::max<int64_t>(1, largest_video_tokens / first.num_tokens);
      add(first);
      for (int64_t i = 1; i < count; ++i) {
        Sequence seq = first;
        seq.id = next_id();
        seq.text_tokens = draw_text_tokens(rng, recipe);
        add(seq);
      }
    }
  } else {
    std::vector<const RankGroup*> group_of_slot;
    for (const RankGroup& group : recipe.per_rank_groups) {
      if (group.ranks <= 0 || group.batch <= 0 || group.tokens <= 0 || group.ranks > kMaxGpus) {
        throw std::invalid_argument("recipe '" + recipe.name +
                                    "': rank groups need positive ranks, batch and tokens");
      }
      for (int64_t i = 0; i < group.ranks; ++i) group_of_slot.push_back(&group);
    }
    for (int64_t rank = 0; rank < num_ranks; ++rank) {
      const RankGroup& group = *group_of_slot[rank % group_of_slot.size()];
      for (int64_t i = 0; i < group.batch; ++i) {
        const double aspect = uniform_real(rng, 0.96, 1.04);
        const int64_t tokens = std::max<int64_t>(
            1, static_cast<int64_t>(std::llround(static_cast<double>(group.tokens) * aspect)));
        add(sequence_from_tokens(next_id(), "image", tokens, draw_text_tokens(rng, recipe), rank));
      }
    }
  }
  validate_batch(batch, num_ranks);  // the token limit of a batch
  return batch;
}

}  // namespace zellige
