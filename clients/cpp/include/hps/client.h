// hps::Client: embedding lookups from a running hps-service over gRPC (hps.v1.EmbeddingService).
//
//   hps::Client client("127.0.0.1:8500");
//   hps::Rows rows;
//   grpc::Status status = client.Lookup("demo", "item", {1, 2, 3}, &rows);
//   if (!status.ok()) { /* status.error_code(), status.error_message() */ }
//   const float* first = rows.row(0);  // rows.dim floats; rows.sources[0] says which level answered
//
// A Client is thread-safe and cheap to share: every call goes over its one channel.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/status.h>

namespace hps {

// Which level of the hierarchy answered a key (hps.v1.Source).
enum class Source : std::uint8_t {
  kUnspecified = 0,
  kCache = 1,       // L1 embedding cache
  kVolatile = 2,    // L2 hash map or Redis Cluster
  kPersistent = 3,  // L3 RocksDB
  kDefault = 4,     // stored nowhere: the table's default vector
  kExpired = 5,     // stored, but older than the table's ttl_s: the default vector
};

// "cache", "volatile", "persistent", "default", "expired", or "unspecified" (the names `hps lookup` prints).
const char* SourceName(Source source);

// The rows of one lookup, in the order the keys were asked (duplicates included).
struct Rows {
  std::uint32_t dim = 0;         // floats per row
  std::vector<float> vectors;    // size() * dim floats, row-major
  std::vector<Source> sources;   // one per key
  std::uint32_t version = 0;     // the version of the model that answered (0: the model as configured)

  std::size_t size() const { return sources.size(); }
  const float* row(std::size_t i) const { return vectors.data() + i * dim; }
};

// Per call: the deadline, and which version of the model to read.
struct LookupOptions {
  std::chrono::milliseconds timeout{5000};  // the call's deadline, from when it starts
  std::optional<std::uint32_t> version;     // a version of the model (0: the model as configured)
  std::string label;                        // or a label of it ("": "production" when set, else as configured)
};

class Client {
 public:
  // An insecure channel to `target` ("host:port" or a gRPC name such as "dns:///hps.ml:8500").
  explicit Client(const std::string& target);
  // A channel of the caller's (TLS: grpc::SslCredentials); a non-empty `token` is sent as
  // "authorization: Bearer <token>" on every call, for a server with server.auth on.
  explicit Client(std::shared_ptr<grpc::Channel> channel, std::string token = "");
  ~Client();
  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;

  // The rows of `keys` in `table` of `model`, and the level that answered each. On failure `rows` is left empty
  // and the status carries the server's code and message (NOT_FOUND for a model or table it does not serve,
  // DEADLINE_EXCEEDED when `options.timeout` passed first).
  grpc::Status Lookup(const std::string& model, const std::string& table, const std::vector<std::int64_t>& keys,
                      Rows* rows, const LookupOptions& options = {}) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The channel Client(target) opens: no limit on message sizes (a large batch of rows is one message), keepalive on.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           const std::shared_ptr<grpc::ChannelCredentials>& credentials);

}  // namespace hps
