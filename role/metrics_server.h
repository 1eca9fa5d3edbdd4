// Serves a metrics::Registry over HTTP: GET /metrics answers the registry's
// Render() as "text/plain; version=0.0.4" (the Prometheus text exposition
// format), on 0.0.0.0:<port>, from two threads of its own (libmicrohttpd's,
// with 1 MiB stacks: a role's static TLS comes out of every thread's stack).
// It also answers HTTP probes (the kubelet's httpGet, which needs no TLS and
// no token, unlike the gRPC health service of a secured role): /healthz is
// 200 while the server runs (liveness), /readyz 200 while `ready` says so and
// 503 otherwise (readiness; 404 without `ready`). Every other path is 404,
// every other method 405.
//
// Thread-safe; the registry must outlive the server. Stop (or destroy) the
// server before anything the registry's function series read goes away.
#ifndef PSFLOW_ROLE_METRICS_SERVER_H_
#define PSFLOW_ROLE_METRICS_SERVER_H_

#include <microhttpd.h>

#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace psflow::metrics {

class MetricsServer {
 public:
  // Listens on `port` (0: a free port the system picks; see port()).
  // UNAVAILABLE naming the port if it cannot listen there (in use, say).
  // `ready` (may be null) answers /readyz; it must be thread-safe and stay
  // callable while the server runs.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      int port, const Registry* registry, std::function<bool()> ready = nullptr);
  // Stops: waits for the requests being answered.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The port it listens on.
  int port() const { return port_; }

 private:
  MetricsServer(const Registry* registry, std::function<bool()> ready)
      : registry_(registry), ready_(std::move(ready)) {}
  // libmicrohttpd's access handler: /metrics, /healthz, /readyz.
  static MHD_Result Handle(void* self, MHD_Connection* connection, const char* url,
                           const char* method, const char* version, const char* upload,
                           size_t* upload_size, void** request);

  const Registry* const registry_;
  const std::function<bool()> ready_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

// The Content-Type of /metrics.
inline constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace psflow::metrics

#endif  // PSFLOW_ROLE_METRICS_SERVER_H_
