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

  optim.def(
      "sgd_step",
      [](std::uintptr_t param, std::uintptr_t shadow, std::uintptr_t momentum_buffer,
         std::uintptr_t grad, std::int64_t numel, int dtype, int device, double lr,
         double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
         bool first_step, bool commit, std::uintptr_t stream) {
        SgdHyper hyper;
        hyper.lr = lr;
        hyper.momentum = momentum;
        hyper.dampening = dampening;
        hyper.weight_decay = weight_decay;
        hyper.nesterov = nesterov;
        hyper.maximize = maximize;
        hyper.first_step = first_step;
        sgd_step(SgdTensors{pointer(param), pointer(shadow), pointer(momentum_buffer),
                            pointer(grad)},
                 numel, dtype_of(dtype), device_of(device), hyper, commit,
                 StreamRef{pointer(stream)});
      },
      py::arg("param"), py::arg("shadow"), py::arg("momentum_buffer"), py::arg("grad"),
      py::arg("numel"), py::arg("dtype"), py::arg("device"), py::arg("lr"),
      py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
      py::arg("maximize"), py::arg("first_step"), py::arg("commit"), py::arg("stream") = 0,
      Release(),
      "One torch.optim.SGD step over one tensor (see hemiola/optimizer.h).");

  optim.def(
      "adam_step",
      [](std::uintptr_t param, std::uintptr_t shadow, std::uintptr_t exp_avg,
         std::uintptr_t exp_avg_sq, std::uintptr_t max_exp_avg_sq, std::uintptr_t grad,
         std::int64_t numel, int dtype, int device, double lr, double beta1, double beta2,
         double eps, double weight_decay, bool decoupled_weight_decay, bool maximize,
         bool amsgrad, std::int64_t step, bool commit, std::uintptr_t stream,
         std::uintptr_t sqrt_f32, std::uintptr_t sqrt_f64) {
        AdamHyper hyper;
        hyper.lr = lr;
        hyper.beta1 = beta1;
        hyper.beta2 = beta2;
        hyper.eps = eps;
        hyper.weight_decay = weight_decay;
        hyper.decoupled_weight_decay = decoupled_weight_decay;
        hyper.maximize = maximize;
        hyper.amsgrad = amsgrad;
        hyper.step = step;
        hyper.sqrt = vector_sqrt(sqrt_f32, sqrt_f64);
        adam_step(AdamTensors{pointer(param), pointer(shadow), pointer(exp_avg),
                              pointer(exp_avg_sq), pointer(grad), pointer(max_exp_avg_sq)},
                  numel, dtype_of(dtype), device_of(device), hyper, commit,
                  StreamRef{pointer(stream)});
      },
      py::arg("param"), py::arg("shadow"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("max_exp_avg_sq"), py::arg("grad"), py::arg("numel"), py::arg("dtype"),
      py::arg("device"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("decoupled_weight_decay"), py::arg("maximize"),
      py::arg("amsgrad"), py::arg("step"), py::arg("commit"), py::arg("stream") = 0,
      py::arg("sqrt_f32") = 0, py::arg("sqrt_f64") = 0, Release(),
      "One torch.optim.Adam / AdamW step over one tensor (see hemiola/optimizer.h).");
}

}  // namespace hemiola::python
