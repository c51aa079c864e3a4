#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_planners(nb::module_& m) { (void)m; }
