// hemiola._C.cluster: bindings of the cluster scheduling simulator
// (cpp/src/cluster). Invalid input raises ValueError (std::invalid_argument).
// A stopped run raises Interrupted (a RuntimeError) or KeyboardInterrupt.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "cluster/contention.h"
#include "cluster/iteration_simulator.h"
#include "cluster/policy.h"
#include "cluster/simulator.h"
#include "cluster/trace.h"
#include "cluster/workload.h"

namespace py = pybind11;

namespace hemiola::python {

void bind_cluster(py::module_& m) {
  using namespace hemiola::cluster;
  auto c = m.def_submodule("cluster", "Cluster scheduling simulator (event-driven).");
  py::register_exception<Interrupted>(c, "Interrupted", PyExc_RuntimeError);

  py::class_<ModelSpec>(c, "ModelSpec", "A DNN model: all-reduce size, compute times, memory.")
      .def(py::init<>())
      .def(py::init([](std::string name, double size_mb, double forward_ms, double backward_ms,
                       double memory_mb) {
             return ModelSpec{std::move(name), size_mb, forward_ms, backward_ms, memory_mb};
           }),
           py::arg("name"), py::arg("size_mb"), py::arg("forward_ms"), py::arg("backward_ms"),
           py::arg("memory_mb"))
      .def_readwrite("name", &ModelSpec::name)
      .def_readwrite("size_mb", &ModelSpec::size_mb)
      .def_readwrite("forward_ms", &ModelSpec::forward_ms)
      .def_readwrite("backward_ms", &ModelSpec::backward_ms)
      .def_readwrite("memory_mb", &ModelSpec::memory_mb)
      .def("__repr__", [](const ModelSpec& s) {
        return "ModelSpec(" + s.name + ", " + std::to_string(s.size_mb) + " MB)";
      });

  py::class_<ClusterSpec>(c, "ClusterSpec", "nodes x gpus_per_node GPUs and the link model.")
      .def(py::init<>())
      .def_readwrite("nodes", &ClusterSpec::nodes)
      .def_readwrite("gpus_per_node", &ClusterSpec::gpus_per_node)
      .def_readwrite("gpu_memory_mb", &ClusterSpec::gpu_memory_mb)
      .def_readwrite("beta_ms_per_mb", &ClusterSpec::beta_ms_per_mb)
      .def_readwrite("eta_ms_per_mb", &ClusterSpec::eta_ms_per_mb)
      .def_property_readonly("total_gpus", &ClusterSpec::total_gpus);

  py::class_<JobSpec>(c, "JobSpec", "A job: model index, GPUs, iterations, arrival time.")
      .def(py::init<>())
      .def_readwrite("id", &JobSpec::id)
      .def_readwrite("model", &JobSpec::model)
      .def_readwrite("num_gpus", &JobSpec::num_gpus)
      .def_readwrite("iterations", &JobSpec::iterations)
      .def_readwrite("arrival_ms", &JobSpec::arrival_ms)
      .def_readwrite("origin", &JobSpec::origin);

  py::class_<PolicyConfig>(c, "PolicyConfig", "Placement, communication policy and fidelity.")
      .def(py::init([](const std::string& placement, const std::string& comm,
                       const std::string& fidelity, std::uint64_t seed,
                       const std::string& job_order) {
             PolicyConfig p;
             parse_placement(placement, p);
             parse_comm(comm, p);
             p.fidelity = parse_fidelity(fidelity);
             p.seed = seed;
             p.job_order = parse_job_order(job_order);
             return p;
           }),
           py::arg("placement") = "lwf:4", py::arg("comm") = "ada-srsf",
           py::arg("fidelity") = "task", py::arg("seed") = 0, py::arg("job_order") = "fifo")
      .def_property_readonly("placement", &placement_name)
      .def_property_readonly("comm", &comm_name)
      .def_property_readonly("fidelity",
                             [](const PolicyConfig& p) { return fidelity_name(p.fidelity); })
      .def_property_readonly("job_order",
                             [](const PolicyConfig& p) { return job_order_name(p.job_order); })
      .def_readonly("kappa", &PolicyConfig::kappa)
      .def_readonly("seed", &PolicyConfig::seed);

  py::class_<JobResult>(c, "JobResult")
      .def_readonly("id", &JobResult::id)
      .def_readonly("arrival_ms", &JobResult::arrival_ms)
      .def_readonly("start_ms", &JobResult::start_ms)
      .def_readonly("finish_ms", &JobResult::finish_ms)
      .def_readonly("jct_ms", &JobResult::jct_ms)
      .def_readonly("transferred_mb", &JobResult::transferred_mb)
      .def_readonly("iterations", &JobResult::iterations)
      .def_readonly("multi_node", &JobResult::multi_node)
      .def_readonly("gpus", &JobResult::gpus);

  py::class_<SimulationResult>(c, "SimulationResult")
      .def_readonly("jobs", &SimulationResult::jobs)
      .def_readonly("mean_jct_ms", &SimulationResult::mean_jct_ms)
      .def_readonly("median_jct_ms", &SimulationResult::median_jct_ms)
      .def_readonly("p99_jct_ms", &SimulationResult::p99_jct_ms)
      .def_readonly("makespan_ms", &SimulationResult::makespan_ms)
      .def_readonly("gpu_utilization", &SimulationResult::gpu_utilization)
      .def_readonly("util_time_ms", &SimulationResult::util_time_ms)
      .def_readonly("util_value", &SimulationResult::util_value)
      .def_readonly("events", &SimulationResult::events)
      .def_readonly("transfers", &SimulationResult::transfers)
      .def_readonly("shared_transfer_starts", &SimulationResult::shared_transfer_starts)
      .def_readonly("placement", &SimulationResult::placement)
      .def_readonly("comm", &SimulationResult::comm)
      .def_readonly("fidelity", &SimulationResult::fidelity)
      .def_readonly("job_order", &SimulationResult::job_order);

  c.def("builtin_models", &builtin_models, "The paper's four models.");
  c.def("load_models_csv", &load_models_csv, py::arg("path"),
        "Models from CSV (name,size_mb,forward_ms,backward_ms,memory_mb).");
  c.def("find_model", &find_model, py::arg("models"), py::arg("name"));
  c.def(
      "paper_workload",
      [](int jobs, std::uint64_t seed, int num_models, long long min_iterations,
         long long max_iterations, double arrival_window_ms) {
        PaperWorkloadOptions o;
        o.jobs = jobs;
        o.seed = seed;
        o.min_iterations = min_iterations;
        o.max_iterations = max_iterations;
        o.arrival_window_ms = arrival_window_ms;
        return paper_workload(o, num_models);
      },
      py::arg("jobs") = 160, py::arg("seed") = 0, py::arg("num_models") = 4,
      py::arg("min_iterations") = 10, py::arg("max_iterations") = 60,
      py::arg("arrival_window_ms") = 12000.0, "The paper's synthetic workload, seeded.");
  c.def(
      "load_trace",
      [](const std::string& path, const std::vector<ModelSpec>& models, const ClusterSpec& cluster,
         std::uint64_t seed, long long first_row, long long max_rows) {
        TraceOptions o;
        o.seed = seed;
        o.first_row = first_row;
        o.max_rows = max_rows;
        // As simulate: the GIL is taken back every few milliseconds only to
        // let Python handle signals (Ctrl-C raises KeyboardInterrupt).
        o.stop = [] {
          py::gil_scoped_acquire gil;
          if (PyErr_CheckSignals() != 0) throw py::error_already_set();
          return false;
        };
        py::gil_scoped_release release;
        return load_trace(path, models, cluster, o);
      },
      py::arg("path"), py::arg("models"), py::arg("cluster"), py::arg("seed") = 0,
      py::arg("first_row") = 0, py::arg("max_rows") = -1,
      "Jobs from a Philly-format CSV trace; KeyboardInterrupt on Ctrl-C while it loads.");
  // The run releases the GIL; it takes it back every few milliseconds only to
  // let Python handle signals (Ctrl-C raises KeyboardInterrupt out of the run)
  // and to ask `should_stop`, which lets another thread cancel it (signals
  // reach only the main thread).
  c.def(
      "simulate",
      [](const ClusterSpec& cluster, const std::vector<ModelSpec>& models,
         const std::vector<JobSpec>& jobs, const PolicyConfig& policy, py::object should_stop) {
        const StopCheck check = [&should_stop]() {
          py::gil_scoped_acquire gil;
          if (PyErr_CheckSignals() != 0) throw py::error_already_set();
          return !should_stop.is_none() && should_stop().cast<bool>();
        };
        py::gil_scoped_release release;
        return simulate(cluster, models, jobs, policy, check);
      },
      py::arg("cluster"), py::arg("models"), py::arg("jobs"), py::arg("policy"),
      py::arg("should_stop") = py::none(),
      "Run one simulation; raises ValueError for invalid input, KeyboardInterrupt on Ctrl-C, "
      "Interrupted when should_stop() returns True.");
  c.def("transfer_rate", &transfer_rate, py::arg("k"), py::arg("cluster"),
        "Per-transfer rate (MB/ms) with k transfers on one interface.");
  c.def("adadual_threshold", &adadual_threshold, py::arg("cluster"));
  c.def("fluid_comm_ms", &fluid_comm_ms, py::arg("size_mb"), py::arg("jobs_on_node"),
        py::arg("cap"), py::arg("cluster"));
}

}  // namespace hemiola::python
