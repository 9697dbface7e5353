// hps::Client over the generated hps.v1 stubs. Keys travel as packed little-endian int64 bytes and rows as packed
// little-endian float32 bytes (protos/hps/v1/embedding.proto): on a little-endian host both are a memcpy.
#include "hps/client.h"

#include <cstring>
#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/support/channel_arguments.h>

#include "hps/v1/embedding.grpc.pb.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "hps::Client copies packed little-endian keys and rows");

namespace hps {

namespace {

grpc::Status Malformed(const std::string& table, const std::string& what) {
  return grpc::Status(grpc::StatusCode::INTERNAL, "table '" + table + "': malformed answer: " + what);
}

// Checks one answered table against the keys asked and copies its rows and sources into `rows`.
grpc::Status DecodeTable(const v1::TableVectors& answer, std::size_t keys, Rows* rows) {
  if (answer.storage() != v1::ROW_STORAGE_FP32) {
    return Malformed(answer.table(), "rows stored as RowStorage " + std::to_string(answer.storage()) +
                                         " in an answer asked as float32");
  }
  const std::size_t values = static_cast<std::size_t>(answer.count()) * answer.dim();
  if (answer.count() != keys || answer.vectors().size() != values * sizeof(float) ||
      answer.sources().size() != keys) {
    return Malformed(answer.table(), std::to_string(answer.count()) + " rows of dim " + std::to_string(answer.dim()) +
                                         " in " + std::to_string(answer.vectors().size()) + " bytes and " +
                                         std::to_string(answer.sources().size()) + " sources for " +
                                         std::to_string(keys) + " keys");
  }
  rows->dim = answer.dim();
  rows->vectors.resize(values);
  std::memcpy(rows->vectors.data(), answer.vectors().data(), answer.vectors().size());
  rows->sources.resize(keys);
  for (std::size_t i = 0; i < keys; ++i) {
    rows->sources[i] = static_cast<Source>(static_cast<std::uint8_t>(answer.sources()[i]));
  }
  return grpc::Status::OK;
}

}  // namespace

const char* SourceName(Source source) {
  switch (source) {
    case Source::kCache: return "cache";
    case Source::kVolatile: return "volatile";
    case Source::kPersistent: return "persistent";
    case Source::kDefault: return "default";
    case Source::kExpired: return "expired";
    default: return "unspecified";
  }
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  return grpc::CreateCustomChannel(target, credentials, args);
}

struct Client::Impl {
  std::unique_ptr<v1::EmbeddingService::Stub> stub;
  std::string authorization;  // "Bearer <token>", or empty
};

Client::Client(const std::string& target) : Client(MakeChannel(target, grpc::InsecureChannelCredentials())) {}

Client::Client(std::shared_ptr<grpc::Channel> channel, std::string token)
    : impl_(new Impl{v1::EmbeddingService::NewStub(std::move(channel)),
                     token.empty() ? std::string() : "Bearer " + token}) {}

Client::~Client() = default;
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;

grpc::Status Client::Lookup(const std::string& model, const std::string& table,
                            const std::vector<std::int64_t>& keys, Rows* rows, const LookupOptions& options) const {
  *rows = Rows();
  v1::LookupRequest request;
  request.set_model(model);
  request.set_precision(v1::PRECISION_FP32);
  if (options.version.has_value()) request.set_version(*options.version);
  request.set_label(options.label);
  v1::TableKeys* asked = request.add_tables();
  asked->set_table(table);
  asked->set_keys(reinterpret_cast<const char*>(keys.data()), keys.size() * sizeof(std::int64_t));

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options.timeout);
  if (!impl_->authorization.empty()) context.AddMetadata("authorization", impl_->authorization);
  v1::LookupResponse response;
  grpc::Status status = impl_->stub->Lookup(&context, request, &response);
  if (!status.ok()) return status;
  if (response.tables_size() != 1 || response.tables(0).table() != table) {
    return Malformed(table, std::to_string(response.tables_size()) + " tables answered for one asked");
  }
  Rows answered;
  answered.version = response.version();
  status = DecodeTable(response.tables(0), keys.size(), &answered);
  if (status.ok()) *rows = std::move(answered);
  return status;
}

}  // namespace hps
