// The fusion buffer's unpack kernel (unpack_kernel.h). Design notes:
//
// Unpacking a fusion buffer splits the *buffer* into fixed chunks of kChunk
// elements, one block per chunk; a block finds the first slot overlapping its
// chunk by one binary search over the slot offsets (by one thread, shared
// through shared memory) and walks forward over the slots its chunk touches.
// Compared with assigning blocks per tensor, this balances load whatever the
// size mix (a 64-element bias does not occupy a whole block, a 2M-element
// weight is split evenly), the grid is simply ceil(extent / kChunk), and
// every access to the buffer side is coalesced across slot boundaries. The
// search costs log2(slots) dependent loads of a few hundred bytes that stay in
// L2, hidden behind other resident blocks' traffic. A chunk that lies inside
// one slot (nearly all of them for large tensors) takes an unrolled path that
// issues all kItems loads of a thread before its stores, so each thread keeps
// kItems requests in flight, which is what a bandwidth-bound copy needs.
#include <cstdint>

#include "cuda/kernel_support.cuh"
#include "engine/buckets/unpack_kernel.h"
#include "hemiola/status.h"

namespace hemiola::cuda {

namespace {

constexpr int kItems = 8;
constexpr std::int64_t kChunk = std::int64_t{kThreads} * kItems;

// Calls fn(Tag<U>{}) with U an unsigned integer as wide as one element.
template <typename Fn>
void dispatch_raw(DType dtype, Fn&& fn) {
  switch (dtype_size(dtype)) {
    case 1: return fn(Tag<std::uint8_t>{});
    case 2: return fn(Tag<std::uint16_t>{});
    case 4: return fn(Tag<std::uint32_t>{});
    case 8: return fn(Tag<std::uint64_t>{});
    default: HEMIOLA_THROW(ErrorCode::kInternal, "no raw type for ", dtype_name(dtype));
  }
}

// ---- fusion ---------------------------------------------------------------

// Index of the last slot with offset <= position, or -1 when there is none.
__device__ std::int64_t last_slot_at_or_before(const FusionSlot* slots, std::int64_t count,
                                               std::int64_t position) {
  std::int64_t low = 0;
  std::int64_t high = count;  // invariant: slots[< low] <= position < slots[>= high]
  while (low < high) {
    const std::int64_t mid = low + (high - low) / 2;
    if (slots[mid].offset <= position) {
      low = mid + 1;
    } else {
      high = mid;
    }
  }
  return low - 1;
}

// Unpack copies buffer -> tensor through Transform (a raw copy, or a
// scaling). One block per kChunk of the buffer.
struct RawCopy {
  template <typename T>
  __device__ T operator()(T x) const {
    return x;
  }
};

template <typename T>
struct Scale {
  typename Elem<T>::Math factor;
  __device__ T operator()(T x) const {
    return Elem<T>::from_math(Elem<T>::to_math(x) * factor);
  }
};

template <typename T, typename Transform>
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(const FusionSlot* __restrict__ slots, std::int64_t count,
                  const T* __restrict__ buffer, Transform transform) {
  __shared__ std::int64_t first_slot;
  const std::int64_t chunk_begin = static_cast<std::int64_t>(blockIdx.x) * kChunk;
  const std::int64_t chunk_end = chunk_begin + kChunk;
  if (threadIdx.x == 0) first_slot = last_slot_at_or_before(slots, count, chunk_begin);
  __syncthreads();

  for (std::int64_t s = first_slot < 0 ? 0 : first_slot; s < count; ++s) {
    const FusionSlot slot = slots[s];  // same address in every thread: one broadcast load
    if (slot.offset >= chunk_end) break;
    const std::int64_t slot_end = slot.offset + slot.numel;
    const std::int64_t begin = slot.offset > chunk_begin ? slot.offset : chunk_begin;
    const std::int64_t end = slot_end < chunk_end ? slot_end : chunk_end;
    if (begin >= end) continue;  // the chunk starts in the gap after this slot
    T* tensor = static_cast<T*>(slot.data);
    const std::int64_t shift = slot.offset;  // buffer index - tensor index
    if (end - begin == kChunk) {
      T values[kItems];
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        values[k] = buffer[begin + k * kThreads + threadIdx.x];
      }
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const std::int64_t i = begin + k * kThreads + threadIdx.x;
        tensor[i - shift] = transform(values[k]);
      }
    } else {
      for (std::int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
        tensor[i - shift] = transform(buffer[i]);
      }
    }
  }
}

void check_fusion_args(const FusionSlot* slots, std::int64_t slot_count, std::int64_t extent,
                       const void* buffer) {
  HEMIOLA_CHECK(slot_count >= 0 && extent >= 0, "fusion: negative slot count ", slot_count,
                " or extent ", extent);
  HEMIOLA_CHECK(slot_count == 0 || extent == 0 || (slots && buffer),
                "fusion: null slot array or buffer");
  HEMIOLA_CHECK((extent + kChunk - 1) / kChunk <= INT32_MAX, "fusion: extent ", extent,
                " is too large for one launch");
}

template <typename T, typename Transform>
void launch_unpack(const FusionSlot* slots, std::int64_t slot_count, std::int64_t extent,
                   const void* buffer, Transform transform, void* stream) {
  const auto blocks = static_cast<unsigned>((extent + kChunk - 1) / kChunk);
  unpack_kernel<T><<<blocks, kThreads, 0, as_stream(stream)>>>(
      slots, slot_count, static_cast<const T*>(buffer), transform);
  HEMIOLA_CHECK_LAUNCH("unpack");
}

}  // namespace

void unpack(const FusionSlot* slots, std::int64_t slot_count, std::int64_t extent, DType dtype,
            const void* buffer, double scale, void* stream) {
  check_fusion_args(slots, slot_count, extent, buffer);
  HEMIOLA_CHECK(scale == 1.0 || is_floating(dtype), "unpack: cannot scale ", dtype_name(dtype));
  if (slot_count == 0 || extent == 0) return;
  if (scale == 1.0) {
    dispatch_raw(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_unpack<T>(slots, slot_count, extent, buffer, RawCopy{}, stream);
    });
    return;
  }
  dispatch_floating(dtype, /*with_double=*/true, "unpack with scale", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const Scale<T> transform{static_cast<typename Elem<T>::Math>(scale)};
    launch_unpack<T>(slots, slot_count, extent, buffer, transform, stream);
  });
}

}  // namespace hemiola::cuda
