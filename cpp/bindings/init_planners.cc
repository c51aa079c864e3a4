// Bindings for zellige/planners.h: the planner registry, the policies and PlanMemoryError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "zellige/planners.h"

namespace nb = nanobind;
using namespace nb::literals;

void init_planners(nb::module_& m) {
  using namespace zellige;

  // A ValueError, so user-facing code can catch bad input and memory refusals alike.
  nb::exception<PlanMemoryError>(m, "PlanMemoryError", PyExc_ValueError);

  nb::class_<PlannerOptions>(m, "PlannerOptions")
      .def(
          "__init__",
          [](PlannerOptions* self, uint64_t seed, double time_limit_s) {
            new (self) PlannerOptions{seed, time_limit_s};
          },
          nb::kw_only(), "seed"_a = 0, "time_limit_s"_a = 10.0)
      .def_rw("seed", &PlannerOptions::seed)
      .def_rw("time_limit_s", &PlannerOptions::time_limit_s)
      .def("__repr__", [](const PlannerOptions& options) {
        return "PlannerOptions(seed=" + std::to_string(options.seed) +
               ", time_limit_s=" + nb::repr(nb::float_(options.time_limit_s)).c_str() + ")";
      });

  m.def("make_plan", &make_plan, "planner"_a, "batch"_a, "cost_model"_a,
        "options"_a = PlannerOptions{},
        "Place every sequence of `batch` with the named planner; the plan is validated and "
        "carries the cost model's prediction and plan_ms. Names: dp-tokens, dp-cost, "
        "static-cp:C, knapformer:SPEC[:GAMMA], megatron-dcp, zellige.");
  m.def("planner_names", &planner_names, "The planner name forms make_plan accepts.");
  m.def("covered_baselines", &covered_baselines, "batch"_a, "cost_model"_a,
        "The baselines zellige is never worse than on this batch and cluster (docs/planner.md).");
  m.def("predict", &predict, "plan"_a, "batch"_a, "cost_model"_a,
        "Fill plan.predicted in place from the cost model.");
  m.def("check_sequences_fit", &check_sequences_fit, "batch"_a, "cost_model"_a,
        "Raise PlanMemoryError for the first sequence that fits under no placement.");

  m.def("plan_dp_tokens", &plan_dp_tokens, "batch"_a, "cost_model"_a);
  m.def("plan_dp_cost", &plan_dp_cost, "batch"_a, "cost_model"_a);
  m.def("plan_static_cp", &plan_static_cp, "batch"_a, "cost_model"_a, "group_size"_a);
  m.def("plan_knapformer", &plan_knapformer, "batch"_a, "cost_model"_a, "spec"_a, "gamma"_a = 0.4);
  m.def("plan_megatron_dcp", &plan_megatron_dcp, "batch"_a, "cost_model"_a);
  m.def("plan_zellige", &plan_zellige, "batch"_a, "cost_model"_a, "options"_a = PlannerOptions{});
  m.def("candidate_placements", &candidate_placements, "sequence"_a, "cost_model"_a,
        "max_windows_per_shape"_a, "max_degree"_a = 0);
}
