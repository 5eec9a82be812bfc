// hemiola._C.Updater (hemiola/updater.h): parameters and optimizer state cross
// as integers (data pointers), hyper-parameters as one _C.optim.Hyper per group. The
// calls that may wait for a reduction or land an update release the GIL: an
// external stepper (a Python callable, PythonStepper below) takes it back on
// the calling thread for each step, and no engine thread ever waits for it.
// mark() keeps it, as Reducer.mark_ready does (it only copies the gradient
// in and never lands).
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "hemiola/engine.h"
#include "hemiola/reducer.h"
#include "hemiola/status.h"
#include "hemiola/updater.h"

namespace py = pybind11;

namespace hemiola::python {

namespace {

void* pointer(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

// (name, param, dtype, numel, group, momentum_buffer, momentum_initialised,
//  exp_avg, exp_avg_sq, max_exp_avg_sq, step)
using Slot = std::tuple<std::string, std::uintptr_t, int, size_t, size_t, std::uintptr_t, bool,
                        std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t>;

std::vector<ParameterSlot> slots_of(const std::vector<Slot>& slots, const Device& device) {
  std::vector<ParameterSlot> out;
  out.reserve(slots.size());
  for (const auto& s : slots) {
    ParameterSlot p;
    p.name = std::get<0>(s);
    p.param.data = pointer(std::get<1>(s));
    p.param.dtype = static_cast<DType>(std::get<2>(s));
    (void)dtype_size(p.param.dtype);  // validates the code
    p.param.numel = std::get<3>(s);
    p.param.device = device;
    p.group = std::get<4>(s);
    p.momentum_buffer = pointer(std::get<5>(s));
    p.momentum_initialised = std::get<6>(s);
    p.exp_avg = pointer(std::get<7>(s));
    p.exp_avg_sq = pointer(std::get<8>(s));
    p.max_exp_avg_sq = pointer(std::get<9>(s));
    p.step = static_cast<float*>(pointer(std::get<10>(s)));
    out.push_back(std::move(p));
  }
  return out;
}

// The steps of an optimizer the engine does not implement, taken by a Python
// callable: step(indices, grads, hyper_key, grad_scale, mode) with the
// gradients as writable memoryviews on the CPU and as data pointers (ints) on
// a GPU, and `mode` ExternalStepper's StepMode as an int. It runs inside an
// Updater call that released the GIL, on the same thread: the GIL is taken
// back for the call. A Python exception propagates out of that Updater call.
class PythonStepper final : public ExternalStepper {
 public:
  explicit PythonStepper(py::object step) : step_(std::move(step)) {}
  // The Updater (and with it this) goes away inside a Python dealloc or
  // constructor, with the GIL held; take it anyway, it is reentrant.
  ~PythonStepper() override {
    py::gil_scoped_acquire gil;
    step_ = py::object();
  }

  void step(const std::vector<size_t>& indices, const std::vector<TensorRef>& grads,
            uint64_t hyper_key, double grad_scale, StepMode mode) override {
    py::gil_scoped_acquire gil;
    py::list views(grads.size());
    for (size_t k = 0; k < grads.size(); ++k) {
      const TensorRef& g = grads[k];
      if (g.device.type == DeviceType::kCPU) {
        views[k] = py::memoryview::from_memory(g.data, static_cast<ssize_t>(g.nbytes()));
      } else {
        views[k] = py::int_(reinterpret_cast<std::uintptr_t>(g.data));
      }
    }
    step_(py::cast(indices), views, hyper_key, grad_scale, static_cast<int>(mode));
  }

 private:
  py::object step_;
};

// UpdaterOptions::clip_norm from a Python callable norm(indices, grads,
// norm_type) -> float, the gradients as memoryviews (CPU only). Called inside
// an Updater call that released the GIL, on the same thread; the callable
// goes with the GIL held (as PythonStepper's).
class PythonNorm {
 public:
  explicit PythonNorm(py::object norm) : norm_(std::move(norm)) {}
  ~PythonNorm() {
    py::gil_scoped_acquire gil;
    norm_ = py::object();
  }

  double operator()(const std::vector<size_t>& indices, const std::vector<TensorRef>& grads,
                    double norm_type) const {
    py::gil_scoped_acquire gil;
    py::list views(grads.size());
    for (size_t k = 0; k < grads.size(); ++k) {
      views[k] = py::memoryview::from_memory(grads[k].data,
                                             static_cast<ssize_t>(grads[k].nbytes()));
    }
    return norm_(py::cast(indices), views, norm_type).cast<double>();
  }

 private:
  py::object norm_;
};

StepOptions step_options(const std::vector<OptimizerHyper>& hyper, uint64_t hyper_key,
                         bool has_unused,
                         double clip_max_norm, double clip_norm_type, bool skip_if_not_finite,
                         bool local_overflow, double preview_scale = 1.0) {
  StepOptions o;
  o.hyper = hyper;
  o.hyper_key = hyper_key;
  o.has_unused = has_unused;
  o.clip_max_norm = clip_max_norm;
  o.clip_norm_type = clip_norm_type;
  o.skip_if_not_finite = skip_if_not_finite;
  o.local_overflow = local_overflow;
  o.preview_scale = preview_scale;
  return o;
}

}  // namespace

void bind_updater(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<Updater>(m, "Updater",
                      "The landing graph and optimizer steps of priority / decoupled; see "
                      "hemiola/updater.h.")
      .def(py::init([](Engine& engine, Reducer& reducer, const std::vector<Slot>& slots,
                       const std::string& schedule, const std::string& optimizer,
                       bool correct_on_arrival, double priority_front_fraction,
                       bool rebuild_buckets, bool raise_if_not_finite, std::uintptr_t stream,
                       std::uintptr_t sqrt_f32, std::uintptr_t sqrt_f64, py::object external,
                       bool multi_tensor_steps, bool device_clip_norms, py::object clip_norm) {
             UpdaterOptions o;
             if (schedule == "priority") {
               o.schedule = UpdateSchedule::kPriority;
             } else if (schedule == "decoupled") {
               o.schedule = UpdateSchedule::kDecoupled;
             } else {
               throw Error(ErrorCode::kInvalidArgument, "unknown schedule '" + schedule + "'");
             }
             if (external.is_none()) {
               o.optimizer = optimizer_kind(optimizer);
             } else {
               o.external = std::make_shared<PythonStepper>(std::move(external));
             }
             o.correct_on_arrival = correct_on_arrival;
             o.priority_front_fraction = priority_front_fraction;
             o.rebuild_buckets = rebuild_buckets;
             o.raise_if_not_finite = raise_if_not_finite;
             o.sqrt = vector_sqrt(sqrt_f32, sqrt_f64);
             o.multi_tensor_steps = multi_tensor_steps;
             o.device_clip_norms = device_clip_norms;
             if (!clip_norm.is_none()) {
               auto norm = std::make_shared<PythonNorm>(std::move(clip_norm));
               o.clip_norm = [norm](const std::vector<size_t>& indices,
                                    const std::vector<TensorRef>& grads, double norm_type) {
                 return (*norm)(indices, grads, norm_type);
               };
             }
             auto params = slots_of(slots, reducer.options().device);
             // The constructor copies the decoupled shadow (waits on a GPU).
             py::gil_scoped_release release;
             return std::make_unique<Updater>(engine, reducer, std::move(params), o,
                                              StreamRef{pointer(stream)});
           }),
           py::arg("engine"), py::arg("reducer"), py::arg("slots"), py::arg("schedule"),
           py::arg("optimizer"), py::arg("correct_on_arrival") = true,
           py::arg("priority_front_fraction") = 0.25, py::arg("rebuild_buckets") = true,
           py::arg("raise_if_not_finite") = false, py::arg("stream") = 0,
           py::arg("sqrt_f32") = 0, py::arg("sqrt_f64") = 0, py::arg("external") = py::none(),
           py::arg("multi_tensor_steps") = false, py::arg("device_clip_norms") = false,
           py::arg("clip_norm") = py::none(),
           py::keep_alive<1, 2>(),
           py::keep_alive<1, 3>())
      .def("set_gates", &Updater::set_gates, py::arg("gates"))
      .def(
          "set_local_grad",
          [](Updater& u, size_t index, std::uintptr_t local_grad) {
            u.set_local_grad(index, pointer(local_grad));
          },
          py::arg("index"), py::arg("local_grad"))
      .def(
          "step",
          [](Updater& u, uint64_t iteration, const std::vector<OptimizerHyper>& hyper, bool has_unused,
             double clip_max_norm, double clip_norm_type, bool skip_if_not_finite,
             bool local_overflow, std::uintptr_t stream, double preview_scale,
             uint64_t hyper_key) {
            const StepOptions o =
                step_options(hyper, hyper_key, has_unused, clip_max_norm, clip_norm_type,
                             skip_if_not_finite, local_overflow, preview_scale);
            py::gil_scoped_release release;
            u.step(iteration, o, StreamRef{pointer(stream)});
          },
          py::arg("iteration"), py::arg("hyper"), py::arg("has_unused") = false,
          py::arg("clip_max_norm") = -1.0, py::arg("clip_norm_type") = 2.0,
          py::arg("skip_if_not_finite") = false, py::arg("local_overflow") = false,
          py::arg("stream") = 0, py::arg("preview_scale") = 1.0, py::arg("hyper_key") = 0)
      .def(
          "step_local",
          [](Updater& u, const std::vector<std::uintptr_t>& grads,
             const std::vector<OptimizerHyper>& hyper, std::uintptr_t stream, uint64_t hyper_key) {
            std::vector<void*> pointers;
            for (auto g : grads) pointers.push_back(pointer(g));
            const StepOptions o = step_options(hyper, hyper_key, false, -1.0, 2.0, false, false);
            py::gil_scoped_release release;
            u.step_local(pointers, o, StreamRef{pointer(stream)});
          },
          py::arg("grads"), py::arg("hyper"), py::arg("stream") = 0, py::arg("hyper_key") = 0)
      .def(
          "land",
          [](Updater& u, size_t gate, bool training, std::uintptr_t stream) {
            u.land(gate, training, StreamRef{pointer(stream)});
          },
          py::arg("gate"), py::arg("training"), py::arg("stream") = 0, Release())
      .def(
          "synchronize",
          [](Updater& u, std::uintptr_t stream) { u.synchronize(StreamRef{pointer(stream)}); },
          py::arg("stream") = 0, Release())
      .def(
          "replace_parameters",
          [](Updater& u, const std::vector<Slot>& slots, std::uintptr_t stream) {
            u.replace_parameters(slots_of(slots, u.device()), StreamRef{pointer(stream)});
          },
          py::arg("slots"), py::arg("stream") = 0, Release())
      .def("momentum_initialised", &Updater::momentum_initialised)
      .def("approximate_read_fraction", &Updater::approximate_read_fraction)
      .def("clip_norm", &Updater::clip_norm, py::arg("iteration"),
           "The total norm the clipped update of `iteration` used, once computed (else None).")
      .def(
          "averaged_ptr",
          [](const Updater& u, uint64_t iteration, size_t index) {
            return reinterpret_cast<std::uintptr_t>(u.averaged(iteration, index).data);
          },
          py::arg("iteration"), py::arg("index"),
          "Address of parameter `index`'s averaged gradient of `iteration` (host or device "
          "memory, the parameter's dtype and size), after the reducer waited for it and before "
          "step(iteration); partitioned parameters included.")
      .def("preview_read_fraction", &Updater::preview_read_fraction);
}

}  // namespace hemiola::python
