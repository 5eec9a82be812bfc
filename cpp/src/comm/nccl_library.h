// libnccl.so.2, loaded at run time.
//
// NCCL is never a link-time dependency: a CPU-only install must load without
// it, and a GPU install picks up whichever libnccl.so.2 the user has (the
// nvidia-nccl-cu13 wheel, a system package, or the copy torch already loaded).
// The declarations come from the real nccl.h at build time, so every entry
// point's type is decltype(&ncclX): a signature that drifted from the header
// cannot compile, and enum values (ncclDataType_t, ncclRedOp_t) and the size
// of ncclUniqueId are the library's own.
#pragma once

#include <nccl.h>

#include <string>

namespace hemiola::comm {

// The NCCL entry points the engine uses. All non-null once loaded.
struct NcclFunctions {
  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetErrorString) get_error_string = nullptr;
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;
  decltype(&::ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&::ncclAllReduce) all_reduce = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;
};

// One dlopen handle and the functions resolved from it. The object owns the
// handle (dlclose in the destructor), so the function pointers are valid for
// exactly its lifetime; it is neither copyable nor movable for that reason.
// Loading twice is cheap: the dynamic linker reference-counts the library.
class NcclLibrary {
 public:
  static constexpr const char* kDefaultName = "libnccl.so.2";

  // Loads `name`: a bare file name is searched the dynamic linker's way
  // (LD_LIBRARY_PATH, libhemiola's RUNPATH, which points into the wheel, the
  // ld.so cache, or a copy already loaded in the process); a path is loaded
  // as is. Never throws: on failure loaded() is false and reason() says why
  // and what to do about it.
  explicit NcclLibrary(const std::string& name = kDefaultName) noexcept;
  ~NcclLibrary();
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  bool loaded() const { return handle_ != nullptr; }
  // Why the library is not usable; empty when loaded().
  const std::string& reason() const { return reason_; }
  // The file the dynamic linker actually opened; empty unless loaded().
  const std::string& path() const { return path_; }
  // The library's NCCL_VERSION_CODE (e.g. 23203) and as "2.32.3"; 0 and ""
  // unless loaded().
  int version_code() const { return version_code_; }
  std::string version() const;

  // The entry points. Throws hemiola::Error with reason() unless loaded().
  const NcclFunctions& api() const;

 private:
  // Resolves every entry point; false with reason_ set when one is missing.
  bool resolve();

  void* handle_ = nullptr;
  NcclFunctions api_;
  std::string reason_;
  std::string path_;
  int version_code_ = 0;
};

// "2.32.3" from an NCCL_VERSION_CODE, both the pre-2.9 (major*1000) and the
// current (major*10000) encodings.
std::string nccl_version_string(int code);

}  // namespace hemiola::comm
