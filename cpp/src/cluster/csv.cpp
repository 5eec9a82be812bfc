#include "csv.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace hemiola::cluster {

namespace {
std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : line) {
    if (ch == ',') {
      out.push_back(cur);
      cur.clear();
    } else if (ch != '\r') {
      cur.push_back(ch);
    }
  }
  out.push_back(cur);
  for (auto& f : out) {  // trim spaces
    size_t b = f.find_first_not_of(" \t");
    size_t e = f.find_last_not_of(" \t");
    f = (b == std::string::npos) ? std::string() : f.substr(b, e - b + 1);
  }
  return out;
}
}  // namespace

CsvReader::CsvReader(std::istream& in, std::string source, const std::vector<std::string>& required)
    : in_(in), source_(std::move(source)) {
  std::string header;
  if (!std::getline(in_, header)) throw std::invalid_argument(source_ + ": empty file (no header)");
  line_ = 1;
  auto names = split(header);
  for (size_t i = 0; i < names.size(); ++i) columns_[names[i]] = i;
  for (const auto& r : required) {
    if (!columns_.count(r)) {
      throw std::invalid_argument(source_ + " line 1: missing column '" + r + "' in header '" +
                                  header + "'");
    }
  }
}

bool CsvReader::next() {
  std::string line;
  while (std::getline(in_, line)) {
    ++line_;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (line.find('"') != std::string::npos) {
      throw std::invalid_argument(where() + ": quoted fields are not supported");
    }
    fields_ = split(line);
    if (fields_.size() != columns_.size()) {
      throw std::invalid_argument(where() + ": expected " + std::to_string(columns_.size()) +
                                  " fields, got " + std::to_string(fields_.size()) + " ('" + line +
                                  "')");
    }
    return true;
  }
  return false;
}

const std::string& CsvReader::field(const std::string& column) const {
  return fields_.at(columns_.at(column));
}

double CsvReader::number(const std::string& column) const {
  const std::string& s = field(column);
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || errno != 0 || !std::isfinite(v)) {
    throw std::invalid_argument(where() + ": column '" + column + "' is not a number: '" + s + "'");
  }
  return v;
}

long long CsvReader::integer(const std::string& column) const {
  const std::string& s = field(column);
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno != 0) {
    throw std::invalid_argument(where() + ": column '" + column + "' is not an integer: '" + s +
                                "'");
  }
  return v;
}

std::string CsvReader::where() const { return source_ + " line " + std::to_string(line_); }

}  // namespace hemiola::cluster
