// Bindings for zellige/global_batch.h: global-batch options, micro-batches and the planner.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "bind_util.h"
#include "zellige/global_batch.h"

namespace nb = nanobind;
using namespace nb::literals;

void init_global_batch(nb::module_& m) {
  using namespace zellige;
  using zellige_bindings::add_value_methods;

  nb::class_<GlobalBatchOptions> options(m, "GlobalBatchOptions");
  options.def_rw("seed", &GlobalBatchOptions::seed)
      .def_rw("time_limit_s", &GlobalBatchOptions::time_limit_s)
      .def_rw("micro_batch_overhead_s", &GlobalBatchOptions::micro_batch_overhead_s)
      .def_rw("extra_micro_batches", &GlobalBatchOptions::extra_micro_batches);
  add_value_methods(options,
                    {"seed", "time_limit_s", "micro_batch_overhead_s", "extra_micro_batches"});

  nb::class_<MicroBatch> micro_batch(m, "MicroBatch");
  micro_batch.def_rw("batch", &MicroBatch::batch).def_rw("plan", &MicroBatch::plan);
  add_value_methods(micro_batch, {"batch", "plan"});

  nb::class_<GlobalPlan> global_plan(m, "GlobalPlan");
  global_plan.def_rw("planner", &GlobalPlan::planner)
      .def_rw("chosen", &GlobalPlan::chosen)
      .def_rw("micro_batches", &GlobalPlan::micro_batches)
      .def_rw("step_time_s", &GlobalPlan::step_time_s)
      .def_rw("plan_ms", &GlobalPlan::plan_ms);
  add_value_methods(global_plan, {"planner", "chosen", "micro_batches", "step_time_s", "plan_ms"});

  m.def("plan_global_batch", &plan_global_batch, "planner"_a, "batch"_a, "cost_model"_a,
        "options"_a = GlobalBatchOptions{},
        "Cut one optimizer step's batch into micro-batches and place each; names: "
        "zellige, megatron-dcp, knapformer, static-cp, wlb-llm (docs/global-batch.md).");
  m.def("global_batch_planner_names", &global_batch_planner_names);
  m.def("global_batch_baseline_names", &global_batch_baseline_names);
  m.def("place_micro_batches", &place_micro_batches, "planner"_a, "batch"_a, "micro_batch_ids"_a,
        "cost_model"_a, "options"_a = GlobalBatchOptions{},
        "Place the given micro-batches (lists of sequence ids) with a make_plan planner.");
}
