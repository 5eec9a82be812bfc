#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "hemiola/status.h"
#include "hemiola/store.h"

namespace hemiola {

namespace {
// Keys may contain '/', which would be directories: encode every byte that is
// not [A-Za-z0-9._-] as %XX so each key is exactly one file name.
std::string encode_key(const std::string& key) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}
}  // namespace

FileStore::FileStore(std::string directory) : directory_(std::move(directory)) {
  HEMIOLA_CHECK(!directory_.empty(), "FileStore needs a directory");
  if (::mkdir(directory_.c_str(), 0777) != 0 && errno != EEXIST) {
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, "FileStore: cannot create directory '",
                  directory_, "': ", std::strerror(errno));
  }
}

std::string FileStore::path_of(const std::string& key) const {
  return directory_ + "/" + encode_key(key);
}

void FileStore::set(const std::string& key, const std::string& value) {
  const std::string path = path_of(key);
  // Unique temporary name per writer, then an atomic rename: readers see the
  // old value or the new one, never a partial file.
  std::ostringstream tmp_name;
  tmp_name << path << ".tmp." << ::getpid() << "." << std::this_thread::get_id();
  {
    std::ofstream out(tmp_name.str(), std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!out) {
      HEMIOLA_THROW(ErrorCode::kInvalidArgument, "FileStore: cannot write '", tmp_name.str(),
                    "'");
    }
  }
  if (std::rename(tmp_name.str().c_str(), path.c_str()) != 0) {
    HEMIOLA_THROW(ErrorCode::kInvalidArgument, "FileStore: cannot rename to '", path,
                  "': ", std::strerror(errno));
  }
}

bool FileStore::check(const std::string& key) {
  return ::access(path_of(key).c_str(), F_OK) == 0;
}

std::string FileStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string path = path_of(key);
  auto pause = std::chrono::microseconds(200);
  while (true) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::ostringstream content;
      content << in.rdbuf();
      return content.str();
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      HEMIOLA_THROW(ErrorCode::kTimeout, "store key '", key, "' was not set within ",
                    timeout.count(), " ms (FileStore at ", directory_, ")");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

}  // namespace hemiola
