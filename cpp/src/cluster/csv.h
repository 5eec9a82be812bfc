// A small CSV reader with a header row; every error names the source and line.
// Quoting is not supported (none of our inputs need it) and is rejected clearly.
#pragma once

#include <istream>
#include <string>
#include <unordered_map>
#include <vector>

namespace hemiola::cluster {

class CsvReader {
 public:
  // Reads the header and checks that every name in `required` is present.
  CsvReader(std::istream& in, std::string source, const std::vector<std::string>& required);

  // Advances to the next non-empty data row; false at end of input.
  bool next();

  bool has(const std::string& column) const { return columns_.count(column) > 0; }
  const std::string& field(const std::string& column) const;
  double number(const std::string& column) const;  // finite double or throws
  long long integer(const std::string& column) const;

  // "SOURCE line N" of the current row (1-based, header is line 1).
  std::string where() const;
  long long line() const { return line_; }

 private:
  std::istream& in_;
  std::string source_;
  std::unordered_map<std::string, size_t> columns_;
  std::vector<std::string> fields_;
  long long line_ = 0;
};

}  // namespace hemiola::cluster
