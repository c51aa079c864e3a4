#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <tuple>

#include "bind_util.h"
#include "zellige/cost_model.h"

namespace nb = nanobind;
using namespace zellige;
using zellige_bindings::add_value_methods;

void init_cost_model(nb::module_& m) {
  nb::class_<CostOptions> options(m, "CostOptions", "Knobs of the cost model.");
  options.def_rw("activation_checkpointing", &CostOptions::activation_checkpointing)
      .def_rw("bytes_per_element", &CostOptions::bytes_per_element)
      .def_rw("state_bytes_per_param", &CostOptions::state_bytes_per_param)
      .def_rw("gradient_bytes_per_param", &CostOptions::gradient_bytes_per_param)
      .def_rw("memory_headroom", &CostOptions::memory_headroom)
      .def_rw("adaptive_checkpointing", &CostOptions::adaptive_checkpointing)
      .def_rw("weights_kept_to_backward", &CostOptions::weights_kept_to_backward)
      .def_rw("optimizer_copy_bytes_per_param", &CostOptions::optimizer_copy_bytes_per_param)
      .def_rw("accumulating_gradients", &CostOptions::accumulating_gradients);
  add_value_methods(
      options,
      {"activation_checkpointing", "bytes_per_element", "state_bytes_per_param",
       "gradient_bytes_per_param", "memory_headroom", "adaptive_checkpointing",
       "weights_kept_to_backward", "optimizer_copy_bytes_per_param", "accumulating_gradients"});
  // Pickled whole (every field, in declaration order), so a DataLoader worker receives the
  // options a run chose as one value.
  using OptionsState = std::tuple<bool, int64_t, double, double, double, bool, bool, double, bool>;
  options
      .def("__getstate__",
           [](const CostOptions& o) {
             return OptionsState(o.activation_checkpointing, o.bytes_per_element,
                                 o.state_bytes_per_param, o.memory_headroom,
                                 o.gradient_bytes_per_param, o.adaptive_checkpointing,
                                 o.weights_kept_to_backward, o.optimizer_copy_bytes_per_param,
                                 o.accumulating_gradients);
           })
      .def("__setstate__", [](CostOptions& o, const OptionsState& state) {
        new (&o) CostOptions();
        std::tie(o.activation_checkpointing, o.bytes_per_element, o.state_bytes_per_param,
                 o.memory_headroom, o.gradient_bytes_per_param, o.adaptive_checkpointing,
                 o.weights_kept_to_backward, o.optimizer_copy_bytes_per_param,
                 o.accumulating_gradients) = state;
      });

  nb::class_<RankShare> share(m, "RankShare", "What one placement costs one of its ranks.");
  share.def_rw("rank", &RankShare::rank)
      .def_rw("tokens", &RankShare::tokens)
      .def_rw("attention_s", &RankShare::attention_s)
      .def_rw("exchange_s", &RankShare::exchange_s)
      .def_rw("memory_bytes", &RankShare::memory_bytes)
      .def_rw("layer_activation_bytes", &RankShare::layer_activation_bytes)
      .def_rw("layer_checkpoint_bytes", &RankShare::layer_checkpoint_bytes)
      .def_rw("buffer_bytes", &RankShare::buffer_bytes)
      .def_rw("layer_input_bytes", &RankShare::layer_input_bytes)
      .def_rw("recompute_s", &RankShare::recompute_s)
      .def_rw("recompute_exchange_s", &RankShare::recompute_exchange_s)
      .def_rw("attention_recompute_s", &RankShare::attention_recompute_s)
      .def_rw("attention_recompute_exchange_s", &RankShare::attention_recompute_exchange_s);
  add_value_methods(share, {"rank", "tokens", "attention_s", "exchange_s", "memory_bytes",
                            "layer_activation_bytes", "layer_checkpoint_bytes", "buffer_bytes",
                            "layer_input_bytes", "recompute_s", "recompute_exchange_s",
                            "attention_recompute_s", "attention_recompute_exchange_s"});

  nb::class_<RankCost> rank_cost(m, "RankCost", "One rank's time and peak memory in a plan.");
  rank_cost.def_rw("time_s", &RankCost::time_s)
      .def_rw("peak_bytes", &RankCost::peak_bytes)
      .def_rw("tokens", &RankCost::tokens)
      .def_rw("linear_s", &RankCost::linear_s)
      .def_rw("attention_s", &RankCost::attention_s)
      .def_rw("exchange_s", &RankCost::exchange_s)
      .def_rw("call_s", &RankCost::call_s)
      .def_rw("stream_s", &RankCost::stream_s)
      .def_rw("launch_floor_s", &RankCost::launch_floor_s)
      .def_rw("attention_calls", &RankCost::attention_calls)
      .def_rw("checkpointed_layers", &RankCost::checkpointed_layers)
      .def_rw("full_recompute_layers", &RankCost::full_recompute_layers);
  add_value_methods(rank_cost,
                    {"time_s", "peak_bytes", "tokens", "linear_s", "attention_s", "exchange_s",
                     "call_s", "stream_s", "launch_floor_s", "attention_calls",
                     "checkpointed_layers", "full_recompute_layers"});

  nb::class_<PlanCost> plan_cost(m, "PlanCost", "Every rank's cost, makespan, bytes and fit.");
  plan_cost.def_rw("ranks", &PlanCost::ranks)
      .def_rw("makespan_s", &PlanCost::makespan_s)
      .def_rw("peak_bytes", &PlanCost::peak_bytes)
      .def_rw("exchange_bytes", &PlanCost::exchange_bytes)
      .def_rw("fits", &PlanCost::fits);
  add_value_methods(plan_cost, {"ranks", "makespan_s", "peak_bytes", "exchange_bytes", "fits"});

  nb::class_<CostModel>(m, "CostModel",
                        "Time and memory of any placement of a sequence, and of a whole plan.")
      .def(nb::init<ModelSpec, HardwareProfile, Cluster, CostOptions>(), nb::arg("model"),
           nb::arg("profile"), nb::arg("cluster"), nb::arg("options") = CostOptions())
      .def_prop_ro("model", &CostModel::model)
      .def_prop_ro("profile", &CostModel::profile)
      .def_prop_ro("cluster", &CostModel::cluster)
      .def_prop_ro("options", &CostModel::options)
      .def("shares", nb::overload_cast<const Sequence&, const Placement&>(&CostModel::shares, nb::const_), nb::arg("sequence"), nb::arg("placement"))
      .def("linear_time_s", &CostModel::linear_time_s, nb::arg("tokens"))
      .def("min_linear_time_per_token_s", &CostModel::min_linear_time_per_token_s)
      .def("fixed_bytes", &CostModel::fixed_bytes)
      .def("gradient_bytes", &CostModel::gradient_bytes)
      .def(
          "rank_peak_bytes",
          [](const CostModel& self, double activation, double checkpoint, double buffer,
             int64_t checkpointed_layers, double input, int64_t full_layers,
             int64_t held_tokens) {
            return self.rank_peak_bytes(activation, checkpoint, input, buffer,
                                        checkpointed_layers, full_layers, held_tokens);
          },
          nb::arg("layer_activation_bytes"), nb::arg("layer_checkpoint_bytes"),
          nb::arg("buffer_bytes"), nb::arg("checkpointed_layers"),
          nb::arg("layer_input_bytes") = 0.0, nb::arg("full_layers") = 0,
          nb::arg("held_tokens") = 0)
      .def("linear_recompute_s", &CostModel::linear_recompute_s, nb::arg("tokens"))
      .def(
          "memory_capacity_bytes",
          [](const CostModel& self, std::optional<int64_t> rank) {
            if (!rank) return self.memory_capacity_bytes();
            if (*rank < 0 || *rank >= self.cluster().num_ranks()) {
              throw nb::index_error(("rank " + std::to_string(*rank) + " outside [0, " +
                                     std::to_string(self.cluster().num_ranks()) + ")")
                                        .c_str());
            }
            return self.memory_capacity_bytes(*rank);
          },
          nb::arg("rank") = nb::none(),
          "Usable bytes of `rank`; without one, the bytes every rank has (the smallest rank's).")
      .def("homogeneous_view", &CostModel::homogeneous_view,
           "This cost model with every rank alike (no speeds, the smallest rank memory): what "
           "the speed-blind baselines plan with.")
      .def("accumulating_view", &CostModel::accumulating_view,
           "This cost model pricing a micro-batch of a step of several (gradient accumulation: "
           "the gradients of the earlier micro-batches held through its backward).")
      .def("rank_time_s", &CostModel::rank_time_s, nb::arg("tokens"), nb::arg("attention_s"),
           nb::arg("exchange_s"))
      .def("evaluate", nb::overload_cast<const Batch&, const Plan&>(&CostModel::evaluate, nb::const_), nb::arg("batch"), nb::arg("plan"))
      .def("exchange_bytes", &CostModel::exchange_bytes, nb::arg("sequence"), nb::arg("placement"))
      .def("__repr__", [](const CostModel& cost_model) {
        return "CostModel(model='" + cost_model.model().name + "', device='" +
               cost_model.profile().device_name +
               "', num_ranks=" + std::to_string(cost_model.cluster().num_ranks()) +
               ", gpus_per_node=" + std::to_string(cost_model.cluster().gpus_per_node) +
               ", activation_checkpointing=" +
               (cost_model.options().activation_checkpointing ? "True" : "False") + ")";
      });

  m.attr("RAGGED_MIN_CALLS") = kRaggedMinCalls;  // runtime/coalesced.py reads them
  m.attr("RAGGED_MAX_SEGMENT_TOKENS") = kRaggedMaxSegmentTokens;
  m.def("stream_assignment", &stream_assignment, nb::arg("works"), nb::arg("streams"),
        "The stream of each attention call of one table (calls most work first): the one with "
        "the least work queued so far, the lowest index on ties. The engine and the cost model "
        "both use this.");
  m.def("streamed_calls_s", &streamed_calls_s, nb::arg("works"), nb::arg("seconds"),
        nb::arg("streams"), nb::arg("overlap"),
        "Seconds of one table's calls on `streams` streams as the cost model prices them.");
  m.def("makespan_lower_bound", &makespan_lower_bound, nb::arg("batch"), nb::arg("cost_model"),
        "A makespan no placement of the batch can beat under this cost model.");
}
