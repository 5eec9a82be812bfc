#include "comm/nccl_library.h"

#include <dlfcn.h>
#include <link.h>

#include <filesystem>

#include "hemiola/status.h"

namespace hemiola::comm {

namespace {

// dlerror() text, or a fallback: it is null when nothing failed since the
// last call (e.g. a symbol that exists but is bound to null).
std::string last_dl_error() {
  const char* error = dlerror();
  return error ? error : "no error reported";
}

// Resolves `symbol` into `slot`; false when the library lacks it.
template <typename Function>
bool resolve_symbol(void* handle, const char* symbol, Function& slot, std::string& missing) {
  dlerror();  // clear, so a null result can be told apart from an error
  slot = reinterpret_cast<Function>(dlsym(handle, symbol));
  if (slot) return true;
  missing = std::string(symbol) + " (" + last_dl_error() + ")";
  return false;
}

}  // namespace

std::string nccl_version_string(int code) {
  // NCCL 2.9 changed NCCL_VERSION(X,Y,Z) from X*1000+Y*100+Z to X*10000+Y*100+Z.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code % 10000 / 100 : code % 1000 / 100;
  const int patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

NcclLibrary::NcclLibrary(const std::string& name) noexcept {
  try {
    // RTLD_LOCAL: NCCL's symbols must not interpose on anyone else's (torch may
    // carry its own NCCL); RTLD_NOW: a broken install fails here, not mid-run.
    handle_ = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle_) {
      reason_ = name + " not found: " + last_dl_error() +
                "; pip install nvidia-nccl-cu13 or hemiola[gpu]";
      return;
    }
    // The file really opened (a bare name resolves through the search path);
    // normalised lexically, since a RUNPATH hit reads ".../hemiola/lib/../../nvidia/...".
    const link_map* map = nullptr;
    path_ = dlinfo(handle_, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name[0]
                ? std::filesystem::path(map->l_name).lexically_normal().string()
                : name;
    if (!resolve()) {
      dlclose(handle_);
      handle_ = nullptr;
      path_.clear();
      return;
    }
    const ncclResult_t status = api_.get_version(&version_code_);
    if (status != ncclSuccess) {
      reason_ = path_ + ": ncclGetVersion failed: " + api_.get_error_string(status);
      dlclose(handle_);
      handle_ = nullptr;
      path_.clear();
      version_code_ = 0;
    }
  } catch (const std::exception& e) {  // only std::bad_alloc can get here
    if (handle_) dlclose(handle_);
    handle_ = nullptr;
    reason_ = std::string("loading ") + name + " failed: " + e.what();
  }
}

NcclLibrary::~NcclLibrary() {
  if (handle_) dlclose(handle_);
}

bool NcclLibrary::resolve() {
  std::string missing;
  const bool ok = resolve_symbol(handle_, "ncclGetVersion", api_.get_version, missing) &&
                  resolve_symbol(handle_, "ncclGetErrorString", api_.get_error_string, missing) &&
                  resolve_symbol(handle_, "ncclGetUniqueId", api_.get_unique_id, missing) &&
                  resolve_symbol(handle_, "ncclCommInitRank", api_.comm_init_rank, missing) &&
                  resolve_symbol(handle_, "ncclCommDestroy", api_.comm_destroy, missing) &&
                  resolve_symbol(handle_, "ncclCommAbort", api_.comm_abort, missing) &&
                  resolve_symbol(handle_, "ncclCommGetAsyncError", api_.comm_get_async_error,
                                 missing) &&
                  resolve_symbol(handle_, "ncclAllReduce", api_.all_reduce, missing) &&
                  resolve_symbol(handle_, "ncclBroadcast", api_.broadcast, missing) &&
                  resolve_symbol(handle_, "ncclGroupStart", api_.group_start, missing) &&
                  resolve_symbol(handle_, "ncclGroupEnd", api_.group_end, missing);
  if (!ok) {
    api_ = NcclFunctions{};
    reason_ = path_ + " is not a usable NCCL 2 library: it lacks " + missing;
  }
  return ok;
}

std::string NcclLibrary::version() const {
  return loaded() ? nccl_version_string(version_code_) : std::string();
}

const NcclFunctions& NcclLibrary::api() const {
  if (!loaded()) HEMIOLA_THROW(ErrorCode::kCommFailure, "NCCL is unavailable: ", reason_);
  return api_;
}

}  // namespace hemiola::comm
