#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_cluster(nb::module_& m) { (void)m; }
