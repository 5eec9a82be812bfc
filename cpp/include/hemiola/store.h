// Rendezvous key-value store (the role of c10d's Store).
//
// Engines of one job find each other through a Store: each publishes its
// transport address under a key and reads the others'. From Python the store is
// torch.distributed's (the one torchrun sets up); C++ programs use FileStore
// (a directory on a shared file system), MemoryStore (ranks as threads of one
// process) or their own subclass.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "hemiola/export.h"

namespace hemiola {

class HEMIOLA_API Store {
 public:
  virtual ~Store() = default;
  // Sets key to value (binary-safe), overwriting any previous value.
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Returns the value of key, waiting until it is set. Throws Error(kTimeout)
  // when it is not set within `timeout`.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // True when key is set now; never waits.
  virtual bool check(const std::string& key) = 0;
};

// Keys are files in a directory. Writes are atomic (write to a temporary file,
// then rename), so readers never see a partial value.
class HEMIOLA_API FileStore final : public Store {
 public:
  explicit FileStore(std::string directory);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  bool check(const std::string& key) override;

 private:
  std::string path_of(const std::string& key) const;
  std::string directory_;
};

// In-process store for ranks that are threads of one process (tests, examples).
class HEMIOLA_API MemoryStore final : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  bool check(const std::string& key) override;

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

// Prepends a prefix to every key, so several engines can share one store.
class HEMIOLA_API PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  bool check(const std::string& key) override;

 private:
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace hemiola
