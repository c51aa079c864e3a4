#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bind_util.h"
#include "zellige/simulator.h"

namespace nb = nanobind;
using namespace zellige;
using zellige_bindings::add_value_methods;

void init_simulator(nb::module_& m) {
  nb::class_<TimelineSegment> segment(m, "TimelineSegment",
                                      "One Gantt bar: a rank, a sequence, a phase, [start, end).");
  segment.def_rw("rank", &TimelineSegment::rank)
      .def_rw("sequence_id", &TimelineSegment::sequence_id)
      .def_rw("phase", &TimelineSegment::phase)
      .def_rw("start_s", &TimelineSegment::start_s)
      .def_rw("end_s", &TimelineSegment::end_s);
  add_value_methods(segment, {"rank", "sequence_id", "phase", "start_s", "end_s"});

  m.def("simulate", &simulate, nb::arg("batch"), nb::arg("plan"), nb::arg("cost_model"),
        "Per-rank timeline of a plan; ends equal the cost model's rank times.");
}
