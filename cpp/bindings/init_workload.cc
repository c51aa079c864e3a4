#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_workload(nb::module_& m) { (void)m; }
