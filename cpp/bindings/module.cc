// zellige._core: the C++ planning core. One init_* per header; names mirror the C++ ones.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_workload(nb::module_& m);
void init_model_spec(nb::module_& m);
void init_cluster(nb::module_& m);
void init_profile(nb::module_& m);
void init_plan(nb::module_& m);
void init_cost_model(nb::module_& m);
void init_planners(nb::module_& m);
void init_simulator(nb::module_& m);
void init_plan_compiler(nb::module_& m);
void init_global_batch(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "Zellige planning core (C++20): workload, cost model, planners, plan compiler";
  init_workload(m);
  init_model_spec(m);
  init_cluster(m);
  init_profile(m);
  init_plan(m);
  init_cost_model(m);
  init_planners(m);
  init_simulator(m);
  init_plan_compiler(m);
  init_global_batch(m);
}
