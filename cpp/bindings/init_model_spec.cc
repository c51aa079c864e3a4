#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bind_util.h"
#include "zellige/model_spec.h"

namespace nb = nanobind;
using namespace zellige;
using zellige_bindings::add_value_methods;

void init_model_spec(nb::module_& m) {
  nb::class_<ModelSpec> spec(m, "ModelSpec", "DiT sizes (see zellige.model_preset).");
  spec.def_rw("name", &ModelSpec::name)
      .def_rw("width", &ModelSpec::width)
      .def_rw("num_layers", &ModelSpec::num_layers)
      .def_rw("num_double_layers", &ModelSpec::num_double_layers)
      .def_rw("num_heads", &ModelSpec::num_heads)
      .def_rw("head_dim", &ModelSpec::head_dim)
      .def_rw("ffn_width", &ModelSpec::ffn_width)
      .def_rw("text_tokens", &ModelSpec::text_tokens)
      .def_rw("joint_attention", &ModelSpec::joint_attention)
      .def_rw("param_count", &ModelSpec::param_count);
  add_value_methods(spec,
                    {"name", "width", "num_layers", "num_double_layers", "num_heads", "head_dim",
                     "ffn_width", "text_tokens", "joint_attention", "param_count"});

  nb::class_<LayerFlops> flops(m, "LayerFlops", "Forward FLOPs of one layer for one sequence.");
  flops.def_rw("linear", &LayerFlops::linear)
      .def_rw("self_attention", &LayerFlops::self_attention)
      .def_rw("cross_attention", &LayerFlops::cross_attention);
  add_value_methods(flops, {"linear", "self_attention", "cross_attention"});

  // The documented bounds of a model's sizes (model_spec.h).
  m.attr("MAX_MODEL_WIDTH") = kMaxModelWidth;
  m.attr("MAX_MODEL_HEADS") = kMaxModelHeads;
  m.attr("MAX_MODEL_LAYERS") = kMaxModelLayers;
  m.attr("MAX_MODEL_FFN_WIDTH") = kMaxModelFfnWidth;
  m.attr("MAX_MODEL_PARAMS") = kMaxModelParams;

  m.def("model_preset", &model_preset, nb::arg("name"));
  m.def("model_preset_names", &model_preset_names);
  m.def("validate_model_spec", &validate_model_spec, nb::arg("model"));
  m.def("make_model_spec", &make_model_spec, nb::arg("name"), nb::arg("width"),
        nb::arg("num_heads"), nb::arg("num_layers"), nb::arg("ffn_width"), nb::arg("text_tokens"),
        nb::arg("joint_attention"), nb::arg("num_double_layers") = 0, nb::arg("head_dim") = 0,
        nb::arg("param_count") = 0);
  m.def("layer_forward_flops", &layer_forward_flops, nb::arg("model"), nb::arg("num_tokens"),
        nb::arg("text_tokens"));
  m.def("attended_tokens", &attended_tokens, nb::arg("model"), nb::arg("num_tokens"),
        nb::arg("text_tokens"));
  m.def("train_flops", &train_flops, nb::arg("model"), nb::arg("num_tokens"),
        nb::arg("text_tokens"));
}
