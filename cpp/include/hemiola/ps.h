// Parameter server: servers hold the global parameters and optimizer state,
// sharded by key; workers push gradients and pull parameters per tensor.
//
// Every (server, worker) pair talks over its own TCP connection, so one dead
// worker breaks exactly its own connection. A server listens on one chosen
// address (never all interfaces unless told), admits a connection only after
// its hello (and the job token, when one is set) and closes any connection
// that breaks the framing. Parameters are float32 on the wire and in the server.
//
// Versions: each shard counts the optimizer updates applied to it. A pulled
// shard carries its version; a pushed gradient carries the version it was
// computed on; the server applies it at its current version, and the
// difference is the gradient's staleness tau, reported back to the worker.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hemiola/export.h"
#include "hemiola/optimizer.h"
#include "hemiola/store.h"

namespace hemiola::ps {

// When a worker may read parameters, and when the server applies gradients.
enum class Consistency : int32_t {
  kBsp = 0,    // synchronous: a shard steps once all workers pushed; pulls wait for that step
  kAsp = 1,    // asynchronous: each push steps at once; a pull follows the worker's own push
  kSsp = 2,    // asp, but a worker may be at most `staleness_bound` pushes ahead of the slowest
  kEager = 3,  // asp with pull and push decoupled: the pull of the next iteration is answered
               // at once, without waiting for this worker's own push
};

// How much a gradient tau versions old counts: a factor on its weight (SGD:
// on the gradient as it enters the momentum buffer; Adam/AdamW: on the step's
// learning rate).
enum class StalenessRule : int32_t {
  kNone = 0,     // 1
  kInverse = 1,  // 1 / (1 + tau)
  kZhang = 2,    // 1 / max(1, tau): staleness-aware ASGD (Zhang et al., IJCAI'16)
};

// How SGD's momentum meets asynchronous pushes (asp, ssp, eager; bsp's pushes
// are never stale, and Adam/AdamW scale the step's learning rate by the
// staleness factor f in every rule). With N workers a bsp round averages N
// gradients into one momentum step; an asynchronous server steps once per push.
enum class MomentumRule : int32_t {
  // torch's momentum on every push; f scales the push's step (staleness-aware
  // ASGD). A gradient moves the parameters about as far as in bsp when f is
  // about 1/N, but the buffer forgets N times faster than bsp's.
  kNone = 0,
  // momentum / (1 + tau), the gradient weighted by f as it enters the buffer.
  // Stable at high learning rates, but with N workers a gradient moves the
  // parameters about 1/8 as far as in bsp (N = 4, momentum 0.9).
  kCompensated = 1,
  // bsp's round spread over its N pushes: momentum^(1/N) per push, and each
  // gradient weighted so that it moves the parameters as far as it would in
  // bsp, (1 - momentum^(1/N)) / (N (1 - momentum)); staleness beyond the N - 1
  // other pushes of a round is weighted by min(1, N f).
  kRescaled = 2,
};

HEMIOLA_API const char* consistency_name(Consistency c);
HEMIOLA_API Consistency consistency_from_name(const std::string& name);
HEMIOLA_API StalenessRule staleness_rule_from_name(const std::string& name);
HEMIOLA_API MomentumRule momentum_rule_from_name(const std::string& name);
HEMIOLA_API double staleness_factor(StalenessRule rule, int64_t tau);

// One shard: elements [begin, begin + count) of tensor `tensor`, held by `server`.
struct Shard {
  int32_t key = 0;
  int32_t tensor = 0;
  int64_t begin = 0;
  int64_t count = 0;
  int32_t server = 0;
};

// Splits each tensor into parts of at most `partition_elems` elements (near-
// equal parts) and assigns parts to servers so that servers balance by
// elements: largest part first, to the least-loaded server (ties: lowest
// index). Deterministic, so every worker computes the same plan. Keys are
// numbered in tensor order, then part order.
HEMIOLA_API std::vector<Shard> plan_shards(const std::vector<int64_t>& numels, int num_servers,
                                           int64_t partition_elems);

struct ServerOptions {
  int server_index = 0;
  int num_servers = 1;
  int num_workers = 1;
  Consistency consistency = Consistency::kBsp;
  int staleness_bound = 0;  // kSsp only
  // Connection set-up (all workers must connect within it; one connection
  // that says nothing is dropped after it), how long a bsp round may wait
  // for a worker, and how long a worker may stay silent (no heartbeat).
  double timeout_s = 300.0;
  // Where snapshot() writes; with `restore`, serve() starts from the state there.
  std::string snapshot_path;
  bool restore = false;
  double snapshot_every_s = 0.0;  // > 0: also snapshot periodically
  std::string iface;     // network interface to bind (empty: `hostname`)
  std::string hostname;  // address to bind (empty: the one routing to master_addr)
  std::string master_addr;
  // A shared secret of the job (e.g. HEMIOLA_JOB_TOKEN, set by the launcher):
  // a connection that does not present it is refused before any state is
  // touched. Empty: no token, and connections presenting one are refused.
  // It keeps strangers and other jobs out; it is not encryption.
  std::string token;
  // Refuse gradients holding NaN or infinity, naming the parameter (a bsp job
  // fails; an asynchronous one rejects that push and tells its worker).
  bool check_finite = true;
};

// Per-server counters (for logs and tests).
struct ServerStats {
  int64_t pushes_applied = 0;
  int64_t pulls_answered = 0;
  int64_t rejected = 0;  // malformed, out-of-order or inconsistent messages
  int64_t refused = 0;   // connections refused at the handshake (never admitted)
  int64_t snapshots = 0;
  std::vector<int32_t> dead_workers;
  std::vector<std::string> rejections;  // rejections and refusals, newest last (at most 32)
};

class HEMIOLA_API Server {
 public:
  // Listens on the chosen address, publishes it in `store` and admits every
  // worker (blocking, up to timeout_s).
  Server(const ServerOptions& options, std::shared_ptr<Store> store);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Serves until every worker has said goodbye or died. Throws Error when the
  // job cannot go on (a bsp worker died or stalled), after telling the workers.
  void serve();
  // Writes the state to options.snapshot_path (atomically: temp file + rename).
  void snapshot();
  ServerStats stats() const;

 private:
  struct Impl;
  // Everything up to admitting the workers; a failure here is published
  // where the workers look for the address.
  static void start_up(Impl& im, const ServerOptions& options);
  std::unique_ptr<Impl> impl_;
};

struct ClientOptions {
  int worker_index = 0;
  int num_workers = 1;
  int num_servers = 1;
  Consistency consistency = Consistency::kBsp;
  StalenessRule staleness_rule = StalenessRule::kNone;
  OptimizerKind optimizer = OptimizerKind::kSgd;
  int64_t partition_elems = 1 << 20;
  double timeout_s = 300.0;
  // A worker only connects (the kernel picks the source address by route), so
  // these three are not needed; kept so one BindSpec fills both option sets.
  std::string iface;
  std::string hostname;
  std::string master_addr;
  std::string token;  // the job token the servers expect (see ServerOptions::token)
  // eager only: a pulled value that lacks this worker's own newest push (the
  // pull was requested before it) gets that push's step applied (the server
  // its momentum share, see pull(tensor, true); the client its gradient's), so
  // the next forward contains the worker's own last gradient; the push after
  // it then declares it was computed on the version that includes it, so the
  // staleness rule counts only other workers' updates. The servers' state
  // (parameters, momentum, moments) is untouched by it.
  bool local_correction = true;
  // Asynchronous modes with SGD momentum: how a push steps the servers'
  // momentum (MomentumRule; PushWeight in ps/optimizer.h). No effect in bsp.
  MomentumRule momentum_rule = MomentumRule::kRescaled;
};

// One applied push, as the server reported it.
struct PushRecord {
  int32_t tensor = 0;
  int32_t key = 0;
  int64_t computed_on = 0;  // version the gradient was computed on
  int64_t applied_at = 0;   // version it was applied to (before the step)
  int64_t staleness = 0;    // applied_at - computed_on
  double lr_factor = 1.0;   // what the staleness rule made of it
};

// All of a worker's applied gradient pushes, aggregated (pushes without a
// gradient are not counted).
struct StalenessSummary {
  int64_t pushes = 0;
  int64_t staleness_sum = 0;
  int64_t max_staleness = 0;
  double lr_factor_sum = 0.0;
  std::map<int64_t, int64_t> histogram;  // tau -> pushes
};

class HEMIOLA_API Client {
 public:
  // `numels`: the trained tensors (float32, contiguous), the same on every
  // worker. Connects to every server (blocking, up to timeout_s).
  Client(const ClientOptions& options, const std::vector<std::string>& names,
         const std::vector<int64_t>& numels, std::shared_ptr<Store> store);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::vector<Shard>& shards() const;

  // Registers with every server; worker 0 sends the initial values (one
  // pointer per tensor), the others pass an empty vector. Then pulls every
  // tensor: call wait_pull before using one.
  void initialize(const std::vector<const float*>& initial, const std::vector<OptimizerHyper>& hyper);
  // Hyper-parameters for the following pushes of `tensor`.
  void set_hyper(int tensor, const OptimizerHyper& hyper);
  // Copies the gradient and sends it; returns at once.
  void push(int tensor, const float* grad);
  // This iteration has no gradient for `tensor` (unused): counts as a push
  // that contributes nothing.
  void push_none(int tensor);
  // Requests the newest parameters of `tensor` (as the consistency model
  // allows). `ahead` (eager with local_correction): the reply is for the
  // forward after this worker's next push, which the server has not applied
  // yet: the server moves it by that push's momentum share and the client,
  // when it takes the reply, by the push's gradient share.
  void pull(int tensor, bool ahead = false);
  // Waits for the latest requested pull of `tensor` and copies it into dst.
  // Returns the seconds it blocked waiting for the reply (0 when it had
  // arrived): eager learns from it which pulls to request ahead.
  double wait_pull(int tensor, float* dst);
  // True when the latest requested pull of `tensor` has arrived.
  bool pull_ready(int tensor);
  // The version of `tensor`'s first shard that wait_pull last delivered: the
  // number of updates the servers had applied to it (in bsp, rounds).
  int64_t version(int tensor) const;
  // Waits until every push so far has been applied (acknowledged).
  void flush();
  // Asks every server to write its snapshot; waits for the confirmations.
  void snapshot();
  // The newest 4096 applied gradient pushes as the servers reported them,
  // oldest first.
  std::vector<PushRecord> push_records() const;
  // Every applied gradient push, aggregated.
  StalenessSummary staleness() const;
  // Waits for the pushes in flight, says goodbye to the servers and closes the
  // connections; later calls return at once, and pushes, pulls and snapshots
  // after it throw. If the pushes cannot be completed it leaves without a
  // goodbye (the servers see a dead worker) and throws. Also done by the
  // destructor.
  void close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hemiola::ps
