#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_profile(nb::module_& m) { (void)m; }
