#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_simulator(nb::module_& m) { (void)m; }
