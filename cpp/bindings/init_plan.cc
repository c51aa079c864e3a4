#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_plan(nb::module_& m) { (void)m; }
