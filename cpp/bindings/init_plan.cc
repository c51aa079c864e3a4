#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <tuple>

#include "bind_util.h"
#include "zellige/plan.h"

namespace nb = nanobind;
using namespace zellige;
using zellige_bindings::add_value_methods;

void init_plan(nb::module_& m) {
  nb::enum_<Strategy>(m, "Strategy", "How one sequence is spread over its ranks.")
      .value("local", Strategy::kLocal)
      .value("ulysses", Strategy::kUlysses)
      .value("ring", Strategy::kRing)
      .value("hybrid", Strategy::kHybrid);

  nb::class_<Placement> placement(m, "Placement", "Strategy + ordered ranks of one sequence.");
  placement.def_rw("sequence_id", &Placement::sequence_id)
      .def_rw("strategy", &Placement::strategy)
      .def_rw("ranks", &Placement::ranks)
      .def_rw("ulysses_degree", &Placement::ulysses_degree)
      .def_rw("ring_degree", &Placement::ring_degree)
      .def("degree", &Placement::degree);
  add_value_methods(placement,
                    {"sequence_id", "strategy", "ranks", "ulysses_degree", "ring_degree"});

  nb::class_<PlanPrediction> prediction(m, "PlanPrediction", "What the cost model predicts.");
  prediction.def_rw("makespan_s", &PlanPrediction::makespan_s)
      .def_rw("rank_time_s", &PlanPrediction::rank_time_s)
      .def_rw("rank_peak_bytes", &PlanPrediction::rank_peak_bytes)
      .def_rw("rank_checkpointed_layers", &PlanPrediction::rank_checkpointed_layers)
      .def_rw("rank_full_recompute_layers", &PlanPrediction::rank_full_recompute_layers);
  add_value_methods(prediction, {"makespan_s", "rank_time_s", "rank_peak_bytes",
                                 "rank_checkpointed_layers", "rank_full_recompute_layers"});

  nb::class_<Plan> plan(m, "Plan", "A placement per sequence plus the prediction.");
  plan.def_rw("planner", &Plan::planner)
      .def_rw("num_ranks", &Plan::num_ranks)
      .def_rw("placements", &Plan::placements)
      .def_rw("predicted", &Plan::predicted)
      .def_rw("plan_ms", &Plan::plan_ms)
      .def_rw("note", &Plan::note);
  add_value_methods(plan, {"planner", "num_ranks", "placements", "predicted", "plan_ms", "note"});

  m.def("make_placement", &make_placement, nb::arg("sequence_id"), nb::arg("strategy"),
        nb::arg("ranks"), nb::arg("ulysses_degree") = 0,
        "Sets the degrees from the strategy and rank count (ulysses_degree: hybrid only).");
  m.def("strategy_name", &strategy_name, nb::arg("placement"));
  m.def(
      "parse_strategy",
      [](const std::string& name) {
        Strategy strategy;
        int64_t ulysses_degree = 0, ring_degree = 0;
        parse_strategy(name, &strategy, &ulysses_degree, &ring_degree);
        return std::make_tuple(strategy, ulysses_degree, ring_degree);
      },
      nb::arg("name"),
      "(strategy, ulysses_degree, ring_degree); a degree only the rank count knows is 0.");
  m.def("balanced_split", &balanced_split, nb::arg("total"), nb::arg("parts"));
  m.def("validate_plan", &validate_plan, nb::arg("plan"), nb::arg("batch"), nb::arg("num_ranks"),
        nb::arg("num_heads"), "Raises ValueError naming the offending sequence.");
}
