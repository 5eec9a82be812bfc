#include "csv.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
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

// Position of the first byte that is not part of UTF-8 text (a control
// character other than tab and CR, or a malformed / overlong / surrogate
// sequence), or npos.
size_t first_non_text_byte(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7F) return i;
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned min = 0, cp = 0;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2, min = 0x80, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3, min = 0x800, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4, min = 0x10000, cp = c & 0x07;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}

// Optional sign, then digits with at most one '.', at least one digit, then an
// optional exponent: what a person writes as a decimal number. strtod alone
// would also take hexadecimal ("0x10"), "inf", "nan" and leading spaces.
bool is_decimal_number(const std::string& s) {
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  size_t digits = 0;
  bool dot = false;
  for (; i < s.size(); ++i) {
    if (s[i] >= '0' && s[i] <= '9') {
      ++digits;
    } else if (s[i] == '.' && !dot) {
      dot = true;
    } else {
      break;
    }
  }
  if (digits == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    const size_t start = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
    if (i == start) return false;
  }
  return i == s.size();
}

bool is_decimal_integer(const std::string& s) {
  size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  if (i == s.size()) return false;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
  }
  return true;
}
}  // namespace

std::string abbreviate(const std::string& text, size_t max_chars) {
  if (text.size() <= max_chars) return text;
  size_t cut = max_chars;
  // Never split a UTF-8 sequence: back up over continuation bytes.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return text.substr(0, cut) + "...";
}

CsvReader::CsvReader(std::istream& in, std::string source, const std::vector<std::string>& required)
    : in_(in), source_(std::move(source)) {
  std::string header;
  if (!read_line(header)) throw std::invalid_argument(source_ + ": empty file (no header)");
  line_ = 1;
  // Editors on Windows start UTF-8 files with a byte-order mark; it is not
  // part of the first column's name.
  static const std::string kBom = "\xEF\xBB\xBF";
  if (header.compare(0, kBom.size(), kBom) == 0) header.erase(0, kBom.size());
  check_text(header);
  auto names = split(header);
  for (size_t i = 0; i < names.size(); ++i) {
    // A second column of one name would shift every row's fields against
    // the names: refuse the header rather than each row.
    if (!columns_.emplace(names[i], i).second) {
      throw std::invalid_argument(source_ + " line 1: column '" + abbreviate(names[i]) +
                                  "' appears twice in header '" + abbreviate(header) + "'");
    }
  }
  for (const auto& r : required) {
    if (!columns_.count(r)) {
      throw std::invalid_argument(source_ + " line 1: missing column '" + r + "' in header '" +
                                  abbreviate(header) + "'");
    }
  }
}

void CsvReader::check_text(const std::string& line) const {
  const size_t bad = first_non_text_byte(line);
  if (bad == std::string::npos) return;
  char byte[8];
  std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(line[bad]));
  throw std::invalid_argument(where() + ": not a UTF-8 text CSV file (byte " + byte +
                              " at column " + std::to_string(bad + 1) + ")");
}

bool CsvReader::read_line(std::string& line) {
  line.clear();
  std::streambuf* buf = in_.rdbuf();
  bool any = false;
  for (int c = buf->sbumpc(); c != std::char_traits<char>::eof(); c = buf->sbumpc()) {
    any = true;
    if (c == '\n') return true;
    if (line.size() == kMaxLineBytes) {
      throw std::invalid_argument(source_ + " line " + std::to_string(line_ + 1) +
                                  ": longer than " + std::to_string(kMaxLineBytes) +
                                  " bytes; is this a CSV trace?");
    }
    line.push_back(static_cast<char>(c));
  }
  in_.setstate(std::ios::eofbit);
  return any;
}

bool CsvReader::next() {
  std::string line;
  while (read_line(line)) {
    ++line_;
    check_text(line);
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (line.find('"') != std::string::npos) {
      throw std::invalid_argument(where() + ": quoted fields are not supported");
    }
    fields_ = split(line);
    if (fields_.size() != columns_.size()) {
      throw std::invalid_argument(where() + ": expected " + std::to_string(columns_.size()) +
                                  " fields, got " + std::to_string(fields_.size()) + " ('" +
                                  abbreviate(line) + "')");
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
  if (!is_decimal_number(s)) {
    throw std::invalid_argument(where() + ": column '" + column + "' is not a number: '" +
                                abbreviate(s) + "' (decimal notation expected)");
  }
  errno = 0;
  const double v = std::strtod(s.c_str(), nullptr);
  if (!std::isfinite(v) || errno == ERANGE) {
    throw std::invalid_argument(where() + ": column '" + column + "' is out of range: '" +
                                abbreviate(s) + "'");
  }
  return v;
}

long long CsvReader::integer(const std::string& column) const {
  const std::string& s = field(column);
  if (!is_decimal_integer(s)) {
    throw std::invalid_argument(where() + ": column '" + column +
                                "' is not a decimal integer: '" + abbreviate(s) + "'");
  }
  errno = 0;
  const long long v = std::strtoll(s.c_str(), nullptr, 10);
  if (errno == ERANGE) {
    throw std::invalid_argument(where() + ": column '" + column + "' is out of range: '" +
                                abbreviate(s) + "'");
  }
  return v;
}

std::string CsvReader::where() const { return source_ + " line " + std::to_string(line_); }

}  // namespace hemiola::cluster
