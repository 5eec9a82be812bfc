// hemiola._C.cuda: the fusion and wire kernels (engine/buckets/unpack_kernel.h,
// engine/codec/cast_kernels.h), compiled in only when the build has CUDA (the
// optimizer steps are _C.optim's, with a device index). Like the engine
// bindings, tensors cross as integers (device pointers, element counts, dtype
// codes) and streams as the integer handle torch gives
// (torch.cuda.current_stream().cuda_stream; 0 = legacy default stream). Every call only enqueues work; the GIL is released around
// it because the first CUDA call of a process may initialise a context.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "bindings.h"
#include "engine/buckets/unpack_kernel.h"
#include "engine/codec/cast_kernels.h"

namespace py = pybind11;

namespace hemiola::python {

namespace {

template <typename T>
T* pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

DType dtype_of(int code) {
  const auto dtype = static_cast<DType>(code);
  (void)dtype_size(dtype);  // validates the code
  return dtype;
}

}  // namespace

void bind_cuda(py::module_& m) {
  py::module_ cuda = m.def_submodule("cuda", "CUDA kernels of the engine (raw pointers)");
  using Release = py::call_guard<py::gil_scoped_release>;

  cuda.attr("FUSION_SLOT_BYTES") = sizeof(cuda::FusionSlot);

  cuda.def(
      "unpack",
      [](std::uintptr_t slots, std::int64_t slot_count, std::int64_t extent, int dtype,
         std::uintptr_t buffer, double scale, std::uintptr_t stream) {
        cuda::unpack(pointer<const cuda::FusionSlot>(slots), slot_count, extent, dtype_of(dtype),
                     pointer<const void>(buffer), scale, pointer<void>(stream));
      },
      py::arg("slots"), py::arg("slot_count"), py::arg("extent"), py::arg("dtype"),
      py::arg("buffer"), py::arg("scale"), py::arg("stream"), Release(),
      "Copies the fusion buffer back into every slot's tensor, times `scale`, in one launch.");
  cuda.def(
      "cast",
      [](std::uintptr_t src, int src_dtype, std::uintptr_t dst, int dst_dtype,
         std::int64_t numel, std::uintptr_t stream) {
        cuda::cast(pointer<const void>(src), dtype_of(src_dtype), pointer<void>(dst),
                   dtype_of(dst_dtype), numel, pointer<void>(stream));
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"),
      py::arg("numel"), py::arg("stream"), Release(),
      "float32 <-> float16/bfloat16 conversion (round to nearest even).");
  cuda.def(
      "cast_divide",
      [](std::uintptr_t src, std::uintptr_t dst, int half, std::int64_t numel, float divisor,
         std::uintptr_t stream) {
        cuda::cast_divide(pointer<const float>(src), pointer<void>(dst), dtype_of(half), numel,
                          divisor, pointer<void>(stream));
      },
      py::arg("src"), py::arg("dst"), py::arg("half"), py::arg("numel"), py::arg("divisor"),
      py::arg("stream"), Release(),
      "float32 -> float16/bfloat16, then divided in that type: the wire format of DDP's "
      "fp16/bf16 hooks, buffer.to(half).div_(world_size).");
}

}  // namespace hemiola::python
