// A parameter server's state on disk: what it needs to restart where it was.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ps/optimizer.h"

namespace hemiola::ps {

struct KeySnapshot {
  int32_t key = 0;
  int64_t version = 0;
  std::vector<float> param;
  OptimizerState optimizer;
};

struct ServerSnapshot {
  int32_t server_index = 0;
  int32_t num_servers = 0;
  std::string table;  // the shard table the workers registered (must match on restore)
  std::vector<KeySnapshot> keys;
};

// The checksum sealing a snapshot: FNV-1a of every byte before it.
uint64_t snapshot_checksum(const std::string& bytes);

// Writes atomically (a temporary file, then rename) with a trailing checksum.
void write_snapshot(const std::string& path, const ServerSnapshot& snapshot);
// Throws Error(kInvalidArgument) naming the problem for a missing, truncated
// or corrupted file.
ServerSnapshot read_snapshot(const std::string& path);

}  // namespace hemiola::ps
