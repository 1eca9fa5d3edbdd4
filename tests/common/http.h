// A minimal HTTP client for tests of the metrics server: one request sent to
// 127.0.0.1:<port> as given, the whole answer read until the server closes.
#ifndef PSFLOW_TESTS_COMMON_HTTP_H_
#define PSFLOW_TESTS_COMMON_HTTP_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace psflow::testing_http {

// The whole answer (status line, headers, body) to `request`; "" if nothing
// listens on the port.
inline std::string Exchange(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string answer;
  char buf[8192];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) answer.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return answer;
}

// A GET of `path` in HTTP/1.0.
inline std::string Get(int port, const std::string& path) {
  return Exchange(port, "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
}

// The status code of an answer ("HTTP/1.x 200 OK" gives "200"); "" for none.
inline std::string StatusCode(const std::string& answer) {
  const size_t space = answer.find(' ');
  return space == std::string::npos ? "" : answer.substr(space + 1, 3);
}

}  // namespace psflow::testing_http

#endif  // PSFLOW_TESTS_COMMON_HTTP_H_
