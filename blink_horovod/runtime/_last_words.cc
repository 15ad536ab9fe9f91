// Last words of a process that an uncaught C++ exception is about to abort.
//
// Horovod's background thread does not catch what its controller throws: when a
// rank dies, Gloo's connections to it close and every other rank's background
// thread aborts its process ("terminate called after throwing an instance of
// 'gloo::IoException'") before any Python code can raise.  No rank would say
// which rank died.  This std::terminate handler, installed by
// blink_horovod.runtime.last_words, asks every rank's status port (the one
// ops/peer_status.py answers on) whether it is still there, prints one line
// naming the ranks whose port refuses connections -- their process has exited --
// then lingers a moment, so that ranks aborting a little later still find this
// one alive, and hands over to the handler that was there before (libstdc++'s,
// which prints the exception and aborts).
//
// Only async-signal-tolerant calls after the exception is known: sockets, poll,
// snprintf into fixed buffers, write(2).

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

namespace {

constexpr int kMaxPeers = 4096;

struct Peer {
  int rank;
  int pid;
  sockaddr_in addr;
};

Peer g_peers[kMaxPeers];
int g_npeers = 0;
int g_rank = -1;
int g_probe_ms = 300;
int g_linger_ms = 500;
char g_context[256] = "";
std::terminate_handler g_previous = nullptr;
volatile int g_entered = 0;

// For each peer: 1 if its port refused the connection (gone), 2 if no answer in time (silent), 0 if alive.
void probe(int* verdict) {
  static int fds[kMaxPeers];
  static pollfd pfds[kMaxPeers];
  int n = g_npeers;
  for (int i = 0; i < n; i++) {
    verdict[i] = 2;
    fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    pfds[i].fd = -1;
    pfds[i].events = POLLOUT;
    pfds[i].revents = 0;
    if (fds[i] < 0) continue;
    int rc = connect(fds[i], reinterpret_cast<const sockaddr*>(&g_peers[i].addr), sizeof(sockaddr_in));
    if (rc == 0) {
      verdict[i] = 0;
    } else if (errno == ECONNREFUSED) {
      verdict[i] = 1;
    } else if (errno == EINPROGRESS) {
      pfds[i].fd = fds[i];
    }
  }
  timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    int waiting = 0;
    for (int i = 0; i < n; i++) waiting += pfds[i].fd >= 0;
    if (!waiting) break;
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long spent = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
    if (spent >= g_probe_ms) break;
    if (poll(pfds, n, static_cast<int>(g_probe_ms - spent)) <= 0) continue;
    for (int i = 0; i < n; i++) {
      if (pfds[i].fd < 0 || !pfds[i].revents) continue;
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(pfds[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      verdict[i] = err == 0 ? 0 : err == ECONNREFUSED ? 1 : 2;
      pfds[i].fd = -1;
    }
  }
  for (int i = 0; i < n; i++)
    if (fds[i] >= 0) close(fds[i]);
}

void append(char* buf, size_t cap, const char* fmt, long a, long b) {
  size_t used = strlen(buf);
  if (used + 1 < cap) snprintf(buf + used, cap - used, fmt, a, b);
}

void last_words() {
  if (__sync_lock_test_and_set(&g_entered, 1)) {  // a second thread terminating: only the first speaks
    for (;;) pause();
  }
  char what[512] = "an exception that is not a std::exception";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      snprintf(what, sizeof(what), "%s", x.what());
    } catch (...) {
    }
  } else {
    snprintf(what, sizeof(what), "std::terminate called without an exception");
  }
  static int verdict[kMaxPeers];
  probe(verdict);
  static char gone[2048], silent[1024], line[4096];
  gone[0] = silent[0] = 0;
  int ngone = 0, nsilent = 0;
  for (int i = 0; i < g_npeers; i++) {
    if (verdict[i] == 1) append(gone, sizeof(gone), ngone++ ? ", rank %ld (pid %ld)" : "rank %ld (pid %ld)",
                                g_peers[i].rank, g_peers[i].pid);
    if (verdict[i] == 2) append(silent, sizeof(silent), nsilent++ ? ", %ld" : "%ld", g_peers[i].rank, 0);
  }
  const char* verb = ngone == 1 ? "has" : "have";
  if (ngone)
    snprintf(line, sizeof(line),
             "[blink_horovod ERROR] rank %d: %s %s exited (their status ports refuse connections); Horovod is "
             "aborting this process on what that left behind: %s%s%s%s%s\n",
             g_rank, gone, verb, what, nsilent ? "; ranks not answering: [" : "", silent, nsilent ? "]" : "",
             g_context);
  else
    snprintf(line, sizeof(line),
             "[blink_horovod ERROR] rank %d: an uncaught C++ exception is aborting this process: %s; every "
             "other rank's status port still answers%s%s%s%s\n",
             g_rank, what, nsilent ? " but ranks [" : "", silent, nsilent ? "] (stopped or unreachable)" : "",
             g_context);
  ssize_t ignored = write(2, line, strlen(line));
  (void)ignored;
  timespec linger = {g_linger_ms / 1000, (g_linger_ms % 1000) * 1000000L};
  nanosleep(&linger, nullptr);  // ranks that abort a little later find this one still alive
  if (g_previous) g_previous();
  abort();
}

}  // namespace

extern "C" {

// Install the handler for this process.  peers: n ranks, each with its pid, IPv4 address
// (dotted, "" where none is known: never reported) and status port.  Returns the number of
// peers kept (those with an address; at most kMaxPeers).
int blink_last_words_install(int rank, int n, const int* ranks, const int* pids, const char* const* ipv4,
                             const int* ports, int probe_ms, int linger_ms, const char* context) {
  int kept = 0;
  for (int i = 0; i < n && kept < kMaxPeers; i++) {
    if (!ipv4[i] || !ipv4[i][0] || ranks[i] == rank) continue;
    Peer& p = g_peers[kept];
    memset(&p.addr, 0, sizeof(p.addr));
    p.addr.sin_family = AF_INET;
    p.addr.sin_port = htons(static_cast<uint16_t>(ports[i]));
    if (inet_pton(AF_INET, ipv4[i], &p.addr.sin_addr) != 1) continue;
    p.rank = ranks[i];
    p.pid = pids[i];
    kept++;
  }
  g_npeers = kept;
  g_rank = rank;
  g_probe_ms = probe_ms;
  g_linger_ms = linger_ms;
  snprintf(g_context, sizeof(g_context), "%s", context ? context : "");
  std::terminate_handler previous = std::set_terminate(last_words);
  if (previous != last_words) g_previous = previous;
  return kept;
}

// Put back the handler that was there before (the job this one named is over); 1 if it was ours.
int blink_last_words_uninstall(void) {
  std::terminate_handler current = std::get_terminate();
  if (current != last_words) return 0;
  std::set_terminate(g_previous);
  g_npeers = 0;
  return 1;
}

// Run the handler as Horovod's thread would reach it (tests): throws, uncaught, on a new thread.
void blink_last_words_selftest(const char* message);

}  // extern "C"

void blink_last_words_selftest(const char* message) {
  std::string text(message);
  std::thread([text] { throw std::runtime_error(text); }).join();
}
