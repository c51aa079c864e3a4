#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_cost_model(nb::module_& m) { (void)m; }
