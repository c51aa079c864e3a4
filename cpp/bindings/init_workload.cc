#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bind_util.h"
#include "zellige/workload.h"

namespace nb = nanobind;
using namespace zellige;
using zellige_bindings::add_value_methods;

void init_workload(nb::module_& m) {
  nb::class_<LatentGeometry> geometry(m, "LatentGeometry",
                                      "Pixels -> latent tokens: VAE strides and patch sizes.");
  geometry.def_rw("temporal_stride", &LatentGeometry::temporal_stride)
      .def_rw("spatial_stride", &LatentGeometry::spatial_stride)
      .def_rw("patch_t", &LatentGeometry::patch_t)
      .def_rw("patch_hw", &LatentGeometry::patch_hw);
  add_value_methods(geometry, {"temporal_stride", "spatial_stride", "patch_t", "patch_hw"});

  nb::class_<Sequence> sequence(m, "Sequence", "One sample of the batch, in latent tokens.");
  sequence.def_rw("id", &Sequence::id)
      .def_rw("kind", &Sequence::kind)
      .def_rw("num_tokens", &Sequence::num_tokens)
      .def_rw("text_tokens", &Sequence::text_tokens)
      .def_rw("source_rank", &Sequence::source_rank)
      .def_rw("grid_t", &Sequence::grid_t)
      .def_rw("grid_h", &Sequence::grid_h)
      .def_rw("grid_w", &Sequence::grid_w);
  add_value_methods(sequence, {"id", "kind", "num_tokens", "text_tokens", "source_rank", "grid_t",
                               "grid_h", "grid_w"});

  nb::class_<Batch> batch(m, "Batch", "The sequences of one training step.");
  batch.def_rw("sequences", &Batch::sequences).def("__len__", [](const Batch& b) {
    return b.sequences.size();
  });
  add_value_methods(batch, {"sequences"});

  nb::class_<Bucket> bucket(m, "Bucket", "A bucketed loader's micro-batch shape.");
  bucket.def_rw("resolution", &Bucket::resolution)
      .def_rw("frames", &Bucket::frames)
      .def_rw("batch", &Bucket::batch)
      .def_rw("tokens_per_latent_frame_min", &Bucket::tokens_per_latent_frame_min)
      .def_rw("tokens_per_latent_frame_max", &Bucket::tokens_per_latent_frame_max)
      .def_rw("weight", &Bucket::weight);
  add_value_methods(bucket, {"resolution", "frames", "batch", "tokens_per_latent_frame_min",
                             "tokens_per_latent_frame_max", "weight"});

  nb::class_<MixEntry> mix_entry(m, "MixEntry", "One kind of sample of a mix recipe.");
  mix_entry.def_rw("kind", &MixEntry::kind)
      .def_rw("num_tokens", &MixEntry::num_tokens)
      .def_rw("frames", &MixEntry::frames)
      .def_rw("height", &MixEntry::height)
      .def_rw("width", &MixEntry::width)
      .def_rw("share", &MixEntry::share);
  add_value_methods(mix_entry, {"kind", "num_tokens", "frames", "height", "width", "share"});

  nb::class_<RankGroup> rank_group(m, "RankGroup", "Consecutive ranks loading one fixed shape.");
  rank_group.def_rw("ranks", &RankGroup::ranks)
      .def_rw("batch", &RankGroup::batch)
      .def_rw("tokens", &RankGroup::tokens);
  add_value_methods(rank_group, {"ranks", "batch", "tokens"});

  nb::class_<Recipe> recipe(m, "Recipe", "A workload recipe (see zellige.load_recipe).");
  recipe.def_rw("name", &Recipe::name)
      .def_rw("model", &Recipe::model)
      .def_rw("text_tokens", &Recipe::text_tokens)
      .def_rw("text_tokens_min", &Recipe::text_tokens_min)
      .def_rw("text_tokens_max", &Recipe::text_tokens_max)
      .def_rw("geometry", &Recipe::geometry)
      .def_rw("buckets", &Recipe::buckets)
      .def_rw("mix", &Recipe::mix)
      .def_rw("per_rank_groups", &Recipe::per_rank_groups);
  add_value_methods(recipe, {"name", "model", "text_tokens", "text_tokens_min", "text_tokens_max",
                             "geometry", "buckets", "mix", "per_rank_groups"});

  // The documented limits (workload.h), for the Python readers that check before converting.
  m.attr("MAX_SEQUENCE_TOKENS") = kMaxSequenceTokens;
  m.attr("MAX_TEXT_TOKENS") = kMaxTextTokens;
  m.attr("MAX_PIXELS") = kMaxPixels;
  m.attr("MAX_BATCH_SEQUENCES") = kMaxBatchSequences;
  m.attr("MAX_BATCH_TOKENS") = kMaxBatchTokens;
  m.def("sequence_from_pixels", &sequence_from_pixels, nb::arg("id"), nb::arg("kind"),
        nb::arg("frames"), nb::arg("height"), nb::arg("width"), nb::arg("text_tokens"),
        nb::arg("source_rank"), nb::arg("geometry") = LatentGeometry(),
        "A sequence from pixels through the latent geometry.");
  m.def("sequence_from_tokens", &sequence_from_tokens, nb::arg("id"), nb::arg("kind"),
        nb::arg("num_tokens"), nb::arg("text_tokens"), nb::arg("source_rank"),
        "A sequence given by its token count (grid 1 x h x w, h the largest divisor <= sqrt).");
  m.def("validate_batch", &validate_batch, nb::arg("batch"), nb::arg("num_ranks") = 0,
        "Raises ValueError naming the offending sequence.");
  m.def("total_tokens", &total_tokens, nb::arg("batch"));
  m.def("generate_batch", &generate_batch, nb::arg("recipe"), nb::arg("num_ranks"), nb::arg("seed"),
        "The batch of one step on num_ranks ranks; deterministic for seed.");
}
