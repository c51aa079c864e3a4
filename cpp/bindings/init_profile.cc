#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "bind_util.h"
#include "zellige/profile.h"

namespace nb = nanobind;
using namespace zellige;
using zellige_bindings::add_value_methods;

void init_profile(nb::module_& m) {
  nb::class_<Table> table(m, "Table",
                          "y(x) interpolated in log-log space; source is measured, seeded or "
                          "analytic.");
  table.def_rw("x", &Table::x)
      .def_rw("y", &Table::y)
      .def_rw("source", &Table::source)
      .def("empty", &Table::empty)
      .def("validate", &Table::validate, nb::arg("name"))
      .def(
          "__call__",
          [](const Table& table, double at) {
            if (table.empty() || !(at > 0)) {
              throw std::invalid_argument("Table(at): needs a non-empty table and at > 0");
            }
            return table(at);
          },
          nb::arg("at"));
  add_value_methods(table, {"x", "y", "source"});

  nb::class_<HardwareProfile> profile(
      m, "HardwareProfile", "Measured (or analytic) time tables of one device; see profile.h.");
  profile.def_rw("device_name", &HardwareProfile::device_name)
      .def_rw("created", &HardwareProfile::created)
      .def_rw("matmul_flops_per_s", &HardwareProfile::matmul_flops_per_s)
      .def_rw("attention_flops_per_s", &HardwareProfile::attention_flops_per_s)
      .def_rw("memory_bytes_per_s", &HardwareProfile::memory_bytes_per_s)
      .def_rw("attention_head_dim", &HardwareProfile::attention_head_dim)
      .def_rw("attention_forward_s_per_head", &HardwareProfile::attention_forward_s_per_head)
      .def_rw("attention_backward_s_per_head", &HardwareProfile::attention_backward_s_per_head)
      .def_rw("attention_call_lengths", &HardwareProfile::attention_call_lengths)
      .def_rw("attention_call_forward_s", &HardwareProfile::attention_call_forward_s)
      .def_rw("attention_call_backward_s", &HardwareProfile::attention_call_backward_s)
      .def_rw("launch_s_per_layer", &HardwareProfile::launch_s_per_layer)
      .def_rw("launch_s_per_attention_call", &HardwareProfile::launch_s_per_attention_call)
      .def_rw("matmul_forward_flops_per_s", &HardwareProfile::matmul_forward_flops_per_s)
      .def_rw("matmul_backward_flops_per_s", &HardwareProfile::matmul_backward_flops_per_s)
      .def_rw("exchange_group_sizes", &HardwareProfile::exchange_group_sizes)
      .def_rw("exchange_intra_node_s", &HardwareProfile::exchange_intra_node_s)
      .def_rw("exchange_overlap", &HardwareProfile::exchange_overlap)
      .def_rw("ulysses_layout_s_per_byte", &HardwareProfile::ulysses_layout_s_per_byte)
      .def_rw("ring_layout_s_per_byte", &HardwareProfile::ring_layout_s_per_byte)
      .def_rw("memory_models", &HardwareProfile::memory_models)
      .def_rw("activation_bytes_per_token_layer",
              &HardwareProfile::activation_bytes_per_token_layer)
      .def_rw("checkpoint_bytes_per_token_layer",
              &HardwareProfile::checkpoint_bytes_per_token_layer)
      .def_rw("backward_bytes_per_token_layer", &HardwareProfile::backward_bytes_per_token_layer)
      .def_rw("text_bytes_per_token_layer", &HardwareProfile::text_bytes_per_token_layer)
      .def_rw("step_fixed_bytes", &HardwareProfile::step_fixed_bytes)
      .def_rw("reduce_fixed_bytes", &HardwareProfile::reduce_fixed_bytes)
      .def_rw("reduce_bytes_per_token", &HardwareProfile::reduce_bytes_per_token)
      .def_rw("ulysses_bytes_per_token", &HardwareProfile::ulysses_bytes_per_token)
      .def_rw("ring_bytes_per_token", &HardwareProfile::ring_bytes_per_token)
      .def_rw("ulysses_exchanged_bytes_per_token",
              &HardwareProfile::ulysses_exchanged_bytes_per_token)
      .def_rw("attention_phase_bytes_per_token",
              &HardwareProfile::attention_phase_bytes_per_token)
      .def_rw("model_matmul_forward_flops_per_s",
              &HardwareProfile::model_matmul_forward_flops_per_s)
      .def_rw("model_matmul_backward_flops_per_s",
              &HardwareProfile::model_matmul_backward_flops_per_s)
      .def_rw("backward_peak_bytes", &HardwareProfile::backward_peak_bytes)
      .def_rw("runtime_reserved_bytes", &HardwareProfile::runtime_reserved_bytes)
      .def_rw("device_memory_bytes", &HardwareProfile::device_memory_bytes)
      .def_rw("attention_streams", &HardwareProfile::attention_streams)
      .def_rw("attention_stream_overlap", &HardwareProfile::attention_stream_overlap)
      .def_rw("attention_ragged", &HardwareProfile::attention_ragged)
      .def("validate", &HardwareProfile::validate);
  add_value_methods(profile, {"device_name",
                              "created",
                              "matmul_flops_per_s",
                              "attention_flops_per_s",
                              "memory_bytes_per_s",
                              "attention_head_dim",
                              "attention_forward_s_per_head",
                              "attention_backward_s_per_head",
                              "attention_call_lengths",
                              "attention_call_forward_s",
                              "attention_call_backward_s",
                              "launch_s_per_layer",
                              "launch_s_per_attention_call",
                              "matmul_forward_flops_per_s",
                              "matmul_backward_flops_per_s",
                              "exchange_group_sizes",
                              "exchange_intra_node_s",
                              "exchange_overlap",
                              "ulysses_layout_s_per_byte",
                              "ring_layout_s_per_byte",
                              "memory_models",
                              "activation_bytes_per_token_layer",
                              "checkpoint_bytes_per_token_layer",
                              "backward_bytes_per_token_layer",
                              "text_bytes_per_token_layer",
                              "step_fixed_bytes",
                              "reduce_fixed_bytes",
                              "reduce_bytes_per_token",
                              "ulysses_bytes_per_token",
                              "ring_bytes_per_token",
                              "ulysses_exchanged_bytes_per_token",
                              "attention_phase_bytes_per_token",
                              "model_matmul_forward_flops_per_s",
                              "model_matmul_backward_flops_per_s",
                              "backward_peak_bytes",
                              "runtime_reserved_bytes",
                              "device_memory_bytes",
                              "attention_streams",
                              "attention_stream_overlap",
                              "attention_ragged"});

  m.def("analytic_profile", &analytic_profile, nb::arg("device_name"),
        nb::arg("matmul_flops_per_s"), nb::arg("attention_flops_per_s"),
        nb::arg("memory_bytes_per_s"), "A profile with no tables: times from the peak rates.");
}
