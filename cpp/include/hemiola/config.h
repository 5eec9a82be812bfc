// Plain configuration structs. Every field has a documented default; the
// Python layer fills them from hemiola.Config.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hemiola/export.h"
#include "hemiola/tensor.h"

namespace hemiola {

struct EngineOptions {
  int rank = 0;
  int world_size = 1;
  // Network interface to bind (like GLOO_SOCKET_IFNAME), e.g. "eth0". Takes
  // precedence over `hostname`.
  std::string iface;
  // Address or host name to bind. When both this and `iface` are empty the
  // engine binds the local address that routes to `master_addr`, or, without
  // one, the machine's host name.
  std::string hostname;
  // Address of the rendezvous master (torchrun's MASTER_ADDR), used only to
  // pick the local address when neither iface nor hostname is given.
  std::string master_addr;
  // Any collective (and the rendezvous) that does not complete within this
  // many seconds fails on every surviving rank with Error(kTimeout), naming
  // what was pending. Never a silent hang.
  double timeout_s = 300.0;
  // Record a timeline of engine events (see Engine::timeline_json).
  bool timeline = false;
  // How CUDA tensors are reduced: "nccl" (one GPU per rank), "gloo" (staged
  // through pinned host memory: no NCCL needed, and several ranks may share
  // a GPU) or "auto" (NCCL when libnccl.so.2 loads, else Gloo).
  std::string gpu_backend = "auto";
  // The Gloo backend with CUDA tensors: 0 stages each reduction whole (down
  // to pinned memory, reduce, up, one after the other); > 0 pipelines it in
  // chunks of this many bytes through three pinned stages, so a chunk's
  // copies overlap the wire time of its neighbours, across buckets too.
  // Every rank must use the same value (it decides how many collectives a
  // reduction is). Experimental: not yet run on a GPU (docs/gpu.md).
  size_t staged_chunk_bytes = 0;
  // Gloo connections (each its own TCP device, context and thread) that one
  // large all-reduce is split across, its parts on the wire at once. One
  // Gloo all-reduce at a time leaves a fast link half idle (measured on an
  // H100 host at 20 Gbit/s: 1.3 GB/s of 2.5; torch's Gloo process group runs
  // two collectives at once for this reason). Every rank must use the same
  // value (checked at connection). Experimental: 1 until measured on a GPU
  // machine (docs/gpu.md).
  int gloo_stripes = 1;
  // After a transport failure, find which ranks are missing (each survivor
  // announces itself through the store and waits up to min(timeout_s, 10)
  // seconds for the others) and name them in the error. Off where someone
  // else knows who died and the wait would only delay recovery (an elastic
  // run's coordinator).
  bool diagnose_failures = true;
};

// How a bucket travels on the wire (engine/codec/codec.h). Applies to float32
// buckets; buckets of other dtypes travel as they are. These are the codes;
// the Python layer takes them, and the names, from codings().
enum class Compression : uint8_t {
  kNone = 0,
  kFp16 = 1,  // two bytes, pre-divided by the world size (DDP's fp16 hook)
  kBf16 = 2,  // the same in bfloat16 (DDP's bf16 hook)
  kInt8 = 3,  // one byte per element, a scale per block, error feedback
  kPowerSgd = 4,  // low rank (PowerSGD) with error feedback; small tensors as they are
  kInt4 = 5,  // int8's coding in half a byte per element (two codes a byte); <= 7 ranks
};

// One coding and every fact about it that another part asks: the name
// hemiola.Config.compression gives it, the buckets it runs on, whether
// streaming's outer synchronisation may send with it, and whether it keeps
// error-feedback residuals. The table is the codec factory's
// (engine/codec/factory.cpp); a reducer refuses any pairing it does not
// list, naming what works there.
struct Coding {
  Compression compression;
  const char* name;  // as Config.compression spells it ("none": kNone)
  bool host;         // runs on host (CPU) buckets
  bool cuda;         // runs on CUDA device buckets
  bool streams;      // streaming's fragments may travel with it
  bool residuals;    // keeps an error-feedback residual per tensor
};
// Every coding, in code order.
HEMIOLA_API const std::vector<Coding>& codings();
// The coding of `compression` (throws for an unknown code).
HEMIOLA_API const Coding& coding(Compression compression);

struct ReducerOptions {
  // Gradients are fused into buckets in plan order; a bucket closes once it
  // holds at least this many bytes (engine/buckets/bucket_plan.h).
  size_t fusion_bytes = 25u << 20;
  // The first bucket (the last layers, whose gradients are ready first) is
  // capped smaller, so communication starts early in backward.
  size_t first_bucket_bytes = 1u << 20;
  // Divide the summed gradients by the world size.
  bool average = true;
  // Also all-reduce, after the gradient buckets, how many ranks produced a
  // gradient for each tensor, so callers can tell locally unused parameters
  // (zero-filled here) from globally unused ones. Costs one small collective.
  bool track_usage = false;
  // Record the order in which gradients become ready during the first
  // iteration, so the plan can be rebuilt to match it.
  bool record_order = true;
  // A gradient larger than this many bytes is cut into pieces of at most this
  // size, which may go to different buckets (0: never). Lets a fixed issue
  // order put small front-layer buckets ahead of the tail of a huge tensor.
  size_t partition_bytes = 0;
  // How many earlier iterations may still be reducing while a new one marks
  // gradients (0: each iteration is waited for before the next starts). Each
  // costs one more set of bucket buffers.
  size_t in_flight = 0;
  // Before each bucket's full-precision reduction, all-reduce a one-byte
  // coding of it (engine/codec/preview.h) and keep this rank's estimate of the
  // average: its own gradient plus the coded average minus its own coding.
  // The previews go on a lane of their own (a second communicator and
  // engine thread), and an iteration's full reductions start once all its
  // previews are done. From the second iteration of a bucket plan on (the
  // codes' scales come from the previous iteration's averages). CPU only;
  // at most 127 ranks. Costs a quarter more bytes (of float32 gradients).
  bool preview = false;
  // How each float32 bucket travels (host buckets only, for now).
  Compression compression = Compression::kNone;
  // Compression::kPowerSgd: the rank of the approximation, and the first
  // iteration that is compressed (the ones before travel uncompressed).
  size_t powersgd_rank = 2;
  uint64_t powersgd_start_iteration = 10;
  // Where the gradients live: every gradient of a reducer is on this device.
  // On a CUDA device the buckets are device memory, gradients are copied in
  // on the caller's stream, and reductions run on the engine's stream.
  Device device{};
};

}  // namespace hemiola
