#include "model.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "csv.h"

namespace hemiola::cluster {

std::vector<ModelSpec> builtin_models() {
  return {
      {"vgg16", 526.4, 36.0, 54.0, 4527.0},
      {"resnet50", 99.2, 25.0, 37.0, 3213.0},
      {"inception-v3", 103.0, 35.0, 52.0, 3291.0},
      {"lstm-ptb", 251.8, 32.0, 47.0, 2751.0},
  };
}

namespace {
void require_finite_non_negative(double v, const std::string& what) {
  if (!(v >= 0.0 && v <= kMaxQuantity)) {
    std::ostringstream msg;
    msg << what << " must be a number in [0, " << kMaxQuantity << "], got " << v;
    throw std::invalid_argument(msg.str());
  }
}
}  // namespace

void validate_model(const ModelSpec& m) {
  if (m.name.empty()) throw std::invalid_argument("model name must not be empty");
  const std::string p = "model '" + m.name + "': ";
  require_finite_non_negative(m.size_mb, p + "size_mb");
  require_finite_non_negative(m.forward_ms, p + "forward_ms");
  require_finite_non_negative(m.backward_ms, p + "backward_ms");
  require_finite_non_negative(m.memory_mb, p + "memory_mb");
  if (m.compute_ms() <= 0.0) {
    throw std::invalid_argument(p + "forward_ms + backward_ms must be > 0");
  }
}

int find_model(const std::vector<ModelSpec>& models, const std::string& name) {
  for (size_t i = 0; i < models.size(); ++i) {
    if (models[i].name == name) return static_cast<int>(i);
  }
  std::string known;
  for (const auto& m : models) known += (known.empty() ? "" : ", ") + m.name;
  throw std::invalid_argument("unknown model '" + name + "' (known: " + known + ")");
}

std::vector<ModelSpec> parse_models_csv(std::istream& in, const std::string& source) {
  CsvReader reader(in, source, {"name", "size_mb", "forward_ms", "backward_ms", "memory_mb"});
  std::vector<ModelSpec> models;
  while (reader.next()) {
    ModelSpec m;
    m.name = reader.field("name");
    m.size_mb = reader.number("size_mb");
    m.forward_ms = reader.number("forward_ms");
    m.backward_ms = reader.number("backward_ms");
    m.memory_mb = reader.number("memory_mb");
    try {
      validate_model(m);
      for (const auto& other : models) {
        if (other.name == m.name) throw std::invalid_argument("duplicate model '" + m.name + "'");
      }
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(reader.where() + ": " + e.what());
    }
    models.push_back(m);
  }
  if (models.empty()) throw std::invalid_argument(source + ": no models");
  return models;
}

std::vector<ModelSpec> load_models_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open model file '" + path + "'");
  return parse_models_csv(in, path);
}

void validate_cluster(const ClusterSpec& c) {
  if (c.nodes <= 0) throw std::invalid_argument("cluster: nodes must be > 0");
  if (c.gpus_per_node <= 0) throw std::invalid_argument("cluster: gpus_per_node must be > 0");
  // Checked in 64 bits: nodes * gpus_per_node may not fit the int total_gpus() returns.
  if (static_cast<long long>(c.nodes) * c.gpus_per_node > kMaxGpus) {
    throw std::invalid_argument("cluster: nodes x gpus_per_node must be at most " +
                                std::to_string(kMaxGpus) + " GPUs");
  }
  const std::string range =
      " (at most " + std::to_string(static_cast<long long>(kMaxQuantity)) + ")";
  if (!(c.gpu_memory_mb > 0.0 && c.gpu_memory_mb <= kMaxQuantity)) {
    throw std::invalid_argument("cluster: gpu_memory_mb must be > 0" + range);
  }
  if (!(c.beta_ms_per_mb > 0.0 && c.beta_ms_per_mb <= kMaxQuantity)) {
    throw std::invalid_argument("cluster: beta_ms_per_mb must be > 0" + range);
  }
  if (!(c.eta_ms_per_mb >= 0.0 && c.eta_ms_per_mb <= kMaxQuantity)) {
    throw std::invalid_argument("cluster: eta_ms_per_mb must be >= 0" + range);
  }
}

}  // namespace hemiola::cluster
