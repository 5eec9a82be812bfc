// Model and cluster descriptions: the static inputs of a simulation.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace hemiola::cluster {

// One DNN model as the simulator sees it: how much it communicates per
// iteration, how long one worker computes, and how much GPU memory it holds.
struct ModelSpec {
  std::string name;
  double size_mb = 0.0;      // gradient volume all-reduced once per iteration
  double forward_ms = 0.0;   // one worker's forward pass
  double backward_ms = 0.0;  // one worker's backward pass
  double memory_mb = 0.0;    // resident on every GPU the job uses

  double compute_ms() const { return forward_ms + backward_ms; }
};

// The four models of the paper.
std::vector<ModelSpec> builtin_models();

// Largest value accepted for any size (MB), time (ms) or memory (MB) of a model
// or cluster, and the most GPUs a cluster may have. Far above real hardware;
// they keep the simulators' sums finite and the GPU count inside an int.
constexpr double kMaxQuantity = 1e9;
constexpr long long kMaxGpus = 1 << 20;

// Throws std::invalid_argument naming the field when a value is not usable.
void validate_model(const ModelSpec& model);

// Index of `name` in `models`; throws std::invalid_argument listing the known names.
int find_model(const std::vector<ModelSpec>& models, const std::string& name);

// User-defined models from CSV with header `name,size_mb,forward_ms,backward_ms,memory_mb`.
// Errors name the line. `source` only labels messages.
std::vector<ModelSpec> parse_models_csv(std::istream& in, const std::string& source);
std::vector<ModelSpec> load_models_csv(const std::string& path);

// nodes x gpus_per_node GPUs; traffic inside a node is free, traffic between
// nodes goes through each node's network interface, where transfers contend.
struct ClusterSpec {
  int nodes = 16;
  int gpus_per_node = 4;
  double gpu_memory_mb = 32768.0;
  // Contention law for k transfers sharing a NIC: each runs at 1/(k*beta + (k-1)*eta) MB/ms.
  double beta_ms_per_mb = 0.856;  // 10 Gbit/s Ethernet
  double eta_ms_per_mb = 0.235;

  int total_gpus() const { return nodes * gpus_per_node; }
  int node_of(int gpu) const { return gpu / gpus_per_node; }
};

void validate_cluster(const ClusterSpec& cluster);

}  // namespace hemiola::cluster
