#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <string>
#include <vector>

#include "zellige/plan_compiler.h"

namespace nb = nanobind;
using namespace zellige;

namespace {

using Int64Array = nb::ndarray<nb::numpy, int64_t>;

// A numpy array that owns a copy of `values` (torch.from_numpy then shares it without copying).
Int64Array to_numpy(const std::vector<int64_t>& values, std::vector<size_t> shape) {
  auto* data = new int64_t[std::max<size_t>(values.size(), 1)];
  std::copy(values.begin(), values.end(), data);
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<int64_t*>(p); });
  return Int64Array(data, shape.size(), shape.data(), owner);
}

template <auto Field>
void def_array(nb::class_<RankLayout>& cls, const char* name) {
  cls.def_prop_ro(
      name,
      [](const RankLayout& layout) {
        const std::vector<int64_t>& values = layout.*Field;
        return to_numpy(values, {values.size()});
      },
      nb::rv_policy::move);  // the array owns its copy; no reference to the layout
}

}  // namespace

void init_plan_compiler(nb::module_& m) {
  nb::enum_<SegmentKind>(m, "SegmentKind", "What one attention segment of a rank is.")
      .value("local", SegmentKind::kLocal)
      .value("ulysses", SegmentKind::kUlysses)
      .value("ring", SegmentKind::kRing)
      .value("hybrid", SegmentKind::kHybrid);

  nb::class_<RankLayout> cls(m, "RankLayout",
                             "One rank's tables for the runtime (see plan_compiler.h). Integer "
                             "arrays are numpy int64 arrays owned by Python.");
  cls.def_ro("rank", &RankLayout::rank)
      .def_ro("num_ranks", &RankLayout::num_ranks)
      .def_ro("num_heads", &RankLayout::num_heads)
      .def_ro("num_held_tokens", &RankLayout::num_held_tokens)
      .def_ro("num_source_tokens", &RankLayout::num_source_tokens)
      .def_ro("world_has_exchange", &RankLayout::world_has_exchange)
      .def_ro("num_exchange_rows", &RankLayout::num_exchange_rows)
      .def_prop_ro("num_segments", &RankLayout::num_segments)
      .def_prop_ro(
          "token_position_thw",
          [](const RankLayout& layout) {
            return to_numpy(layout.token_position_thw,
                            {static_cast<size_t>(layout.num_held_tokens), size_t{3}});
          },
          nb::rv_policy::move);
  def_array<&RankLayout::chunk_sequence_index>(cls, "chunk_sequence_index");
  def_array<&RankLayout::chunk_token_offset>(cls, "chunk_token_offset");
  def_array<&RankLayout::chunk_num_tokens>(cls, "chunk_num_tokens");
  def_array<&RankLayout::chunk_held_offset>(cls, "chunk_held_offset");
  def_array<&RankLayout::token_sequence_index>(cls, "token_sequence_index");
  def_array<&RankLayout::route_send_index>(cls, "route_send_index");
  def_array<&RankLayout::route_send_splits>(cls, "route_send_splits");
  def_array<&RankLayout::route_recv_splits>(cls, "route_recv_splits");
  def_array<&RankLayout::route_recv_index>(cls, "route_recv_index");
  def_array<&RankLayout::exchange_send_index>(cls, "exchange_send_index");
  def_array<&RankLayout::exchange_send_splits>(cls, "exchange_send_splits");
  def_array<&RankLayout::exchange_recv_splits>(cls, "exchange_recv_splits");
  def_array<&RankLayout::exchange_recv_index>(cls, "exchange_recv_index");
  def_array<&RankLayout::segment_sequence_index>(cls, "segment_sequence_index");
  def_array<&RankLayout::segment_kind>(cls, "segment_kind");
  def_array<&RankLayout::segment_in_exchange>(cls, "segment_in_exchange");
  def_array<&RankLayout::segment_row_offset>(cls, "segment_row_offset");
  def_array<&RankLayout::segment_num_tokens>(cls, "segment_num_tokens");
  def_array<&RankLayout::segment_num_heads>(cls, "segment_num_heads");
  def_array<&RankLayout::segment_head_offset>(cls, "segment_head_offset");
  def_array<&RankLayout::cu_seqlens>(cls, "cu_seqlens");
  def_array<&RankLayout::ring_segment>(cls, "ring_segment");
  def_array<&RankLayout::ring_degree>(cls, "ring_degree");
  def_array<&RankLayout::ring_position>(cls, "ring_position");
  def_array<&RankLayout::ring_peer_offset>(cls, "ring_peer_offset");
  def_array<&RankLayout::ring_peers>(cls, "ring_peers");
  def_array<&RankLayout::ring_block_tokens>(cls, "ring_block_tokens");
  cls.def("__repr__", [](const RankLayout& layout) {
    return "RankLayout(rank=" + std::to_string(layout.rank) +
           ", num_ranks=" + std::to_string(layout.num_ranks) +
           ", num_heads=" + std::to_string(layout.num_heads) +
           ", num_held_tokens=" + std::to_string(layout.num_held_tokens) +
           ", num_chunks=" + std::to_string(layout.chunk_num_tokens.size()) +
           ", num_segments=" + std::to_string(layout.num_segments()) +
           ", num_exchange_rows=" + std::to_string(layout.num_exchange_rows) +
           ", num_ring_segments=" + std::to_string(layout.ring_segment.size()) + ")";
  });

  m.def("compile_rank_layout", &compile_rank_layout, nb::arg("batch"), nb::arg("plan"),
        nb::arg("rank"), nb::arg("num_heads"),
        "One rank's layout for the runtime; raises ValueError when the plan does not match the "
        "batch or the head count.");
}
