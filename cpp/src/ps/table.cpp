#include "ps/table.h"

#include <cstdio>
#include <cstdlib>
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

namespace {

constexpr const char* kHyperLine = "hyper\n";

std::string exact(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

double parse_double(const std::string& word, const std::string& line) {
  char* end = nullptr;
  const double v = std::strtod(word.c_str(), &end);
  HEMIOLA_CHECK(!word.empty() && end == word.c_str() + word.size(),
                "malformed optimizer settings line '", line, "'");
  return v;
}

}  // namespace

std::string make_registration(const std::string& table,
                              const std::map<int32_t, OptimizerHyper>& hyper) {
  std::string text = table + kHyperLine;
  for (const auto& [key, h] : hyper) {
    text += std::to_string(key);
    for (double v : {h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov ? 1.0 : 0.0,
                     h.beta1, h.beta2, h.eps})
      text += ' ' + exact(v);
    text += '\n';
  }
  return text;
}

Registration parse_registration(const std::string& text) {
  // The table's lines have five fields, so a line "hyper" cannot be one of them.
  const size_t at = text.rfind(std::string("\n") + kHyperLine);
  HEMIOLA_CHECK(at != std::string::npos,
                "malformed registration: no optimizer settings (a worker of an older hemiola?)");
  Registration r;
  r.table = text.substr(0, at + 1);
  std::istringstream in(text.substr(at + 1 + std::string(kHyperLine).size()));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    int32_t key = -1;
    std::string words[8];
    HEMIOLA_CHECK(fields >> key >> words[0] >> words[1] >> words[2] >> words[3] >> words[4] >>
                      words[5] >> words[6] >> words[7],
                  "malformed optimizer settings line '", line, "'");
    std::string extra;
    HEMIOLA_CHECK(!(fields >> extra), "malformed optimizer settings line '", line, "'");
    OptimizerHyper h;
    h.lr = parse_double(words[0], line);
    h.momentum = parse_double(words[1], line);
    h.dampening = parse_double(words[2], line);
    h.weight_decay = parse_double(words[3], line);
    h.nesterov = parse_double(words[4], line) != 0.0;
    h.beta1 = parse_double(words[5], line);
    h.beta2 = parse_double(words[6], line);
    h.eps = parse_double(words[7], line);
    HEMIOLA_CHECK(r.hyper.emplace(key, h).second, "optimizer settings for key ", key, " twice");
  }
  return r;
}

}  // namespace hemiola::ps
