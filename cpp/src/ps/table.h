// The shard table a worker registers with a server: which keys the server
// holds for which tensor ranges, and the optimizer. Every worker sends its
// own; the server checks they agree (and agree with a restored snapshot), so
// mismatched models fail at registration instead of training garbage.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "hemiola/ps.h"

namespace hemiola::ps {

struct TableEntry {
  Shard shard;
  std::string name;
};

// Text, one line per shard of `server`, after a first line naming the optimizer.
std::string make_table(const std::vector<Shard>& shards, const std::vector<std::string>& names,
                       int server, OptimizerKind optimizer);
// Throws Error(kInvalidArgument) when the text is not a table.
std::vector<TableEntry> parse_table(const std::string& text, OptimizerKind* optimizer);
// "line 3: 'a' vs 'b'", or empty when equal.
std::string first_difference(const std::string& a, const std::string& b);

// What a worker registers with a server: its shard table and the optimizer
// settings it starts with, per key of that server (servers check that every
// worker's agree: bsp would silently mix them).
struct Registration {
  std::string table;
  std::map<int32_t, OptimizerHyper> hyper;  // by key
};
// The table's text, a line "hyper", then one line per key: key, lr, momentum,
// dampening, weight_decay, nesterov, beta1, beta2, eps (exact decimal text).
std::string make_registration(const std::string& table,
                              const std::map<int32_t, OptimizerHyper>& hyper);
// Throws Error(kInvalidArgument) when the text is not a registration.
Registration parse_registration(const std::string& text);

}  // namespace hemiola::ps
