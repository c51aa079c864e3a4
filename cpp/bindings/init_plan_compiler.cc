#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <new>
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

template <class Class, auto Field>
void def_array(nb::class_<Class>& cls, const char* name) {
  cls.def_prop_ro(
      name,
      [](const Class& object) {
        const std::vector<int64_t>& values = object.*Field;
        return to_numpy(values, {values.size()});
      },
      nb::rv_policy::move);  // the array owns its copy; no reference to the object
}

// [(peer, [(begin, end), ...]), ...]
nb::list messages(const std::vector<PeerRows>& items) {
  nb::list out;
  for (const PeerRows& m : items) {
    nb::list rows;
    for (const RowSlice& s : m.rows) rows.append(nb::make_tuple(s.begin, s.end));
    out.append(nb::make_tuple(m.peer, rows));
  }
  return out;
}

nb::bytes to_bytes(const StepProgram& program) {
  const std::string bytes = serialize_step_program(program);
  return nb::bytes(bytes.data(), bytes.size());
}

}  // namespace

void init_plan_compiler(nb::module_& m) {
  nb::enum_<SegmentKind>(m, "SegmentKind", "What one attention segment of a rank is.")
      .value("local", SegmentKind::kLocal)
      .value("ulysses", SegmentKind::kUlysses)
      .value("ring", SegmentKind::kRing)
      .value("hybrid", SegmentKind::kHybrid);

  nb::class_<SegmentGroup> group(m, "SegmentGroup",
                                 "Segments of one shape, attended in one dense kernel call "
                                 "(see plan_compiler.h).");
  group.def_ro("q_len", &SegmentGroup::q_len)
      .def_ro("k_len", &SegmentGroup::k_len)
      .def_ro("num_heads", &SegmentGroup::num_heads)
      .def_prop_ro(
          "count",
          [](const SegmentGroup& g) { return static_cast<int64_t>(g.q_row_offset.size()); })
      .def("__repr__", [](const SegmentGroup& g) {
        return "SegmentGroup(count=" + std::to_string(g.q_row_offset.size()) +
               ", q_len=" + std::to_string(g.q_len) + ", k_len=" + std::to_string(g.k_len) +
               ", num_heads=" + std::to_string(g.num_heads) + ")";
      });
  def_array<SegmentGroup, &SegmentGroup::q_row_offset>(group, "q_row_offset");
  def_array<SegmentGroup, &SegmentGroup::k_row_offset>(group, "k_row_offset");

  nb::class_<TokenRoute> route(m, "TokenRoute",
                               "One all_to_all of rows: send row i = source row send_index[i], "
                               "send_splits[r] rows to rank r; destination row p = received "
                               "row recv_index[p].");
  route.def_ro("num_source", &TokenRoute::num_source).def_ro("num_held", &TokenRoute::num_held);
  def_array<TokenRoute, &TokenRoute::send_index>(route, "send_index");
  def_array<TokenRoute, &TokenRoute::send_splits>(route, "send_splits");
  def_array<TokenRoute, &TokenRoute::recv_splits>(route, "recv_splits");
  def_array<TokenRoute, &TokenRoute::recv_index>(route, "recv_index");

  nb::class_<RingStep> ring_step(m, "RingStep",
                                 "Ring step s >= 1: messages per peer (compact rows sent, "
                                 "receive-buffer slices) and the attention groups.");
  ring_step.def_ro("num_recv_rows", &RingStep::num_recv_rows)
      .def_ro("groups", &RingStep::groups)
      .def_prop_ro("sends", [](const RingStep& s) { return messages(s.sends); })
      .def_prop_ro("recvs", [](const RingStep& s) { return messages(s.recvs); });

  nb::class_<StepProgram> cls(m, "StepProgram",
                              "One rank's step program for the runtime (see plan_compiler.h and "
                              "docs/formats.md). Integer arrays are numpy int64 copies; pickles "
                              "through its binary form (to_bytes / from_bytes).");
  cls.def_ro("rank", &StepProgram::rank)
      .def_ro("num_ranks", &StepProgram::num_ranks)
      .def_ro("num_heads", &StepProgram::num_heads)
      .def_ro("joint_attention", &StepProgram::joint_attention)
      .def_ro("fingerprint", &StepProgram::fingerprint)
      .def_ro("num_held_tokens", &StepProgram::num_held_tokens)
      .def_ro("num_cross_text_rows", &StepProgram::num_cross_text_rows)
      .def_ro("world_has_exchange", &StepProgram::world_has_exchange)
      .def_ro("num_exchange_rows", &StepProgram::num_exchange_rows)
      .def_ro("ring_num_rows", &StepProgram::ring_num_rows)
      .def_ro("route", &StepProgram::route)
      .def_ro("visual_route", &StepProgram::visual_route)
      .def_ro("text_route", &StepProgram::text_route)
      .def_ro("cross_text_route", &StepProgram::cross_text_route)
      .def_ro("local_groups", &StepProgram::local_groups)
      .def_ro("exchange_groups", &StepProgram::exchange_groups)
      .def_ro("ring_step0_groups", &StepProgram::ring_step0_groups)
      .def_ro("ring_steps", &StepProgram::ring_steps)
      .def_ro("cross_groups", &StepProgram::cross_groups)
      .def_prop_ro("num_source_tokens", [](const StepProgram& p) { return p.route.num_source; })
      .def_prop_ro("num_segments", &StepProgram::num_segments)
      .def_prop_ro(
          "token_position_thw",
          [](const StepProgram& p) {
            return to_numpy(p.token_position_thw,
                            {static_cast<size_t>(p.num_held_tokens), size_t{3}});
          },
          nb::rv_policy::move)
      .def("to_bytes", &to_bytes, "The program's binary form (versioned).")
      .def_static(
          "from_bytes",
          [](const nb::bytes& bytes) {
            return deserialize_step_program(std::string(bytes.c_str(), bytes.size()));
          },
          nb::arg("data"), "A program from to_bytes; ValueError for bytes that are not one.")
      .def("__getstate__", &to_bytes)
      .def("__setstate__",
           [](StepProgram& program, const nb::bytes& bytes) {
             new (&program)
                 StepProgram(deserialize_step_program(std::string(bytes.c_str(), bytes.size())));
           })
      .def("__eq__", [](const StepProgram& a, const StepProgram& b) { return a == b; });
  def_array<StepProgram, &StepProgram::chunk_sequence_index>(cls, "chunk_sequence_index");
  def_array<StepProgram, &StepProgram::chunk_token_offset>(cls, "chunk_token_offset");
  def_array<StepProgram, &StepProgram::chunk_num_tokens>(cls, "chunk_num_tokens");
  def_array<StepProgram, &StepProgram::chunk_num_text_tokens>(cls, "chunk_num_text_tokens");
  def_array<StepProgram, &StepProgram::chunk_cross_text_tokens>(cls, "chunk_cross_text_tokens");
  def_array<StepProgram, &StepProgram::chunk_held_offset>(cls, "chunk_held_offset");
  def_array<StepProgram, &StepProgram::chunk_cross_text_offset>(cls, "chunk_cross_text_offset");
  def_array<StepProgram, &StepProgram::token_sequence_index>(cls, "token_sequence_index");
  def_array<StepProgram, &StepProgram::token_chunk_index>(cls, "token_chunk_index");
  def_array<StepProgram, &StepProgram::token_modality>(cls, "token_modality");
  def_array<StepProgram, &StepProgram::held_visual_index>(cls, "held_visual_index");
  def_array<StepProgram, &StepProgram::held_text_index>(cls, "held_text_index");
  def_array<StepProgram, &StepProgram::exchange_send_index>(cls, "exchange_send_index");
  def_array<StepProgram, &StepProgram::exchange_send_splits>(cls, "exchange_send_splits");
  def_array<StepProgram, &StepProgram::exchange_recv_splits>(cls, "exchange_recv_splits");
  def_array<StepProgram, &StepProgram::exchange_recv_index>(cls, "exchange_recv_index");
  def_array<StepProgram, &StepProgram::segment_sequence_index>(cls, "segment_sequence_index");
  def_array<StepProgram, &StepProgram::segment_kind>(cls, "segment_kind");
  def_array<StepProgram, &StepProgram::segment_in_exchange>(cls, "segment_in_exchange");
  def_array<StepProgram, &StepProgram::segment_row_offset>(cls, "segment_row_offset");
  def_array<StepProgram, &StepProgram::segment_num_tokens>(cls, "segment_num_tokens");
  def_array<StepProgram, &StepProgram::segment_num_heads>(cls, "segment_num_heads");
  def_array<StepProgram, &StepProgram::segment_head_offset>(cls, "segment_head_offset");
  def_array<StepProgram, &StepProgram::ring_segment>(cls, "ring_segment");
  def_array<StepProgram, &StepProgram::ring_degree>(cls, "ring_degree");
  def_array<StepProgram, &StepProgram::ring_position>(cls, "ring_position");
  def_array<StepProgram, &StepProgram::ring_peer_offset>(cls, "ring_peer_offset");
  def_array<StepProgram, &StepProgram::ring_peers>(cls, "ring_peers");
  def_array<StepProgram, &StepProgram::ring_block_tokens>(cls, "ring_block_tokens");
  def_array<StepProgram, &StepProgram::ring_own_rows>(cls, "ring_own_rows");
  def_array<StepProgram, &StepProgram::ring_exchange_rows>(cls, "ring_exchange_rows");
  cls.def("__repr__", [](const StepProgram& p) {
    return "StepProgram(rank=" + std::to_string(p.rank) +
           ", num_ranks=" + std::to_string(p.num_ranks) +
           ", num_heads=" + std::to_string(p.num_heads) +
           ", joint_attention=" + (p.joint_attention ? "True" : "False") +
           ", num_held_tokens=" + std::to_string(p.num_held_tokens) +
           ", num_chunks=" + std::to_string(p.chunk_num_tokens.size()) +
           ", num_segments=" + std::to_string(p.num_segments()) +
           ", num_exchange_rows=" + std::to_string(p.num_exchange_rows) +
           ", num_ring_steps=" + std::to_string(p.ring_steps.size()) + ")";
  });

  m.def("compile_step_program", &compile_step_program, nb::arg("batch"), nb::arg("plan"),
        nb::arg("rank"), nb::arg("num_heads"), nb::arg("joint_attention") = false,
        "One rank's step program for the runtime; raises ValueError when the plan does not "
        "match the batch or the head count, or the rank would hold more than 2^31 rows.");
  m.def("group_segments", &group_segments, nb::arg("q_row_offset"), nb::arg("k_row_offset"),
        nb::arg("q_len"), nb::arg("k_len"), nb::arg("num_heads"),
        "Segments grouped by shape (q_len, k_len, num_heads) into dense calls, largest first; "
        "empty segments dropped. The one grouping engine of every attention.");
}
