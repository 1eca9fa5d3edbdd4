#include "role/metrics_server.h"

#include <microhttpd.h>

#include <cstdarg>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log.h"

namespace psflow::metrics {
namespace {

// The threads' own stack. A role's static TLS (cuBLAS's is near 100 KiB)
// comes out of each thread's stack: a small fixed stack would not even start.
constexpr size_t kThreadStack = size_t{1} << 20;

// libmicrohttpd's own messages (a failed accept, a bad request) go to
// psflow's log instead of stderr.
void LogMessage(void*, const char* format, va_list args) {
  char text[512];
  std::vsnprintf(text, sizeof(text), format, args);
  std::string line(text);
  while (!line.empty() && line.back() == '\n') line.pop_back();
  PSLOG(WARNING) << "metrics server: " << line;
}

// Queues a plain answer with `status`; HEAD gets the headers alone (the
// library leaves the body out).
MHD_Result Answer(MHD_Connection* connection, unsigned status, absl::string_view content_type,
                  const std::string& body) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", std::string(content_type).c_str());
  MHD_add_response_header(response, "Cache-Control", "no-store");
  const MHD_Result queued = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return queued;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(int port,
                                                                    const Registry* registry,
                                                                    std::function<bool()> ready) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", port, " is not in 0..65535"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer(registry, std::move(ready)));
  // A scrape is one short request: two threads answer, idle connections
  // are closed after 10 s. The logger is the first option: libmicrohttpd
  // reads them in order, prints what comes before it to stderr, and warns
  // (there) of a logger that is not first.
  server->daemon_ = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, static_cast<uint16_t>(port), nullptr,
      nullptr, &MetricsServer::Handle, server.get(), MHD_OPTION_EXTERNAL_LOGGER, &LogMessage,
      nullptr, MHD_OPTION_THREAD_POOL_SIZE, 2u, MHD_OPTION_THREAD_STACK_SIZE, kThreadStack,
      MHD_OPTION_CONNECTION_TIMEOUT, 10u, MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on port ", port, ": it is in use or not allowed"));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr && info->port != 0 ? info->port : port;
  return server;
}

MetricsServer::~MetricsServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

MHD_Result MetricsServer::Handle(void* self, MHD_Connection* connection, const char* url,
                                 const char* method, const char*, const char*, size_t* upload_size,
                                 void** request) {
  // The first call of a request only announces it; answer on the second.
  static int announced;
  if (*request == nullptr) {
    *request = &announced;
    return MHD_YES;
  }
  if (*upload_size != 0) {  // no request of ours has a body
    *upload_size = 0;
    return MHD_YES;
  }
  const absl::string_view verb = method;
  if (verb != "GET" && verb != "HEAD") {
    return Answer(connection, 405, "text/plain; charset=utf-8", "only GET and HEAD\n");
  }
  const auto* server = static_cast<const MetricsServer*>(self);
  const absl::string_view path = url;
  if (path == "/metrics") return Answer(connection, 200, kContentType, server->registry_->Render());
  if (path == "/healthz") return Answer(connection, 200, "text/plain; charset=utf-8", "ok\n");
  if (path == "/readyz" && server->ready_) {
    return server->ready_() ? Answer(connection, 200, "text/plain; charset=utf-8", "ready\n")
                            : Answer(connection, 503, "text/plain; charset=utf-8", "not ready\n");
  }
  return Answer(connection, 404, "text/plain; charset=utf-8", "not found\n");
}

}  // namespace psflow::metrics
