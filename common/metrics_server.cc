#include "common/metrics_server.h"

#include <civetweb.h>

#include <cstring>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log.h"

namespace psflow::metrics {
namespace {

// civetweb's own messages (a failed accept, a bad request) go to psflow's
// log instead of stderr.
int LogMessage(const struct mg_connection*, const char* message) {
  PSLOG(WARNING) << "metrics server: " << message;
  return 1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(int port,
                                                                    const Registry* registry,
                                                                    std::function<bool()> ready) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });  // once per process, never undone
  std::unique_ptr<MetricsServer> server(new MetricsServer(registry, std::move(ready)));
  const std::string ports = absl::StrCat("0.0.0.0:", port);
  // A scrape is one short request: two threads answer it, idle
  // connections are not kept for long.
  const char* options[] = {"listening_ports",    ports.c_str(), "num_threads", "2",
                           "request_timeout_ms", "10000",       nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.log_message = &LogMessage;
  mg_init_data init_data;
  std::memset(&init_data, 0, sizeof(init_data));
  init_data.callbacks = &callbacks;
  init_data.user_data = server.get();
  init_data.configuration_options = options;
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error;
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);
  server->context_ = mg_start2(&init_data, &error);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on port ", port, ": ",
                     error_text[0] != '\0' ? error_text : "it is in use or not allowed"));
  }
  mg_server_port bound[4];
  const int n = mg_get_server_ports(server->context_, 4, bound);
  server->port_ = n > 0 ? bound[0].port : port;
  mg_set_request_handler(server->context_, "/metrics$", &MetricsServer::Handle, server.get());
  mg_set_request_handler(server->context_, "/healthz$", &MetricsServer::HandleHealth, server.get());
  if (server->ready_) {
    mg_set_request_handler(server->context_, "/readyz$", &MetricsServer::HandleReady, server.get());
  }
  return server;
}

MetricsServer::~MetricsServer() {
  if (context_ != nullptr) mg_stop(context_);
}

int MetricsServer::Handle(mg_connection* connection, void* server) {
  const mg_request_info* request = mg_get_request_info(connection);
  const absl::string_view method = request->request_method;
  if (method != "GET" && method != "HEAD") {
    mg_send_http_error(connection, 405, "%s", "only GET and HEAD");
    return 405;
  }
  const std::string body = static_cast<MetricsServer*>(server)->registry_->Render();
  mg_send_http_ok(connection, kContentType, static_cast<long long>(body.size()));
  if (method == "GET") mg_write(connection, body.data(), body.size());
  return 200;
}

namespace {

// A short plain-text answer with `status` (200 or 503) to GET or HEAD.
int Answer(mg_connection* connection, int status, absl::string_view body) {
  const absl::string_view method = mg_get_request_info(connection)->request_method;
  if (method != "GET" && method != "HEAD") {
    mg_send_http_error(connection, 405, "%s", "only GET and HEAD");
    return 405;
  }
  mg_response_header_start(connection, status);
  mg_response_header_add(connection, "Content-Type", "text/plain; charset=utf-8", -1);
  mg_response_header_add(connection, "Content-Length", std::to_string(body.size()).c_str(), -1);
  mg_response_header_add(connection, "Cache-Control", "no-store", -1);
  mg_response_header_send(connection);
  if (method == "GET") mg_write(connection, body.data(), body.size());
  return status;
}

}  // namespace

int MetricsServer::HandleHealth(mg_connection* connection, void*) {
  return Answer(connection, 200, "ok\n");
}

int MetricsServer::HandleReady(mg_connection* connection, void* server) {
  return static_cast<MetricsServer*>(server)->ready_() ? Answer(connection, 200, "ready\n")
                                                       : Answer(connection, 503, "not ready\n");
}

}  // namespace psflow::metrics
