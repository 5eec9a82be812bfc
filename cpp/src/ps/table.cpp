#include "ps/table.h"

#include <sstream>

#include "hemiola/status.h"

namespace hemiola::ps {

std::string make_table(const std::vector<Shard>& shards, const std::vector<std::string>& names,
                       int server, OptimizerKind optimizer) {
  std::ostringstream out;
  out << "optimizer " << static_cast<int>(optimizer) << "\n";
  for (const auto& s : shards) {
    if (s.server != server) continue;
    out << s.key << ' ' << s.tensor << ' ' << s.begin << ' ' << s.count << ' '
        << names.at(static_cast<size_t>(s.tensor)) << "\n";
  }
  return out.str();
}

std::vector<TableEntry> parse_table(const std::string& text, OptimizerKind* optimizer) {
  std::istringstream in(text);
  std::string word;
  int kind = -1;
  HEMIOLA_CHECK((in >> word >> kind) && word == "optimizer" && kind >= 0 && kind <= 2,
                "malformed shard table (no optimizer line)");
  *optimizer = static_cast<OptimizerKind>(kind);
  std::vector<TableEntry> entries;
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    TableEntry e;
    HEMIOLA_CHECK(fields >> e.shard.key >> e.shard.tensor >> e.shard.begin >> e.shard.count,
                  "malformed shard table line '", line, "'");
    std::getline(fields >> std::ws, e.name);
    HEMIOLA_CHECK(e.shard.key >= 0 && e.shard.begin >= 0 && e.shard.count >= 0,
                  "malformed shard table line '", line, "'");
    entries.push_back(std::move(e));
  }
  return entries;
}

std::string first_difference(const std::string& a, const std::string& b) {
  if (a == b) return {};
  std::istringstream ia(a), ib(b);
  std::string la, lb;
  for (int line = 1;; ++line) {
    const bool more_a = static_cast<bool>(std::getline(ia, la));
    const bool more_b = static_cast<bool>(std::getline(ib, lb));
    if (!more_a && !more_b) return "they differ";
    if (!more_a) la = "<end>";
    if (!more_b) lb = "<end>";
    if (la != lb) return detail::concat("line ", line, ": '", la, "' vs '", lb, "'");
  }
}

}  // namespace hemiola::ps
