#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bind_util.h"
#include "zellige/cluster.h"

namespace nb = nanobind;
using namespace zellige;
using zellige_bindings::add_value_methods;

void init_cluster(nb::module_& m) {
  nb::class_<Cluster> cluster(m, "Cluster", "Nodes x GPUs, GPU memory and links.");
  cluster.def_rw("num_nodes", &Cluster::num_nodes)
      .def_rw("gpus_per_node", &Cluster::gpus_per_node)
      .def_rw("gpu_memory_bytes", &Cluster::gpu_memory_bytes)
      .def_rw("intra_node_bytes_per_s", &Cluster::intra_node_bytes_per_s)
      .def_rw("inter_node_bytes_per_s", &Cluster::inter_node_bytes_per_s)
      .def_rw("intra_node_latency_s", &Cluster::intra_node_latency_s)
      .def_rw("inter_node_latency_s", &Cluster::inter_node_latency_s)
      .def("num_ranks", &Cluster::num_ranks)
      .def("node_of", &Cluster::node_of, nb::arg("rank"));
  add_value_methods(cluster,
                    {"num_nodes", "gpus_per_node", "gpu_memory_bytes", "intra_node_bytes_per_s",
                     "inter_node_bytes_per_s", "intra_node_latency_s", "inter_node_latency_s"});

  m.attr("MAX_GPUS") = kMaxGpus;  // the documented limit (cluster.h)
  m.def("make_cluster", &make_cluster, nb::arg("num_gpus"), nb::arg("gpus_per_node"),
        nb::arg("links") = "nvlink", "H200 nodes; links is 'nvlink' or 'pcie'.");
}
