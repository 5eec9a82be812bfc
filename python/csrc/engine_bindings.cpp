// Bindings for Store, Engine, Handle and Reducer. Tensors cross as integers:
// (data pointer, dtype code, element count). Calls that block release the GIL;
// the hook path (mark_ready) keeps it, since it is short.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <chrono>

#include "bindings.h"
#include "hemiola/hemiola.h"

namespace py = pybind11;

namespace hemiola::python {

namespace {

// Lets Python implement a Store (hemiola wraps torch.distributed's store this
// way). Called from the thread that constructs an engine or waits on a failed
// handle, never from an engine thread.
class PyStore : public Store, public py::trampoline_self_life_support {
 public:
  void set(const std::string& key, const std::string& value) override {
    py::gil_scoped_acquire gil;
    py::function fn = py::get_override(static_cast<const Store*>(this), "set");
    if (!fn) throw Error(ErrorCode::kInternal, "Store.set is not implemented");
    fn(key, py::bytes(value));
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    py::function fn = py::get_override(static_cast<const Store*>(this), "get");
    if (!fn) throw Error(ErrorCode::kInternal, "Store.get is not implemented");
    try {
      py::object value = fn(key, static_cast<double>(timeout.count()) / 1000.0);
      return value.cast<std::string>();
    } catch (py::error_already_set& e) {
      if (e.matches(PyExc_TimeoutError)) {
        throw Error(ErrorCode::kTimeout, "store key '" + key + "' was not set in time: " + e.what());
      }
      throw;
    }
  }
  bool check(const std::string& key) override {
    py::gil_scoped_acquire gil;
    py::function fn = py::get_override(static_cast<const Store*>(this), "check");
    if (!fn) throw Error(ErrorCode::kInternal, "Store.check is not implemented");
    return fn(key).cast<bool>();
  }
};

TensorRef make_ref(uintptr_t data, int dtype, size_t numel) {
  TensorRef ref;
  ref.data = reinterpret_cast<void*>(data);
  ref.dtype = static_cast<DType>(dtype);
  ref.numel = numel;
  (void)dtype_size(ref.dtype);  // validates the code
  return ref;
}

}  // namespace

void bind_engine(py::module_& m) {
  m.def(
      "chunk_bounds",
      [](size_t numel, int dtype, int world_size) {
        return chunk_bounds(numel, static_cast<DType>(dtype), world_size);
      },
      py::arg("numel"), py::arg("dtype"), py::arg("world_size"),
      "world_size + 1 element offsets: rank r's chunk under Engine.reduce_scatter and "
      "Engine.all_gather_chunks is [bounds[r], bounds[r + 1]).");
  m.def("coded_chunk_bounds", &coded_chunk_bounds, py::arg("numel"), py::arg("world_size"),
        "world_size + 1 element offsets: rank r's chunk under "
        "Engine.reduce_scatter_coded (whole blocks of the int8/int4 codings).");
  m.def(
      "plan_fusion",
      [](const std::vector<std::pair<int, size_t>>& specs, const std::vector<size_t>& order,
         size_t first_bucket_bytes, size_t fusion_bytes) {
        std::vector<GradSpec> grad_specs;
        for (const auto& [dtype, numel] : specs) {
          grad_specs.push_back({static_cast<DType>(dtype), numel, "", 0});
        }
        py::list out;
        for (const FusedBucket& b : plan_fusion(grad_specs, order, first_bucket_bytes,
                                                fusion_bytes)) {
          out.append(py::make_tuple(static_cast<int>(b.dtype), b.tensors, b.offsets, b.numel));
        }
        return out;
      },
      py::arg("specs"), py::arg("order"), py::arg("first_bucket_bytes"), py::arg("fusion_bytes"),
      "The reducer's fusion plan for (dtype, numel) specs ready in `order`: a list of "
      "(dtype, tensors, offsets, numel) per bucket, in plan order.");
  // The codings' names and codes, and where each runs, from the engine's one
  // table (hemiola/config.h: codings()): hemiola.config and the wrap's
  // refusals ask these rather than keep lists of their own.
  m.def(
      "compressions",
      [] {
        py::dict out;
        for (const Coding& coding : codings()) {
          out[coding.name] = static_cast<int>(coding.compression);
        }
        return out;
      },
      "Every coding's engine code by its Config.compression name ('none': 0).");
  m.def(
      "codings",
      [](const std::string& device_type) {
        HEMIOLA_CHECK(device_type == "cpu" || device_type == "cuda",
                      "codings() takes 'cpu' or 'cuda', got '", device_type, "'");
        std::vector<std::string> names;
        for (const Coding& coding : codings()) {
          if (device_type == "cuda" ? coding.cuda : coding.host) names.push_back(coding.name);
        }
        return names;
      },
      py::arg("device_type"),
      "The Config.compression names a model on that device type ('cpu' or 'cuda') can use, "
      "'none' included, in code order.");
  m.def(
      "coding_table",
      [] {
        py::list out;
        for (const Coding& coding : codings()) {
          py::dict row;
          row["name"] = coding.name;
          row["code"] = static_cast<int>(coding.compression);
          row["host"] = coding.host;
          row["cuda"] = coding.cuda;
          row["streams"] = coding.streams;
          row["residuals"] = coding.residuals;
          out.append(row);
        }
        return out;
      },
      "Every fact about every coding, in code order: name, code, host, cuda (where it runs), "
      "streams (streaming may send with it), residuals (it keeps error feedback).");
  py::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("float64", DType::kFloat64)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("uint8", DType::kUInt8);

  py::enum_<ReduceOp>(m, "ReduceOp").value("sum", ReduceOp::kSum).value("average", ReduceOp::kAverage);

  py::class_<Store, PyStore, py::smart_holder>(m, "Store",
                                               "Rendezvous key-value store; subclass it in Python "
                                               "by implementing set(key, bytes), get(key, "
                                               "timeout_s) -> bytes and check(key) -> bool.")
      .def(py::init<>())
      .def("set", [](Store& s, const std::string& k, const py::bytes& v) { s.set(k, v); })
      .def("get",
           [](Store& s, const std::string& k, double timeout_s) {
             std::string v;
             {
               py::gil_scoped_release release;
               v = s.get(k, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
             }
             return py::bytes(v);
           })
      .def("check", &Store::check);
  py::class_<FileStore, Store, py::smart_holder>(m, "FileStore")
      .def(py::init<std::string>(), py::arg("directory"));
  py::class_<MemoryStore, Store, py::smart_holder>(m, "MemoryStore").def(py::init<>());
  py::class_<PrefixStore, Store, py::smart_holder>(m, "PrefixStore")
      .def(py::init<std::string, std::shared_ptr<Store>>(), py::arg("prefix"), py::arg("base"));

  py::class_<Handle>(m, "Handle", "Completion of an asynchronous engine operation.")
      .def("wait", &Handle::wait, py::call_guard<py::gil_scoped_release>(),
           "Block until done; raise the operation's error, if any.")
      .def("done", &Handle::done)
      .def(
          "wait_for",
          [](const Handle& h, double seconds) {
            return h.wait_for(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
          },
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("description", &Handle::description);

  py::class_<Reducer>(m, "Reducer", "Gradient reducer; see hemiola/reducer.h.")
      .def(
          "residual_view",
          [](Reducer& r, size_t index) {
            TensorRef ref;
            {
              py::gil_scoped_release release;  // waits for the reductions in flight
              ref = r.residual(index);
            }
            return py::memoryview::from_memory(ref.data, static_cast<ssize_t>(ref.nbytes()));
          },
          py::arg("index"),
          "compression='int8' or 'powersgd': writable memoryview (float32) of gradient "
          "`index`'s error-feedback residual (no copy; between iterations only).")
      .def(
          "set_compression",
          [](Reducer& r, int code, size_t powersgd_rank, uint64_t powersgd_start_iteration) {
            r.set_compression(compression_of(code), powersgd_rank,
                              powersgd_start_iteration);
          },
          py::arg("code"), py::arg("powersgd_rank") = 2, py::arg("powersgd_start_iteration") = 10,
          "Before the first iteration: a code of compressions().")
      .def("preview_error", &Reducer::preview_error,
           "sqrt(sum |estimate - average|^2 / sum |average|^2) over every preview so far.")
      .def(
          "mark_ready",
          [](Reducer& r, size_t index, uintptr_t data, uintptr_t stream) {
            r.mark_ready(index, reinterpret_cast<void*>(data), StreamRef{reinterpret_cast<void*>(stream)});
          },
          py::arg("index"), py::arg("data_ptr"), py::arg("stream") = 0,
          "Reduce in place: the result goes back to data. `stream`: on a CUDA reducer, the "
          "stream that produced the gradient (torch.cuda.current_stream().cuda_stream).")
      .def(
          "mark_ready_to",
          [](Reducer& r, size_t index, uintptr_t source, uintptr_t out, uintptr_t stream) {
            r.mark_ready(index, reinterpret_cast<const void*>(source),
                         reinterpret_cast<void*>(out), StreamRef{reinterpret_cast<void*>(stream)});
          },
          py::arg("index"), py::arg("source_ptr"), py::arg("out_ptr"), py::arg("stream") = 0,
          "Copy source in; the result goes to out (0: keep it only in the reducer).")
      .def(
          "mark",
          [](Reducer& r, size_t index, uintptr_t source, uintptr_t local, uintptr_t stream) {
            r.mark(index, reinterpret_cast<const void*>(source),
                   reinterpret_cast<const void*>(local), StreamRef{reinterpret_cast<void*>(stream)});
          },
          py::arg("index"), py::arg("source_ptr"), py::arg("local_ptr"), py::arg("stream") = 0,
          "For a reducer an Updater lands: copy source in; the updater, which observes the "
          "marks, decides where the result goes and reads local (this rank's own gradient).")
      .def(
          "mark_unused",
          [](Reducer& r, size_t index, uintptr_t stream) {
            r.mark_unused(index, StreamRef{reinterpret_cast<void*>(stream)});
          },
          py::arg("index"), py::arg("stream") = 0)
      .def("unmarked", &Reducer::unmarked)
      .def_property_readonly("marking", &Reducer::marking)
      .def("finish_marking", &Reducer::finish_marking)
      .def(
          "wait",
          [](Reducer& r, uint64_t iteration, uintptr_t stream) {
            r.wait(iteration, StreamRef{reinterpret_cast<void*>(stream)});
          },
          py::arg("iteration"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
          "Wait for `iteration`'s results. CUDA: returns once they are enqueued and makes "
          "`stream` wait for them on the device.")
      .def(
          "wait_all", [](Reducer& r, uintptr_t stream) { r.wait(StreamRef{reinterpret_cast<void*>(stream)}); },
          py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "wait_for",
          [](Reducer& r, uint64_t iteration, const std::vector<size_t>& indices,
             uintptr_t stream) {
            r.wait_for(iteration, indices, StreamRef{reinterpret_cast<void*>(stream)});
          },
          py::arg("iteration"), py::arg("indices"), py::arg("stream") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "Wait until gradients `indices` of `iteration` are reduced (their buckets, in issue "
          "order). CUDA: makes `stream` wait for them on the device.")
      .def("arrived", &Reducer::arrived, py::arg("iteration"), py::arg("indices"),
           "Those of `indices` whose reduced gradient of `iteration` is ready (never blocks).")
      .def("set_issue_order", &Reducer::set_issue_order, py::arg("order"),
           py::call_guard<py::gil_scoped_release>())
      .def("issue_order", &Reducer::issue_order)
      .def("abort", &Reducer::abort)
      .def(
          "result_view",
          [](const Reducer& r, uint64_t iteration, size_t index) {
            const TensorRef ref = r.result(iteration, index);
            HEMIOLA_CHECK(ref.device.type == DeviceType::kCPU,
                          "result_view is for CPU reducers; use result_ptr on CUDA");
            return py::memoryview::from_memory(ref.data, static_cast<ssize_t>(ref.nbytes()));
          },
          py::arg("iteration"), py::arg("index"),
          "Writable memoryview of the reduced gradient inside the reducer (no copy).")
      .def(
          "result_ptr",
          [](const Reducer& r, uint64_t iteration, size_t index) {
            return reinterpret_cast<uintptr_t>(r.result(iteration, index).data);
          },
          py::arg("iteration"), py::arg("index"),
          "Address of the reduced gradient inside the reducer (device memory on CUDA).")
      .def("usage", &Reducer::usage, py::arg("iteration"))
      .def("buckets", &Reducer::buckets)
      .def("observed_order", &Reducer::observed_order)
      .def("rebuild_from_observed_order", &Reducer::rebuild_from_observed_order,
           py::call_guard<py::gil_scoped_release>())
      .def("rebuild", &Reducer::rebuild, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("iterations_started", &Reducer::iterations_started);

  py::class_<Engine>(m, "Engine", "One group of ranks: communicator, scheduler thread, buffers.")
      .def(py::init([](int rank, int world_size, std::shared_ptr<Store> store,
                       const std::string& iface, const std::string& hostname,
                       const std::string& master_addr, double timeout_s, bool timeline,
                       const std::string& gpu_backend, size_t staged_chunk_bytes,
                       int gloo_stripes, bool diagnose_failures) {
             EngineOptions options;
             options.rank = rank;
             options.world_size = world_size;
             options.iface = iface;
             options.hostname = hostname;
             options.master_addr = master_addr;
             options.timeout_s = timeout_s;
             options.timeline = timeline;
             options.gpu_backend = gpu_backend;
             options.staged_chunk_bytes = staged_chunk_bytes;
             options.gloo_stripes = gloo_stripes;
             options.diagnose_failures = diagnose_failures;
             py::gil_scoped_release release;  // rendezvous blocks; the store re-acquires
             return std::make_unique<Engine>(options, std::move(store));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("store"), py::arg("iface") = "",
           py::arg("hostname") = "", py::arg("master_addr") = "", py::arg("timeout_s") = 300.0,
           py::arg("timeline") = false, py::arg("gpu_backend") = "auto",
           py::arg("staged_chunk_bytes") = 0, py::arg("gloo_stripes") = 1,
           py::arg("diagnose_failures") = true)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::world_size)
      .def_property_readonly("transport", &Engine::transport,
                             "The main wire's transport, e.g. 'gloo/tcp 10.0.0.1 (2 stripes)'.")
      .def(
          "all_reduce",
          [](Engine& e, uintptr_t data, int dtype, size_t numel, ReduceOp op) {
            return e.all_reduce(make_ref(data, dtype, numel), op);
          },
          py::arg("data_ptr"), py::arg("dtype"), py::arg("numel"), py::arg("op") = ReduceOp::kSum)
      .def(
          "broadcast",
          [](Engine& e, uintptr_t data, int dtype, size_t numel, int root) {
            return e.broadcast(make_ref(data, dtype, numel), root);
          },
          py::arg("data_ptr"), py::arg("dtype"), py::arg("numel"), py::arg("root") = 0)
      .def(
          "all_gather",
          [](Engine& e, uintptr_t in, uintptr_t out, int dtype, size_t numel) {
            const size_t world = static_cast<size_t>(e.world_size());
            return e.all_gather(make_ref(in, dtype, numel), make_ref(out, dtype, numel * world));
          },
          py::arg("input_ptr"), py::arg("output_ptr"), py::arg("dtype"), py::arg("numel"))
      .def("barrier", &Engine::barrier)
      .def(
          "reduce_scatter",
          [](Engine& e, uintptr_t data, int dtype, size_t numel, ReduceOp op) {
            return e.reduce_scatter(make_ref(data, dtype, numel), op);
          },
          py::arg("data_ptr"), py::arg("dtype"), py::arg("numel"),
          py::arg("op") = ReduceOp::kAverage)
      .def(
          "reduce_scatter_coded",
          [](Engine& e, uintptr_t data, uintptr_t residual, size_t numel, int coding) {
            return e.reduce_scatter_coded(make_ref(data, static_cast<int>(DType::kFloat32), numel),
                                          make_ref(residual, static_cast<int>(DType::kFloat32),
                                                   numel),
                                          static_cast<Compression>(coding));
          },
          py::arg("data_ptr"), py::arg("residual_ptr"), py::arg("numel"), py::arg("coding"),
          "An int8/int4 reduce-scatter (average) of a float32 bucket with error feedback in "
          "`residual` (as many float32 elements); this rank's chunk "
          "(coded_chunk_bounds) receives the average.")
      .def(
          "all_gather_chunks",
          [](Engine& e, uintptr_t data, int dtype, size_t numel, std::vector<size_t> bounds) {
            return e.all_gather_chunks(make_ref(data, dtype, numel), std::move(bounds));
          },
          py::arg("data_ptr"), py::arg("dtype"), py::arg("numel"),
          py::arg("bounds") = std::vector<size_t>{})
      .def(
          "all_gather_segments",
          [](Engine& e, const std::vector<uintptr_t>& data, const std::vector<size_t>& numels,
             int dtype, std::vector<size_t> bounds) {
            HEMIOLA_CHECK(data.size() == numels.size(), "all_gather_segments: ", data.size(),
                          " pointers and ", numels.size(), " sizes");
            std::vector<TensorRef> segments;
            for (size_t i = 0; i < data.size(); ++i) {
              segments.push_back(make_ref(data[i], dtype, numels[i]));
            }
            return e.all_gather_chunks(std::move(segments), std::move(bounds));
          },
          py::arg("data_ptrs"), py::arg("numels"), py::arg("dtype"),
          py::arg("bounds") = std::vector<size_t>{},
          "all_gather_chunks over the concatenation of the segments (each a data pointer with "
          "its element count, one dtype), each written where it lies.")
      .def(
          "make_reducer",
          [](py::handle self, const std::vector<py::tuple>& specs,
             size_t fusion_bytes, size_t first_bucket_bytes, bool average, bool track_usage,
             bool record_order, size_t in_flight, size_t partition_bytes, int device, bool preview,
             int compression, size_t powersgd_rank, uint64_t powersgd_start_iteration) {
            std::vector<GradSpec> grad_specs;
            // (dtype, numel, name[, rows]): rows is the first dimension of a
            // matrix gradient (PowerSGD's view), 0 otherwise.
            for (const py::tuple& spec : specs) {
              HEMIOLA_CHECK(spec.size() == 3 || spec.size() == 4,
                            "a gradient spec is (dtype, numel, name[, rows])");
              grad_specs.push_back({static_cast<DType>(spec[0].cast<int>()),
                                    spec[1].cast<size_t>(), spec[2].cast<std::string>(),
                                    spec.size() == 4 ? spec[3].cast<size_t>() : 0});
            }
            ReducerOptions options;
            options.fusion_bytes = fusion_bytes;
            options.first_bucket_bytes = first_bucket_bytes;
            options.average = average;
            options.track_usage = track_usage;
            options.record_order = record_order;
            options.in_flight = in_flight;
            options.partition_bytes = partition_bytes;
            options.preview = preview;
            options.compression = compression_of(compression);
            options.powersgd_rank = powersgd_rank;
            options.powersgd_start_iteration = powersgd_start_iteration;
            if (device >= 0) options.device = Device{DeviceType::kCUDA, device};
            Engine& e = self.cast<Engine&>();
            std::unique_ptr<Reducer> reducer;
            {
              // A CUDA reducer waits for the scheduler thread to create its
              // communicator, which reads the (possibly Python) store: the GIL
              // must be free.
              py::gil_scoped_release release;
              reducer = e.make_reducer(grad_specs, options);
            }
            return keeping_alive(std::move(reducer), self);  // the reducer uses the engine
          },
          py::arg("specs"), py::arg("fusion_bytes"), py::arg("first_bucket_bytes"),
          py::arg("average") = true, py::arg("track_usage") = false,
          py::arg("record_order") = true, py::arg("in_flight") = 0,
          py::arg("partition_bytes") = 0, py::arg("device") = -1, py::arg("preview") = false,
          py::arg("compression") = 0, py::arg("powersgd_rank") = 2,
          py::arg("powersgd_start_iteration") = 10)
      .def("timeline_json", &Engine::timeline_json)
      .def_property_readonly("timeline_enabled",
                             [](const Engine& e) { return e.options().timeline; })
      .def("timeline_now_us", &Engine::timeline_now_us)
      .def("timeline_record", &Engine::timeline_record, py::arg("lane"), py::arg("name"),
           py::arg("category"), py::arg("start_us"), py::arg("end_us"));
}

}  // namespace hemiola::python
