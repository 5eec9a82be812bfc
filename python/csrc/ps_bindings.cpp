// Bindings for the parameter server (hemiola/ps.h) as the submodule _C.ps.
// Tensors cross as data pointers (integers); blocking calls release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "hemiola/ps.h"
#include "hemiola/status.h"

namespace py = pybind11;

namespace hemiola::python {

namespace {

const float* as_floats(uintptr_t p) { return reinterpret_cast<const float*>(p); }

}  // namespace

void bind_ps(py::module_& parent) {
  using namespace hemiola::ps;
  py::module_ m = parent.def_submodule("ps", "Parameter server (see hemiola/ps.h)");

  m.def("consistency_from_name", [](const std::string& n) {
    return static_cast<int>(consistency_from_name(n));
  });
  m.def("staleness_factor", [](const std::string& rule, int64_t tau) {
    return staleness_factor(staleness_rule_from_name(rule), tau);
  }, py::arg("rule"), py::arg("tau"));
  m.def("plan_shards", [](const std::vector<int64_t>& numels, int servers, int64_t partition) {
    py::list out;
    for (const auto& s : plan_shards(numels, servers, partition))
      out.append(py::dict(py::arg("key") = s.key, py::arg("tensor") = s.tensor,
                          py::arg("begin") = s.begin, py::arg("count") = s.count,
                          py::arg("server") = s.server));
    return out;
  }, py::arg("numels"), py::arg("num_servers"), py::arg("partition_elems"));

  py::class_<ServerStats>(m, "ServerStats")
      .def_readonly("pushes_applied", &ServerStats::pushes_applied)
      .def_readonly("pulls_answered", &ServerStats::pulls_answered)
      .def_readonly("rejected", &ServerStats::rejected)
      .def_readonly("refused", &ServerStats::refused)
      .def_readonly("snapshots", &ServerStats::snapshots)
      .def_readonly("dead_workers", &ServerStats::dead_workers)
      .def_readonly("rejections", &ServerStats::rejections);

  py::class_<Server>(m, "Server")
      .def(py::init([](int server_index, int num_servers, int num_workers,
                       const std::string& consistency, int staleness_bound, double timeout_s,
                       std::shared_ptr<Store> store, const std::string& snapshot_path,
                       bool restore, double snapshot_every_s, const std::string& iface,
                       const std::string& master_addr, const std::string& token,
                       bool check_finite) {
             ServerOptions o;
             o.server_index = server_index;
             o.num_servers = num_servers;
             o.num_workers = num_workers;
             o.consistency = consistency_from_name(consistency);
             o.staleness_bound = staleness_bound;
             o.timeout_s = timeout_s;
             o.snapshot_path = snapshot_path;
             o.restore = restore;
             o.snapshot_every_s = snapshot_every_s;
             o.iface = iface;
             o.master_addr = master_addr;
             o.token = token;
             o.check_finite = check_finite;
             py::gil_scoped_release release;
             return std::make_unique<Server>(o, std::move(store));
           }),
           py::kw_only(), py::arg("server_index"), py::arg("num_servers"),
           py::arg("num_workers"), py::arg("consistency"), py::arg("staleness_bound") = 0,
           py::arg("timeout_s") = 300.0, py::arg("store"), py::arg("snapshot_path") = "",
           py::arg("restore") = false, py::arg("snapshot_every_s") = 0.0,
           py::arg("iface") = "", py::arg("master_addr") = "", py::arg("token") = "",
           py::arg("check_finite") = true)
      .def("serve", &Server::serve, py::call_guard<py::gil_scoped_release>(),
           "Serves until every worker has left; raises when the job cannot go on.")
      .def("snapshot", &Server::snapshot, py::call_guard<py::gil_scoped_release>())
      .def("stats", &Server::stats);

  py::class_<PushRecord>(m, "PushRecord")
      .def_readonly("tensor", &PushRecord::tensor)
      .def_readonly("key", &PushRecord::key)
      .def_readonly("computed_on", &PushRecord::computed_on)
      .def_readonly("applied_at", &PushRecord::applied_at)
      .def_readonly("staleness", &PushRecord::staleness)
      .def_readonly("lr_factor", &PushRecord::lr_factor);

  py::class_<Client>(m, "Client")
      .def(py::init([](int worker_index, int num_workers, int num_servers,
                       const std::string& consistency, const std::string& staleness_rule,
                       const std::string& optimizer, int64_t partition_elems, double timeout_s,
                       const std::vector<std::string>& names, const std::vector<int64_t>& numels,
                       std::shared_ptr<Store> store, const std::string& iface,
                       const std::string& master_addr, const std::string& token,
                       bool local_correction, const std::string& momentum_rule) {
             ClientOptions o;
             o.worker_index = worker_index;
             o.num_workers = num_workers;
             o.num_servers = num_servers;
             o.consistency = consistency_from_name(consistency);
             o.staleness_rule = staleness_rule_from_name(staleness_rule);
             o.optimizer = optimizer_kind(optimizer);
             o.partition_elems = partition_elems;
             o.timeout_s = timeout_s;
             o.iface = iface;
             o.master_addr = master_addr;
             o.token = token;
             o.local_correction = local_correction;
             o.momentum_rule = momentum_rule_from_name(momentum_rule);
             py::gil_scoped_release release;
             return std::make_unique<Client>(o, names, numels, std::move(store));
           }),
           py::kw_only(), py::arg("worker_index"), py::arg("num_workers"), py::arg("num_servers"),
           py::arg("consistency"), py::arg("staleness_rule"), py::arg("optimizer"),
           py::arg("partition_elems"), py::arg("timeout_s"), py::arg("names"), py::arg("numels"),
           py::arg("store"), py::arg("iface") = "", py::arg("master_addr") = "",
           py::arg("token") = "", py::arg("local_correction") = true,
           py::arg("momentum_rule") = "rescaled")
      .def("shards", [](const Client& c) {
        py::list out;
        for (const auto& s : c.shards())
          out.append(py::make_tuple(s.key, s.tensor, s.begin, s.count, s.server));
        return out;
      })
      .def("initialize",
           [](Client& c, const std::vector<uintptr_t>& initial, const std::vector<OptimizerHyper>& hyper) {
             std::vector<const float*> ptrs;
             for (auto p : initial) ptrs.push_back(as_floats(p));
             py::gil_scoped_release release;
             c.initialize(ptrs, hyper);
           })
      .def("set_hyper", &Client::set_hyper)
      .def("push", [](Client& c, int tensor, uintptr_t grad) { c.push(tensor, as_floats(grad)); },
           py::call_guard<py::gil_scoped_release>())
      .def("push_none", &Client::push_none, py::call_guard<py::gil_scoped_release>())
      .def("pull", &Client::pull, py::arg("tensor"), py::arg("ahead") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("pull_ready", &Client::pull_ready)
      .def("wait_pull",
           [](Client& c, int tensor, uintptr_t dst) {
             return c.wait_pull(tensor, reinterpret_cast<float*>(dst));
           },
           py::call_guard<py::gil_scoped_release>())
      .def("version", &Client::version)
      .def("flush", &Client::flush, py::call_guard<py::gil_scoped_release>())
      .def("snapshot", &Client::snapshot, py::call_guard<py::gil_scoped_release>())
      .def("push_records", &Client::push_records)
      .def("staleness",
           [](const Client& c) {
             const StalenessSummary s = c.staleness();
             py::dict histogram;
             for (const auto& [tau, n] : s.histogram) histogram[py::int_(tau)] = n;
             return py::dict(py::arg("pushes") = s.pushes,
                             py::arg("mean") = s.pushes ? double(s.staleness_sum) / s.pushes : 0.0,
                             py::arg("max") = s.max_staleness, py::arg("histogram") = histogram,
                             py::arg("mean_lr_factor") =
                                 s.pushes ? s.lr_factor_sum / s.pushes : 1.0);
           })
      .def("close", &Client::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace hemiola::python
