#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_plan_compiler(nb::module_& m) { (void)m; }
