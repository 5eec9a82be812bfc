// hemiola._C.optim: the engine's optimizer step (hemiola/optimizer.h) over raw
// tensors: data pointers as integers, dtype codes, a device index (-1: the CPU)
// and, on a GPU, the stream handle torch gives. The GIL is released around
// each step (a CPU step over a large tensor takes a while).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "hemiola/optimizer.h"

namespace py = pybind11;

namespace hemiola::python {

namespace {

void* pointer(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

DType dtype_of(int code) {
  const auto dtype = static_cast<DType>(code);
  (void)dtype_size(dtype);  // validates the code
  return dtype;
}

Device device_of(int index) {
  return index < 0 ? Device{} : Device{DeviceType::kCUDA, index};
}

}  // namespace

void bind_optim(py::module_& m) {
  py::module_ optim = m.def_submodule("optim", "the engine's optimizer steps (raw pointers)");
  using Release = py::call_guard<py::gil_scoped_release>;

  py::class_<OptimizerHyper>(optim, "Hyper",
                             "One parameter group's hyper-parameters, with torch.optim's names "
                             "(hemiola/optimizer.h's OptimizerHyper): what the Updater, the "
                             "parameter server and the steps below read.")
      .def(py::init([](double lr, double momentum, double dampening, double weight_decay,
                       bool nesterov, bool maximize, double beta1, double beta2, double eps,
                       bool amsgrad) {
             return OptimizerHyper{lr,       momentum, dampening, weight_decay, nesterov,
                                   maximize, beta1,    beta2,     eps,          amsgrad};
           }),
           py::kw_only(), py::arg("lr"), py::arg("momentum") = 0.0, py::arg("dampening") = 0.0,
           py::arg("weight_decay") = 0.0, py::arg("nesterov") = false,
           py::arg("maximize") = false, py::arg("beta1") = 0.9, py::arg("beta2") = 0.999,
           py::arg("eps") = 1e-8, py::arg("amsgrad") = false)
      .def_readonly("lr", &OptimizerHyper::lr)
      .def_readonly("momentum", &OptimizerHyper::momentum)
      .def_readonly("dampening", &OptimizerHyper::dampening)
      .def_readonly("weight_decay", &OptimizerHyper::weight_decay)
      .def_readonly("nesterov", &OptimizerHyper::nesterov)
      .def_readonly("maximize", &OptimizerHyper::maximize)
      .def_readonly("beta1", &OptimizerHyper::beta1)
      .def_readonly("beta2", &OptimizerHyper::beta2)
      .def_readonly("eps", &OptimizerHyper::eps)
      .def_readonly("amsgrad", &OptimizerHyper::amsgrad)
      .def("__eq__", [](const OptimizerHyper& a, const OptimizerHyper& b) { return a == b; })
      .def("__repr__", [](const OptimizerHyper& h) {
        return py::str("Hyper(lr={}, momentum={}, dampening={}, weight_decay={}, nesterov={}, "
                       "maximize={}, beta1={}, beta2={}, eps={}, amsgrad={})")
            .format(h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov, h.maximize,
                    h.beta1, h.beta2, h.eps, h.amsgrad);
      });

  optim.def(
      "sgd_step",
      [](std::uintptr_t param, std::uintptr_t shadow, std::uintptr_t momentum_buffer,
         std::uintptr_t grad, std::int64_t numel, int dtype, int device,
         const OptimizerHyper& group, bool first_step, bool commit, double grad_scale,
         std::uintptr_t stream) {
        SgdHyper hyper{group};
        hyper.first_step = first_step;
        hyper.grad_scale = grad_scale;
        sgd_step(SgdTensors{pointer(param), pointer(shadow), pointer(momentum_buffer),
                            pointer(grad)},
                 numel, dtype_of(dtype), device_of(device), hyper, commit,
                 StreamRef{pointer(stream)});
      },
      py::arg("param"), py::arg("shadow"), py::arg("momentum_buffer"), py::arg("grad"),
      py::arg("numel"), py::arg("dtype"), py::arg("device"), py::arg("hyper"), py::kw_only(),
      py::arg("first_step"), py::arg("commit"), py::arg("grad_scale") = 1.0,
      py::arg("stream") = 0, Release(),
      "One torch.optim.SGD step over one tensor (see hemiola/optimizer.h). `device` is a CUDA "
      "device index, -1 for the CPU; on a GPU the step is enqueued on `stream`.");

  optim.def(
      "adam_step",
      [](std::uintptr_t param, std::uintptr_t shadow, std::uintptr_t exp_avg,
         std::uintptr_t exp_avg_sq, std::uintptr_t max_exp_avg_sq, std::uintptr_t grad,
         std::int64_t numel, int dtype, int device, const OptimizerHyper& group,
         bool decoupled_weight_decay, std::int64_t step, bool commit, double grad_scale,
         std::uintptr_t stream, std::uintptr_t sqrt_f32, std::uintptr_t sqrt_f64) {
        AdamHyper hyper{group};
        hyper.decoupled_weight_decay = decoupled_weight_decay;
        hyper.step = step;
        hyper.grad_scale = grad_scale;
        hyper.sqrt = vector_sqrt(sqrt_f32, sqrt_f64);
        adam_step(AdamTensors{pointer(param), pointer(shadow), pointer(exp_avg),
                              pointer(exp_avg_sq), pointer(grad), pointer(max_exp_avg_sq)},
                  numel, dtype_of(dtype), device_of(device), hyper, commit,
                  StreamRef{pointer(stream)});
      },
      py::arg("param"), py::arg("shadow"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("max_exp_avg_sq"), py::arg("grad"), py::arg("numel"), py::arg("dtype"),
      py::arg("device"), py::arg("hyper"), py::kw_only(), py::arg("decoupled_weight_decay"),
      py::arg("step"), py::arg("commit"), py::arg("grad_scale") = 1.0, py::arg("stream") = 0,
      py::arg("sqrt_f32") = 0, py::arg("sqrt_f64") = 0, Release(),
      "One torch.optim.Adam / AdamW step over one tensor (see hemiola/optimizer.h); "
      "`device` and `stream` as sgd_step's.");
}

}  // namespace hemiola::python
