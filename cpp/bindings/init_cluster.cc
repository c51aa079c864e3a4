#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bind_util.h"
#include "zellige/cluster.h"

namespace nb = nanobind;
using namespace zellige;
using zellige_bindings::add_value_methods;

namespace {

// The accessors index the per-rank lists; Python gets an error, not undefined behaviour.
void check_rank(const Cluster& cluster, int64_t rank) {
  validate_cluster(cluster);
  if (rank < 0 || rank >= cluster.num_ranks()) {
    throw nb::index_error(("rank " + std::to_string(rank) + " outside [0, " +
                           std::to_string(cluster.num_ranks()) + ")")
                              .c_str());
  }
}

}  // namespace

void init_cluster(nb::module_& m) {
  nb::class_<Cluster> cluster(m, "Cluster", "Nodes x GPUs, GPU memory and links.");
  cluster.def_rw("num_nodes", &Cluster::num_nodes)
      .def_rw("gpus_per_node", &Cluster::gpus_per_node)
      .def_rw("gpu_memory_bytes", &Cluster::gpu_memory_bytes)
      .def_rw("intra_node_bytes_per_s", &Cluster::intra_node_bytes_per_s)
      .def_rw("inter_node_bytes_per_s", &Cluster::inter_node_bytes_per_s)
      .def_rw("intra_node_latency_s", &Cluster::intra_node_latency_s)
      .def_rw("inter_node_latency_s", &Cluster::inter_node_latency_s)
      .def_rw("rank_speeds", &Cluster::rank_speeds,
              "Per rank: relative speed (1.0 = the profile's device); empty: all 1.0.")
      .def_rw("rank_memory_bytes", &Cluster::rank_memory_bytes,
              "Per rank: usable GPU memory; empty: all gpu_memory_bytes.")
      .def("num_ranks", &Cluster::num_ranks)
      .def("node_of", &Cluster::node_of, nb::arg("rank"))
      .def(
          "speed_of",
          [](const Cluster& c, int64_t rank) {
            check_rank(c, rank);
            return c.speed_of(rank);
          },
          nb::arg("rank"))
      .def(
          "memory_of",
          [](const Cluster& c, int64_t rank) {
            check_rank(c, rank);
            return c.memory_of(rank);
          },
          nb::arg("rank"))
      .def("heterogeneous", &Cluster::heterogeneous)
      .def("total_speed", &Cluster::total_speed)
      .def("validate", &validate_cluster,
           "Raise ValueError unless the per-rank lists are empty or one entry per rank, speeds "
           "positive and finite, memory positive.");
  add_value_methods(cluster,
                    {"num_nodes", "gpus_per_node", "gpu_memory_bytes", "intra_node_bytes_per_s",
                     "inter_node_bytes_per_s", "intra_node_latency_s", "inter_node_latency_s",
                     "rank_speeds", "rank_memory_bytes"});
  m.def("homogeneous_view", &homogeneous_view, nb::arg("cluster"),
        "The cluster with every rank alike (no speeds, the smallest rank memory): what a "
        "speed-unaware planner sees.");

  m.attr("MAX_GPUS") = kMaxGpus;  // the documented limit (cluster.h)
  m.def("make_cluster", &make_cluster, nb::arg("num_gpus"), nb::arg("gpus_per_node"),
        nb::arg("links") = "nvlink", "H200 nodes; links is 'nvlink' or 'pcie'.");
}
