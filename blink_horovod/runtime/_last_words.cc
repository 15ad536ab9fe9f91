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
// A library loaded after this one may set a terminate handler of its own, and a process may carry a
// second copy of libstdc++ whose handler this one cannot see (seen with CUDA tensors under torch: the
// survivors printed libstdc++'s "terminate called after throwing ..." and aborted, ours silent).  Either
// way the process ends in abort(): a SIGABRT handler says the same line when ours has not spoken (the
// exception's text was printed just before, by whoever aborted), then hands the signal to the action that
// was there before.
//
// Only async-signal-tolerant calls after the exception is known: sockets, poll,
// snprintf into fixed buffers, write(2).

#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
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
volatile int g_entered = 0;          // set by the first thread that speaks
volatile pthread_t g_speaker;        // that thread: if it comes back in, a handler chained back to ours
volatile int g_abort_entries = 0;
struct sigaction g_previous_abort;
volatile int g_abort_installed = 0;

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

// Probe the peers and print the one line naming those that exited.  ``kind`` is what is aborting
// the process, ``what`` what it said.
void speak(const char* kind, const char* what) {
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
             "[blink_horovod ERROR] rank %d: %s is aborting this process: %s; every "
             "other rank's status port still answers%s%s%s%s\n",
             g_rank, kind, what, nsilent ? " but ranks [" : "", silent, nsilent ? "] (stopped or unreachable)" : "",
             g_context);
  ssize_t ignored = write(2, line, strlen(line));
  (void)ignored;
  timespec linger = {g_linger_ms / 1000, (g_linger_ms % 1000) * 1000000L};
  nanosleep(&linger, nullptr);  // ranks that abort a little later find this one still alive
}

// True for the first caller, which then speaks; false for any later one.
bool first_to_speak() {
  if (__sync_lock_test_and_set(&g_entered, 1)) return false;
  g_speaker = pthread_self();
  return true;
}

void last_words() {
  if (!first_to_speak()) {
    // Our line is out.  The same thread back here means a handler we handed over to chained back
    // to ours: end it.  Another thread terminating too: only the first speaks; this one waits for it.
    if (pthread_equal(g_speaker, pthread_self())) abort();
    for (;;) pause();
  }
  char what[600] = "an uncaught C++ exception that is not a std::exception";
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
  speak("an uncaught C++ exception", what);
  if (g_previous && g_previous != last_words) g_previous();
  abort();
}

// SIGABRT without our terminate handler having spoken: someone else's handler (or a second copy of
// libstdc++) printed the exception and aborted.  Say our line, then the previous action runs.
void on_abort(int sig) {
  if (__sync_add_and_fetch(&g_abort_entries, 1) == 1 && g_npeers > 0 && first_to_speak())
    speak("an abort (SIGABRT)", "the lines before this one say what aborted it");
  if (g_abort_entries > 1 || g_previous_abort.sa_handler == SIG_IGN) {
    signal(sig, SIG_DFL);  // a previous action that sent it back here: end as abort() would
  } else {
    sigaction(sig, &g_previous_abort, nullptr);
  }
  raise(sig);  // blocked while this handler runs: delivered to that action as it returns
}

void install_abort_handler() {
  struct sigaction ours;
  memset(&ours, 0, sizeof(ours));
  ours.sa_handler = on_abort;
  sigemptyset(&ours.sa_mask);
  struct sigaction before;
  if (sigaction(SIGABRT, &ours, &before) == 0) {
    if (before.sa_handler != on_abort) g_previous_abort = before;
    g_abort_installed = 1;
  }
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
  install_abort_handler();
  return kept;
}

// Put back the handler that was there before (the job this one named is over); 1 if it was ours.
int blink_last_words_uninstall(void) {
  if (g_abort_installed) {
    struct sigaction now;
    if (sigaction(SIGABRT, nullptr, &now) == 0 && now.sa_handler == on_abort)
      sigaction(SIGABRT, &g_previous_abort, nullptr);
    g_abort_installed = 0;
  }
  std::terminate_handler current = std::get_terminate();
  if (current != last_words) return 0;
  std::set_terminate(g_previous);
  g_npeers = 0;
  return 1;
}

// Replace the terminate handler as a library loaded later might (tests): ``chain`` makes the newcomer
// hand over to the handler it replaced, as well-behaved ones do.
void blink_last_words_selftest_replace(int chain);

// Run the handler as Horovod's thread would reach it (tests): throws, uncaught, on a new thread.
void blink_last_words_selftest(const char* message);

}  // extern "C"

namespace {
std::terminate_handler g_replaced = nullptr;
int g_chain = 0;
void newcomer() {
  const char line[] = "newcomer's terminate handler\n";
  ssize_t ignored = write(2, line, sizeof(line) - 1);
  (void)ignored;
  if (g_chain && g_replaced) g_replaced();
  abort();
}
}  // namespace

void blink_last_words_selftest_replace(int chain) {
  g_chain = chain;
  g_replaced = std::set_terminate(newcomer);
}

void blink_last_words_selftest(const char* message) {
  std::string text(message);
  std::thread([text] { throw std::runtime_error(text); }).join();
}
