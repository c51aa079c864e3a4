#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_model_spec(nb::module_& m) { (void)m; }
