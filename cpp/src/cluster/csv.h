// A small CSV reader with a header row; every error names the source and line.
// Quoting is not supported (none of our inputs need it) and is rejected clearly.
// Input must be UTF-8 text (a leading byte-order mark is skipped); anything else,
// e.g. a compressed or binary file given by mistake, is refused at its first
// bad line, so no message ever echoes bytes that are not text. A header that
// names a column twice is refused at line 1, and no line may be longer than
// kMaxLineBytes: a runaway line fails at once instead of filling memory.
#pragma once

#include <istream>
#include <string>
#include <unordered_map>
#include <vector>

namespace hemiola::cluster {

class CsvReader {
 public:
  // The longest line accepted (header or row), in bytes.
  static constexpr size_t kMaxLineBytes = 1 << 20;

  // Reads the header and checks that every name in `required` is present.
  CsvReader(std::istream& in, std::string source, const std::vector<std::string>& required);

  // Advances to the next non-empty data row; false at end of input.
  bool next();

  bool has(const std::string& column) const { return columns_.count(column) > 0; }
  const std::string& field(const std::string& column) const;
  // A finite decimal number ("12", "-3.5", "1e3"; not "0x10", "inf" or "nan"), or throws.
  double number(const std::string& column) const;
  // A decimal integer ("42", "+7", "-1"; not "4.0", "1e3" or "0x10") in range, or throws.
  long long integer(const std::string& column) const;

  // "SOURCE line N" of the current row (1-based, header is line 1).
  std::string where() const;
  long long line() const { return line_; }

 private:
  // Throws unless `line` (the current one) is UTF-8 text without control characters.
  void check_text(const std::string& line) const;
  // std::getline that refuses a line longer than kMaxLineBytes (numbering
  // it line_ + 1) before reading all of it.
  bool read_line(std::string& line);

  std::istream& in_;
  std::string source_;
  std::unordered_map<std::string, size_t> columns_;
  std::vector<std::string> fields_;
  long long line_ = 0;
};

// `text` cut to at most `max_chars` bytes (with "...") for quoting in a message.
std::string abbreviate(const std::string& text, size_t max_chars = 80);

}  // namespace hemiola::cluster
