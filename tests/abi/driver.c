/*
 * ABI conformance driver for a NCCL net plugin, run by tests/abi.rs.
 *
 *   driver <path to librailover.so> <version 8..12> [seed]
 *
 * Two processes (forked before dlopen, like two ranks on two "nodes") each
 * dlopen the plugin with RTLD_NOW|RTLD_LOCAL and dlsym ncclNetPlugin_v<N>,
 * then drive it the way NCCL's proxy does (docs/design.md §8.1): init per
 * communicator (v11+) or per process (v8-v10), non-blocking listen/connect/
 * accept polled in a loop, handles shipped out of band, up to 8 requests in
 * flight per comm with only the oldest one tested, NULL requests retried,
 * request slots pre-loaded with 0x1 or stale pointers, sizes arrays that may
 * be NULL. The parent is the receiver of the main comm, the child its sender.
 *
 * Every check prints "PASS <role>.<test>" or "FAIL <role>.<test>: <reason>";
 * the process exits 0 only if all its checks passed (the parent also requires
 * the child to exit 0). Only the loopback interface is used
 * (RAILOVER_IFNAME=lo). An alarm bounds the whole run.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl_net.h"

#define MAX_INFLIGHT 8           /* NCCL_STEPS: requests in flight per NCCL connection */
#define MAX_REQUESTS 32          /* NCCL_NET_MAX_REQUESTS: what every comm must accept */
#define MAX_SLOTS (MAX_REQUESTS + 1)
#define PROXY_MAX_SUBS 64        /* size of the arrays NCCL passes to irecv/test */
#define GUARD 256                /* bytes after each receive buffer that must stay intact */
#define GUARD_BYTE 0xEE
#define SETUP_DEADLINE_S 30      /* connect/accept polling */
#define DATA_DEADLINE_S 120      /* one data phase */
#define TRUNC_DEADLINE_S 10      /* the oversize send must complete within this */
#define CTL_TIMEOUT_MS 150000    /* waiting for the peer process */
#define OVERALL_ALARM_S 280      /* whole run, per process */
#define CLOSE_MAX_S 5.0          /* a close must not wait for the peer */
#define TEST_MAX_S 2.0           /* test() must not block (generous: the host is shared) */
#define SIZES_SENTINEL (-7)

/* ------------------------------------------------------------ reporting */

static const char* g_role = "?";
static int g_version;
static pid_t g_child = 0;
static volatile int g_failures = 0;
static int g_verbose = 0;
static const char* volatile g_phase = "startup";
static __thread const char* t_phase = NULL;
/* A value no plugin can return as a request: the address of this variable. */
static char g_stale_request;
#define STALE ((void*)&g_stale_request)

/* Whether the plugin reports NCCL_PTR_CUDA (then regMr(NCCL_PTR_CUDA) must succeed), and
 * the type the data streams register their buffers as: RAILOVER_ABI_PTR=cuda registers
 * host memory as GPU memory, which the plugin must then never touch with the CPU. */
static int g_gpu_ok = 0;
static int g_data_ptr = NCCL_PTR_HOST;

typedef struct {
  const char* name;
  int failed;
  char reason[512];
} test_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_begin(test_t* t, const char* name) {
  t->name = name;
  t->failed = 0;
  t->reason[0] = 0;
  t_phase = name;
  g_phase = name;
}

/* Records a failure; the first reason becomes the summary, every one is printed. */
__attribute__((format(printf, 2, 3))) static void test_fail(test_t* t, const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!t->failed) snprintf(t->reason, sizeof t->reason, "%s", msg);
  t->failed++;
  printf("  [%s %s] check failed: %s\n", g_role, t->name, msg);
}

#define CHECK(t, cond, ...) ((cond) ? 1 : (test_fail((t), __VA_ARGS__), 0))

static int test_end(test_t* t) {
  if (t->failed) {
    __atomic_add_fetch(&g_failures, 1, __ATOMIC_SEQ_CST);
    printf("FAIL %s.%s: %s%s\n", g_role, t->name, t->reason,
           t->failed > 1 ? " (and more, see above)" : "");
  } else {
    printf("PASS %s.%s\n", g_role, t->name);
  }
  return !t->failed;
}

static void note(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void note(const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  printf("  [%s] %s\n", g_role, msg);
}

/* Async-signal-safe: builds the line in a local buffer and writes it at once. */
static void append(char* buf, size_t cap, size_t* len, const char* s) {
  while (*s && *len + 1 < cap) buf[(*len)++] = *s++;
}

static void on_fatal_signal(int sig) {
  const char* phase = t_phase ? t_phase : g_phase;
  char line[256];
  size_t len = 0;
  append(line, sizeof line, &len, "FAIL ");
  append(line, sizeof line, &len, g_role);
  append(line, sizeof line, &len, ".");
  append(line, sizeof line, &len, phase ? phase : "?");
  if (sig == SIGALRM) {
    append(line, sizeof line, &len, ": overall timeout (alarm)");
  } else {
    append(line, sizeof line, &len, ": crashed with signal ");
    append(line, sizeof line, &len,
           sig == SIGSEGV   ? "SIGSEGV"
           : sig == SIGBUS  ? "SIGBUS"
           : sig == SIGABRT ? "SIGABRT"
           : sig == SIGFPE  ? "SIGFPE"
           : sig == SIGPIPE ? "SIGPIPE (a write to a closed socket without MSG_NOSIGNAL)"
                            : "SIGILL");
  }
  append(line, sizeof line, &len, "\n");
  ssize_t r = write(STDOUT_FILENO, line, len);
  (void)r;
  if (g_child > 0) {
    kill(g_child, SIGKILL);
    waitpid(g_child, NULL, 0);
  }
  _exit(sig == SIGALRM ? 124 : 128 + sig);
}

static void install_signal_handlers(void) {
  /* SIGPIPE keeps its fatal meaning (C/C++ NCCL applications do not ignore it): a
   * plugin writing to a closed socket without MSG_NOSIGNAL is caught here. */
  int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL, SIGPIPE, SIGALRM};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fatal_signal;
    sa.sa_flags = SA_RESETHAND;
    sigaction(sigs[i], &sa, NULL);
  }
}

/* ------------------------------------------------------------ the logger NCCL hands in */

static int g_warn_count = 0;

static const char* level_name(ncclDebugLogLevel level) {
  switch (level) {
    case NCCL_LOG_NONE: return "NONE";
    case NCCL_LOG_VERSION: return "VERSION";
    case NCCL_LOG_WARN: return "WARN";
    case NCCL_LOG_INFO: return "INFO";
    case NCCL_LOG_ABORT: return "ABORT";
    case NCCL_LOG_TRACE: return "TRACE";
  }
  return "LEVEL?";
}

/* Same type as NCCL's ncclDebugLog: variadic, printf-style, callable from any thread. */
static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                   const char* fmt, ...) {
  (void)flags;
  if (level == NCCL_LOG_WARN) __atomic_add_fetch(&g_warn_count, 1, __ATOMIC_SEQ_CST);
  if (level == NCCL_LOG_TRACE && !g_verbose) return;
  va_list ap;
  va_start(ap, fmt);
  flockfile(stdout);
  fprintf(stdout, "[%d] %s ", (int)getpid(), level_name(level));
  if (fmt)
    vfprintf(stdout, fmt, ap);
  else
    fputs("(null fmt)", stdout);
  if (level == NCCL_LOG_WARN && file) fprintf(stdout, " (%s:%d)", file, line);
  fputc('\n', stdout);
  funlockfile(stdout);
  va_end(ap);
}

/* A loaded profiler's callback is a no-op for unknown events: so is this one. */
static ncclResult_t profiler_callback(void** eHandle, int type, void* pHandle, int64_t pluginId,
                                      void* extData) {
  (void)type;
  (void)pHandle;
  (void)pluginId;
  (void)extData;
  if (eHandle) *eHandle = NULL;
  return ncclSuccess;
}

/* ------------------------------------------------------------ the plugin, version-independent */

static struct {
  void* dl;
  int v;
  ncclNet_v8_t* v8;
  ncclNet_v9_t* v9;
  ncclNet_v10_t* v10;
  ncclNet_v11_t* v11;
  ncclNet_v12_t* v12;
  int ndev;
  int maxRecvs;
} P;

/* Calls member m of whichever table is loaded, with arguments that are the same in all. */
#define NET_CALL(m, ...)                                                     \
  (P.v == 12   ? P.v12->m(__VA_ARGS__)                                       \
   : P.v == 11 ? P.v11->m(__VA_ARGS__)                                       \
   : P.v == 10 ? P.v10->m(__VA_ARGS__)                                       \
   : P.v == 9  ? P.v9->m(__VA_ARGS__)                                        \
               : P.v8->m(__VA_ARGS__))

static const char* net_name(void) {
  return P.v == 12 ? P.v12->name
         : P.v == 11 ? P.v11->name
         : P.v == 10 ? P.v10->name
         : P.v == 9 ? P.v9->name
                    : P.v8->name;
}

/* v11/v12: once per communicator with a stack config; v8-v10: once per process. */
static ncclResult_t net_init(void** ctx, uint64_t commId, ncclProfilerCallback_t prof) {
  *ctx = NULL;
  if (P.v >= 11) {
    ncclNetCommConfig_v12_t config = {.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF};
    ncclResult_t r;
    if (P.v == 12)
      r = P.v12->init(ctx, commId, &config, logger, prof);
    else
      r = P.v11->init(ctx, commId, (ncclNetCommConfig_v11_t*)&config, logger, prof);
    /* The config lived on our stack: a plugin that kept the pointer sees this. */
    memset(&config, 0x6B, sizeof config);
    return r;
  }
  if (P.v == 10) return P.v10->init(logger, prof);
  if (P.v == 9) return P.v9->init(logger);
  return P.v8->init(logger);
}

static ncclResult_t net_finalize(void* ctx) {
  if (P.v == 12) return P.v12->finalize(ctx);
  if (P.v == 11) return P.v11->finalize(ctx);
  return ncclSuccess;
}

static ncclResult_t net_devices(int* n) { return NET_CALL(devices, n); }

static ncclResult_t net_listen(void* ctx, int dev, void* handle, void** lc) {
  if (P.v == 12) return P.v12->listen(ctx, dev, handle, lc);
  if (P.v == 11) return P.v11->listen(ctx, dev, handle, lc);
  if (P.v == 10) return P.v10->listen(dev, handle, lc);
  if (P.v == 9) return P.v9->listen(dev, handle, lc);
  return P.v8->listen(dev, handle, lc);
}

static ncclResult_t net_connect(void* ctx, int dev, void* handle, void** sc,
                                ncclNetDeviceHandle_v8_t** dc) {
  if (P.v == 12) return P.v12->connect(ctx, dev, handle, sc, dc);
  if (P.v == 11) return P.v11->connect(ctx, dev, handle, sc, dc);
  if (P.v == 10) {
    /* NCCL's v10 shim passes its own small context holding the traffic class. */
    ncclNetCommConfig_v10_t config = {.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF};
    return P.v10->connect(dev, &config, handle, sc, dc);
  }
  if (P.v == 9) return P.v9->connect(dev, handle, sc, dc);
  return P.v8->connect(dev, handle, sc, dc);
}

static ncclResult_t net_accept(void* lc, void** rc, ncclNetDeviceHandle_v8_t** dc) {
  return NET_CALL(accept, lc, rc, dc);
}

static ncclResult_t net_regmr(void* comm, void* data, size_t size, int type, void** mh) {
  return NET_CALL(regMr, comm, data, size, type, mh);
}

static ncclResult_t net_deregmr(void* comm, void* mh) { return NET_CALL(deregMr, comm, mh); }

static ncclResult_t net_isend(void* sc, void* data, size_t size, int tag, void* mh, void* ph,
                              void** req) {
  if (P.v == 12) return P.v12->isend(sc, data, size, tag, mh, ph, req);
  if (P.v == 11) return P.v11->isend(sc, data, size, tag, mh, ph, req);
  if (P.v == 10) return P.v10->isend(sc, data, size, tag, mh, ph, req);
  if (P.v == 9) return P.v9->isend(sc, data, size, tag, mh, req);
  return P.v8->isend(sc, data, (int)size, tag, mh, req);
}

/* One-buffer grouped receive (n = 1), with NCCL-sized argument arrays. */
static ncclResult_t net_irecv(void* rc, void* data, size_t cap, int tag, void* mh, void* ph,
                              void** req) {
  void* datas[PROXY_MAX_SUBS] = {data};
  size_t sizes[PROXY_MAX_SUBS] = {cap};
  int isizes[PROXY_MAX_SUBS] = {(int)cap};
  int tags[PROXY_MAX_SUBS] = {tag};
  void* mhs[PROXY_MAX_SUBS] = {mh};
  void* phs[PROXY_MAX_SUBS] = {ph};
  if (P.v == 12) return P.v12->irecv(rc, 1, datas, sizes, tags, mhs, phs, req);
  if (P.v == 11) return P.v11->irecv(rc, 1, datas, sizes, tags, mhs, phs, req);
  if (P.v == 10) return P.v10->irecv(rc, 1, datas, sizes, tags, mhs, phs, req);
  if (P.v == 9) return P.v9->irecv(rc, 1, datas, sizes, tags, mhs, req);
  return P.v8->irecv(rc, 1, datas, isizes, tags, mhs, req);
}

/* Grouped receive of n buffers (1 <= n <= maxRecvs), one tag and capacity each. */
static ncclResult_t net_irecvn(void* rc, int n, void** data, const size_t* caps, const int* tag,
                               void** mh, void** req) {
  void* datas[PROXY_MAX_SUBS] = {0};
  size_t sizes[PROXY_MAX_SUBS] = {0};
  int isizes[PROXY_MAX_SUBS] = {0};
  int tags[PROXY_MAX_SUBS] = {0};
  void* mhs[PROXY_MAX_SUBS] = {0};
  void* phs[PROXY_MAX_SUBS] = {0};
  for (int i = 0; i < n; i++) {
    datas[i] = data[i];
    sizes[i] = caps[i];
    isizes[i] = (int)caps[i];
    tags[i] = tag[i];
    mhs[i] = mh[i];
  }
  if (P.v == 12) return P.v12->irecv(rc, n, datas, sizes, tags, mhs, phs, req);
  if (P.v == 11) return P.v11->irecv(rc, n, datas, sizes, tags, mhs, phs, req);
  if (P.v == 10) return P.v10->irecv(rc, n, datas, sizes, tags, mhs, phs, req);
  if (P.v == 9) return P.v9->irecv(rc, n, datas, sizes, tags, mhs, req);
  return P.v8->irecv(rc, n, datas, isizes, tags, mhs, req);
}

static ncclResult_t net_iflush(void* rc, void* data, int size, void* mh, void** req) {
  void* datas[PROXY_MAX_SUBS] = {data};
  int sizes[PROXY_MAX_SUBS] = {size};
  void* mhs[PROXY_MAX_SUBS] = {mh};
  return NET_CALL(iflush, rc, 1, datas, sizes, mhs, req);
}

static ncclResult_t net_test(void* req, int* done, int* sizes) {
  return NET_CALL(test, req, done, sizes);
}
static ncclResult_t net_close_send(void* c) { return NET_CALL(closeSend, c); }
static ncclResult_t net_close_recv(void* c) { return NET_CALL(closeRecv, c); }
static ncclResult_t net_close_listen(void* c) { return NET_CALL(closeListen, c); }

static int is_arg_error(ncclResult_t r) {
  return r == ncclInvalidArgument || r == ncclInternalError;
}

/* ------------------------------------------------------------ control channel to the peer */

enum {
  MSG_HANDLE = 1,
  MSG_BARRIER,
  MSG_READY,
  MSG_RESULT,
  MSG_CLOSED,
  MSG_ABORT
};

typedef struct {
  uint32_t type;
  uint32_t a;
  uint64_t b;
  unsigned char data[NCCL_NET_HANDLE_MAXSIZE];
} ctl_msg_t;

typedef struct {
  int fd;
  int have_pending;
  ctl_msg_t pending;
  int peer_gone; /* EOF, error or ABORT seen */
} ctl_t;

static int ctl_send(ctl_t* c, uint32_t type, uint32_t a, uint64_t b, const void* data) {
  ctl_msg_t m;
  memset(&m, 0, sizeof m);
  m.type = type;
  m.a = a;
  m.b = b;
  if (data) memcpy(m.data, data, sizeof m.data);
  ssize_t n = send(c->fd, &m, sizeof m, MSG_NOSIGNAL);
  return n == (ssize_t)sizeof m ? 0 : -1;
}

/* Reads one message into c->pending if one is there within timeout_ms. 1 = got one. */
static int ctl_fill(ctl_t* c, int timeout_ms) {
  if (c->have_pending) return 1;
  if (c->peer_gone) return -1;
  struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
  int r = poll(&pfd, 1, timeout_ms);
  if (r == 0) return 0;
  if (r < 0) return errno == EINTR ? 0 : -1;
  ssize_t n = recv(c->fd, &c->pending, sizeof c->pending, 0);
  if (n != (ssize_t)sizeof c->pending) {
    c->peer_gone = 1;
    return -1;
  }
  if (c->pending.type == MSG_ABORT) {
    c->peer_gone = 1;
    return -1;
  }
  c->have_pending = 1;
  return 1;
}

/* Non-blocking: has the peer given up? */
static int ctl_peer_aborted(ctl_t* c) {
  if (!c->have_pending) ctl_fill(c, 0);
  return c->peer_gone;
}

/* Waits for a message of the given type; anything else is a protocol error. */
static int ctl_recv(ctl_t* c, uint32_t type, ctl_msg_t* out, int timeout_ms, test_t* t) {
  double deadline = now_s() + timeout_ms / 1000.0;
  for (;;) {
    int left = (int)((deadline - now_s()) * 1000);
    if (left < 0) left = 0;
    int r = ctl_fill(c, left > 1000 ? 1000 : left);
    if (r < 0) {
      test_fail(t, "peer process failed or went away (waiting for control message %u)", type);
      return -1;
    }
    if (r == 1) break;
    if (now_s() > deadline) {
      test_fail(t, "timed out after %d ms waiting for control message %u from the peer",
                timeout_ms, type);
      return -1;
    }
  }
  c->have_pending = 0;
  if (c->pending.type != type) {
    test_fail(t, "control protocol: expected message %u, got %u", type, c->pending.type);
    return -1;
  }
  if (out) *out = c->pending;
  return 0;
}

static int barrier(ctl_t* c, uint32_t id, test_t* t) {
  ctl_msg_t m;
  if (ctl_send(c, MSG_BARRIER, id, 0, NULL) != 0) {
    test_fail(t, "cannot reach the peer process");
    return -1;
  }
  if (ctl_recv(c, MSG_BARRIER, &m, CTL_TIMEOUT_MS, t) != 0) return -1;
  if (m.a != id) {
    test_fail(t, "barrier mismatch: mine %u, peer %u", id, m.a);
    return -1;
  }
  return 0;
}

static void ctl_abort(ctl_t* c) { ctl_send(c, MSG_ABORT, 0, 0, NULL); }

/* ------------------------------------------------------------ payload patterns and sizes */

static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

static uint64_t xorshift64(uint64_t* s) {
  uint64_t x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *s = x;
}

/* Every payload byte is a function of (seed, stream, message index, byte offset). */
static uint64_t msg_key(uint64_t seed, uint32_t stream, uint32_t idx) {
  return splitmix64(seed ^ splitmix64(((uint64_t)stream << 32) | idx));
}

static void fill_pattern(unsigned char* p, size_t n, uint64_t key) {
  size_t off = 0;
  for (; off + 8 <= n; off += 8) {
    uint64_t v = splitmix64(key + off);
    memcpy(p + off, &v, 8);
  }
  if (off < n) {
    uint64_t v = splitmix64(key + off);
    memcpy(p + off, &v, n - off);
  }
}

/* Offset of the first byte that differs from the pattern, or -1. */
static long long check_pattern(const unsigned char* p, size_t n, uint64_t key) {
  size_t off = 0;
  for (; off < n; off += 8) {
    uint64_t v = splitmix64(key + off);
    size_t len = n - off < 8 ? n - off : 8;
    if (memcmp(p + off, &v, len) != 0) {
      const unsigned char* want = (const unsigned char*)&v;
      for (size_t i = 0; i < len; i++)
        if (p[off + i] != want[i]) return (long long)(off + i);
    }
  }
  return -1;
}

static long long check_bytes(const unsigned char* p, size_t n, unsigned char b) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != b) return (long long)i;
  return -1;
}

typedef struct {
  size_t size; /* what the sender sends */
  size_t cap;  /* what the receiver posts */
} msg_spec_t;

enum { KIND_MAIN, KIND_THREAD };

/* The message list of a stream; both processes derive the same one from the seed. */
static int make_msgs(uint64_t seed, uint32_t stream, int kind, msg_spec_t* out, int max) {
  int n = 0;
  uint64_t rs = splitmix64(seed ^ (0xABCDEF00ULL + stream)) | 1;
  if (kind == KIND_MAIN) {
    static const size_t exact[] = {0, 1, 4095, 4096, 65537, 1u << 20, 64u << 20};
    static const msg_spec_t larger[] = {
        {0, 4096}, {1, 65536}, {4095, 4097}, {100000, 1u << 20}, {(1u << 20) - 3, 1u << 20}};
    for (size_t i = 0; i < sizeof exact / sizeof exact[0] && n < max; i++)
      out[n++] = (msg_spec_t){exact[i], exact[i]};
    for (size_t i = 0; i < sizeof larger / sizeof larger[0] && n < max; i++) out[n++] = larger[i];
    for (int i = 0; i < 20 && n < max; i++) {
      uint64_t r = xorshift64(&rs);
      size_t size;
      switch (r % 3) {
        case 0: size = (size_t)((r >> 8) % 257); break;
        case 1: size = (size_t)((r >> 8) % 65536) + 1; break;
        default: size = (size_t)((r >> 8) % (4u << 20)) + 1; break;
      }
      uint64_t r2 = xorshift64(&rs);
      size_t cap = (r2 & 1) ? size : size + (size_t)((r2 >> 8) % 8192) + 1;
      out[n++] = (msg_spec_t){size, cap};
    }
  } else {
    for (int i = 0; i < 40 && n < max; i++) {
      uint64_t r = xorshift64(&rs);
      size_t size = (r & 3) == 0 ? (size_t)((r >> 8) % 64) : (size_t)((r >> 8) % (256u << 10));
      uint64_t r2 = xorshift64(&rs);
      size_t cap = (r2 & 1) ? size : size + (size_t)((r2 >> 8) % 4096) + 1;
      out[n++] = (msg_spec_t){size, cap};
    }
  }
  return n;
}

/* ------------------------------------------------------------ data streams */

enum { SLOT_EMPTY, SLOT_PREPARED, SLOT_POSTED };

typedef struct {
  int state;
  unsigned char* buf; /* message buffer (own allocation or inside staging) */
  unsigned char* alloc;
  void* mh;           /* per-message registration */
  void* req;
  int msg;
} slot_t;

typedef struct {
  test_t* t;
  ctl_t* ctl; /* to notice that the peer gave up */
  void* comm;
  int is_send;
  int tag;
  const msg_spec_t* msgs;
  int nmsgs;
  uint64_t seed;
  uint32_t id;
  int staging_mode;        /* 1: NCCL-like staging buffer registered once */
  unsigned char* staging;
  size_t slot_size;
  void* staging_mh;
  int flush_every;         /* receiver: iflush after every n-th non-empty message */
  void* phandle;           /* profiler handle passed to isend/irecv (v10+) */
  int posted, completed;
  int failed;
  int depth;               /* requests in flight at most (8 like NCCL, 33 for the depth test) */
  double max_test_s;       /* longest single test() call */
  double max_post_s;       /* longest single isend()/irecv() call */
  slot_t slots[MAX_SLOTS];
  long null_retries, tests, flushes, flush_reqs;
  size_t bytes;
} stream_t;

static size_t max_size(const msg_spec_t* m, int n, int want_cap) {
  size_t mx = 1;
  for (int i = 0; i < n; i++) {
    size_t v = want_cap ? m[i].cap : m[i].size;
    if (v > mx) mx = v;
  }
  return mx;
}

static int stream_init(stream_t* s, test_t* t, ctl_t* ctl, void* comm, int is_send, int tag,
                       const msg_spec_t* msgs, int n, uint64_t seed, uint32_t id, int staging,
                       int depth) {
  memset(s, 0, sizeof *s);
  s->t = t;
  s->ctl = ctl;
  s->comm = comm;
  s->is_send = is_send;
  s->tag = tag;
  s->msgs = msgs;
  s->nmsgs = n;
  s->seed = seed;
  s->id = id;
  s->staging_mode = staging;
  s->flush_every = 4;
  s->depth = depth < 1 ? 1 : depth > MAX_SLOTS ? MAX_SLOTS : depth;
  if (staging) {
    s->slot_size = max_size(msgs, n, !is_send) + GUARD;
    size_t total = s->slot_size * (size_t)s->depth;
    s->staging = malloc(total);
    if (!CHECK(t, s->staging != NULL, "out of memory for %zu bytes of staging", total)) return -1;
    memset(s->staging, 0, total);
    ncclResult_t r = net_regmr(comm, s->staging, total, NCCL_PTR_HOST, &s->staging_mh);
    if (!CHECK(t, r == ncclSuccess, "regMr(%s comm, staging %zu bytes, NCCL_PTR_HOST) = %d",
               is_send ? "send" : "recv", total, r))
      return -1;
  }
  return 0;
}

static void stream_release_slot(stream_t* s, slot_t* sl) {
  if (!s->staging_mode) {
    if (sl->state != SLOT_EMPTY && sl->mh) {
      ncclResult_t r = net_deregmr(s->comm, sl->mh);
      CHECK(s->t, r == ncclSuccess, "deregMr(comm, mhandle of message %d) = %d", sl->msg, r);
    }
    free(sl->alloc);
  }
  memset(sl, 0, sizeof *sl);
}

/* Deregisters every buffer of the stream (NCCL deregisters before it closes a comm). */
static void stream_dereg(stream_t* s) {
  for (int i = 0; i < MAX_SLOTS; i++) {
    slot_t* sl = &s->slots[i];
    if (!s->staging_mode && sl->state != SLOT_EMPTY && sl->mh) {
      ncclResult_t r = net_deregmr(s->comm, sl->mh);
      CHECK(s->t, r == ncclSuccess, "deregMr(comm, mhandle of message %d) = %d", sl->msg, r);
    }
    sl->mh = NULL;
  }
  if (s->staging_mh) {
    ncclResult_t r = net_deregmr(s->comm, s->staging_mh);
    CHECK(s->t, r == ncclSuccess, "deregMr(comm, staging mhandle) = %d", r);
    s->staging_mh = NULL;
  }
}

/* Frees the buffers; after stream_dereg, and after the comm is closed if requests may
 * still be outstanding. */
static void stream_free(stream_t* s) {
  for (int i = 0; i < MAX_SLOTS; i++) {
    if (!s->staging_mode) free(s->slots[i].alloc);
    memset(&s->slots[i], 0, sizeof s->slots[i]);
  }
  free(s->staging);
  s->staging = NULL;
}

static void stream_fini(stream_t* s) {
  stream_dereg(s);
  stream_free(s);
}

static int stream_prepare(stream_t* s, slot_t* sl, int idx) {
  const msg_spec_t* m = &s->msgs[idx];
  size_t len = s->is_send ? m->size : m->cap;
  sl->msg = idx;
  if (s->staging_mode) {
    sl->buf = s->staging + (size_t)(idx % s->depth) * s->slot_size;
  } else {
    sl->alloc = malloc(len + GUARD);
    if (!CHECK(s->t, sl->alloc != NULL, "out of memory (%zu bytes)", len + GUARD)) return -1;
    sl->buf = sl->alloc;
    size_t reg = len ? len : 1;
    ncclResult_t r = net_regmr(s->comm, sl->buf, reg, g_data_ptr, &sl->mh);
    if (!CHECK(s->t, r == ncclSuccess, "regMr(%s comm, %zu bytes, type %d) = %d",
               s->is_send ? "send" : "recv", reg, g_data_ptr, r)) {
      free(sl->alloc);
      memset(sl, 0, sizeof *sl);
      return -1;
    }
  }
  if (s->is_send) {
    fill_pattern(sl->buf, m->size, msg_key(s->seed, s->id, (uint32_t)idx));
  } else {
    memset(sl->buf, 0xCC, m->cap);
    memset(sl->buf + m->cap, GUARD_BYTE, GUARD);
  }
  sl->state = SLOT_PREPARED;
  return 0;
}

static int stream_post(stream_t* s, slot_t* sl) {
  const msg_spec_t* m = &s->msgs[sl->msg];
  void* mh = s->staging_mode ? s->staging_mh : sl->mh;
  void* req;
  ncclResult_t r;
  if (s->is_send) {
    req = STALE;
    double t0 = now_s();
    r = net_isend(s->comm, sl->buf, m->size, s->tag, mh, s->phandle, &req);
    if (now_s() - t0 > s->max_post_s) s->max_post_s = now_s() - t0;
    if (!CHECK(s->t, r == ncclSuccess, "isend(stream %u, msg %d, size %zu, tag %d) = %d", s->id,
               sl->msg, m->size, s->tag, r))
      return -1;
  } else {
    /* NCCL pre-loads 0x1 (NCCL_NET_OPTIONAL_RECV_COMPLETION) for LL/LL128 receives;
     * the v8 shim turns that into NULL. Other receives find a stale value. */
    if (sl->msg % 2 == 0)
      req = P.v >= 9 ? (void*)(uintptr_t)NCCL_NET_OPTIONAL_RECV_COMPLETION : NULL;
    else
      req = STALE;
    void* before = req;
    double t0 = now_s();
    r = net_irecv(s->comm, sl->buf, m->cap, s->tag, mh, s->phandle, &req);
    if (now_s() - t0 > s->max_post_s) s->max_post_s = now_s() - t0;
    if (!CHECK(s->t, r == ncclSuccess, "irecv(stream %u, msg %d, n=1, cap %zu, tag %d) = %d",
               s->id, sl->msg, m->cap, s->tag, r))
      return -1;
    if (!CHECK(s->t, req != (void*)(uintptr_t)NCCL_NET_OPTIONAL_RECV_COMPLETION || before != req,
               "irecv left the pre-stored 0x1 in *request (msg %d)", sl->msg))
      return -1;
  }
  if (!CHECK(s->t, req != STALE, "%s left *request untouched (stale value still there, msg %d)",
             s->is_send ? "isend" : "irecv", sl->msg))
    return -1;
  if (req == NULL) {
    s->null_retries++;
    return 0; /* "call again later": NCCL retries the identical operation */
  }
  if (!CHECK(s->t, req != (void*)(uintptr_t)NCCL_NET_OPTIONAL_RECV_COMPLETION,
             "%s returned 0x1 as a request (msg %d)", s->is_send ? "isend" : "irecv", sl->msg))
    return -1;
  sl->req = req;
  sl->state = SLOT_POSTED;
  return 1;
}

/* Tests the oldest outstanding request only, as NCCL does. 1 = it completed. */
static int stream_test_oldest(stream_t* s) {
  slot_t* sl = &s->slots[s->completed % s->depth];
  const msg_spec_t* m = &s->msgs[sl->msg];
  int done = 0x5A5A;
  int sizes[PROXY_MAX_SUBS];
  for (int i = 0; i < PROXY_MAX_SUBS; i++) sizes[i] = SIZES_SENTINEL;
  /* Sometimes NULL: flush requests and the bootstrap pass no sizes. */
  int with_sizes = s->is_send ? (sl->msg % 3 != 1) : (sl->msg % 5 != 3);
  s->tests++;
  double t0 = now_s();
  ncclResult_t r = net_test(sl->req, &done, with_sizes ? sizes : NULL);
  double dt = now_s() - t0;
  if (dt > s->max_test_s) s->max_test_s = dt;
  if (!CHECK(s->t, r == ncclSuccess, "test(%s request of stream %u msg %d size %zu cap %zu) = %d",
             s->is_send ? "send" : "recv", s->id, sl->msg, m->size, m->cap, r))
    return -1;
  if (!CHECK(s->t, done == 0 || done == 1, "test set *done to %d (msg %d)", done, sl->msg))
    return -1;
  if (!done) return 0;

  if (!s->is_send) {
    if (with_sizes) {
      CHECK(s->t, sizes[0] == (int)m->size,
            "recv msg %d: test reported size %d, sender sent %zu (receive capacity %zu)", sl->msg,
            sizes[0], m->size, m->cap);
      for (int i = 1; i < PROXY_MAX_SUBS; i++) {
        if (!CHECK(s->t, sizes[i] == SIZES_SENTINEL,
                   "recv msg %d: test wrote sizes[%d] = %d (n was 1)", sl->msg, i, sizes[i]))
          break;
      }
    }
    long long bad = check_pattern(sl->buf, m->size, msg_key(s->seed, s->id, (uint32_t)sl->msg));
    CHECK(s->t, bad < 0, "recv msg %d (size %zu): payload differs at byte %lld", sl->msg, m->size,
          bad);
    long long g = check_bytes(sl->buf + m->cap, GUARD, GUARD_BYTE);
    CHECK(s->t, g < 0, "recv msg %d: wrote %lld bytes past the receive buffer (cap %zu)", sl->msg,
          g + 1, m->cap);
    if (m->size > 0 && s->flush_every > 0 && sl->msg % s->flush_every == 0) {
      /* NCCL flushes after a completed receive into GPU memory; on host memory
       * a host plugin must answer "nothing to wait for". */
      void* freq = STALE;
      void* mh = s->staging_mode ? s->staging_mh : sl->mh;
      ncclResult_t fr = net_iflush(s->comm, sl->buf, (int)m->size, mh, &freq);
      s->flushes++;
      CHECK(s->t, fr == ncclSuccess, "iflush(recv comm, n=1, size %zu) = %d", m->size, fr);
      int host = g_data_ptr == NCCL_PTR_HOST || s->staging_mode;
      CHECK(s->t, fr != ncclSuccess || !host || freq == NULL,
            "iflush on host memory returned request %p, expected NULL", freq);
      if (fr == ncclSuccess && !host && freq != NULL && freq != STALE) {
        /* GPU memory: the flush is a request like any other, done within seconds. */
        int done = 0;
        double end = now_s() + 30;
        while (!done && now_s() < end) {
          ncclResult_t tr = NET_CALL(test, freq, &done, NULL);
          if (!CHECK(s->t, tr == ncclSuccess, "test(flush request) = %d", tr)) break;
        }
        CHECK(s->t, done, "the flush of msg %d did not complete within 30 s", sl->msg);
        s->flush_reqs++;
      }
    }
  }
  s->bytes += m->size;
  stream_release_slot(s, sl);
  s->completed++;
  return 1;
}

/* One progress pass: post the next message if there is room, test the oldest. */
static int stream_step(stream_t* s) {
  if (s->failed || s->completed == s->nmsgs) return 0;
  int progress = 0;
  if (s->posted < s->nmsgs && s->posted - s->completed < s->depth) {
    slot_t* sl = &s->slots[s->posted % s->depth];
    if (sl->state == SLOT_EMPTY && stream_prepare(s, sl, s->posted) != 0) goto fail;
    if (sl->state == SLOT_PREPARED) {
      int r = stream_post(s, sl);
      if (r < 0) goto fail;
      if (r > 0) {
        s->posted++;
        progress = 1;
      }
    }
  }
  if (s->completed < s->posted) {
    int r = stream_test_oldest(s);
    if (r < 0) goto fail;
    if (r > 0) progress = 1;
  }
  return progress;
fail:
  s->failed = 1;
  return 0;
}

/* Posts up to `count` more messages without testing anything, retrying NULL requests
 * until `deadline`. Returns the number posted so far, or -1 on error. */
static int stream_post_only(stream_t* s, int count, double deadline) {
  int target = s->posted + count < s->nmsgs ? s->posted + count : s->nmsgs;
  while (s->posted < target && s->posted - s->completed < s->depth) {
    slot_t* sl = &s->slots[s->posted % s->depth];
    if (sl->state == SLOT_EMPTY && stream_prepare(s, sl, s->posted) != 0) goto fail;
    int r = stream_post(s, sl);
    if (r < 0) goto fail;
    if (r > 0) {
      s->posted++;
      continue;
    }
    if (now_s() > deadline) break;
    sched_yield();
  }
  return s->posted;
fail:
  s->failed = 1;
  return -1;
}

/* Tests the oldest request for `secs`: 1 = it completed, 0 = still pending, -1 = error. */
static int stream_poll_oldest(stream_t* s, double secs) {
  double end = now_s() + secs;
  if (s->completed >= s->posted) return 0;
  do {
    int r = stream_test_oldest(s);
    if (r < 0) s->failed = 1;
    if (r != 0) return r;
    sched_yield();
  } while (now_s() < end);
  return 0;
}

/* Drives several streams from one thread until all are done, one fails, or the deadline. */
static int run_streams(stream_t* ss, int n, double deadline_s) {
  double t0 = now_s();
  double deadline = t0 + deadline_s;
  long spins = 0;
  for (;;) {
    int all_done = 1, progress = 0;
    for (int i = 0; i < n; i++) {
      progress |= stream_step(&ss[i]);
      if (ss[i].failed) {
        ctl_abort(ss[i].ctl);
        return -1;
      }
      if (ss[i].completed < ss[i].nmsgs) all_done = 0;
    }
    if (all_done) break;
    if (!progress) sched_yield();
    if ((++spins & 1023) == 0) {
      for (int i = 0; i < n; i++) {
        if (ctl_peer_aborted(ss[i].ctl)) {
          test_fail(ss[i].t, "peer process gave up during the data phase (stream %u at %d/%d)",
                    ss[i].id, ss[i].completed, ss[i].nmsgs);
          return -1;
        }
      }
      if (now_s() > deadline) {
        for (int i = 0; i < n; i++) {
          if (ss[i].completed < ss[i].nmsgs) {
            test_fail(ss[i].t,
                      "no completion within %.0f s: stream %u (%s) posted %d, completed %d of %d;"
                      " oldest msg size %zu",
                      deadline_s, ss[i].id, ss[i].is_send ? "send" : "recv", ss[i].posted,
                      ss[i].completed, ss[i].nmsgs, ss[i].msgs[ss[i].completed].size);
          }
        }
        ctl_abort(ss[0].ctl);
        return -1;
      }
    }
  }
  double dt = now_s() - t0;
  for (int i = 0; i < n; i++) {
    note("stream %u (%s): %d msgs, %zu bytes in %.2f s, %ld NULL-request retries, %ld tests,"
         " %ld flushes (%ld awaited), slowest test() %.1f ms",
         ss[i].id, ss[i].is_send ? "send" : "recv", ss[i].nmsgs, ss[i].bytes, dt,
         ss[i].null_retries, ss[i].tests, ss[i].flushes, ss[i].flush_reqs,
         ss[i].max_test_s * 1e3);
    CHECK(ss[i].t, ss[i].max_test_s < TEST_MAX_S,
          "stream %u: one test() call took %.2f s; test must never block", ss[i].id,
          ss[i].max_test_s);
    CHECK(ss[i].t, ss[i].max_post_s < TEST_MAX_S,
          "stream %u: one %s() call took %.2f s; it must never block", ss[i].id,
          ss[i].is_send ? "isend" : "irecv", ss[i].max_post_s);
  }
  return 0;
}

/* ------------------------------------------------------------ connection setup */

typedef struct {
  void* lc;
  void* comm;
  ncclNetDeviceHandle_v8_t* devcomm;
  int pass_null_devcomm; /* pass NULL instead of a pointer to a NULL pointer */
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
} conn_t;

/* Receiver: listen on every conn, ship the handles, poll accept until all are up;
 * closeListen right after each accept, as NCCL does. */
static int setup_recv(void* ctx, int dev, conn_t* cs, int n, ctl_t* ctl, test_t* t) {
  for (int i = 0; i < n; i++) {
    /* NCCL does not zero the handle buffer on every path. */
    memset(cs[i].handle, 0xCD, sizeof cs[i].handle);
    cs[i].lc = NULL;
    ncclResult_t r = net_listen(ctx, dev, cs[i].handle, &cs[i].lc);
    if (!CHECK(t, r == ncclSuccess, "listen(dev %d) = %d", dev, r)) return -1;
    if (!CHECK(t, cs[i].lc != NULL, "listen(dev %d) succeeded with a NULL listenComm", dev))
      return -1;
    if (ctl_send(ctl, MSG_HANDLE, (uint32_t)i, 0, cs[i].handle) != 0) {
      test_fail(t, "cannot ship the handle to the peer");
      return -1;
    }
  }
  double deadline = now_s() + SETUP_DEADLINE_S;
  double slowest = 0;
  int left = n;
  long polls = 0;
  while (left > 0) {
    for (int i = 0; i < n; i++) {
      if (cs[i].comm) continue;
      cs[i].devcomm = NULL;
      double t0 = now_s();
      ncclResult_t r = net_accept(cs[i].lc, &cs[i].comm,
                                  cs[i].pass_null_devcomm ? NULL : &cs[i].devcomm);
      double dt = now_s() - t0;
      if (dt > slowest) slowest = dt;
      polls++;
      if (!CHECK(t, r == ncclSuccess, "accept(listenComm %d) = %d after %ld polls", i, r, polls))
        return -1;
      if (cs[i].comm) {
        left--;
        CHECK(t, cs[i].devcomm == NULL, "accept wrote a device handle %p for a host plugin",
              (void*)cs[i].devcomm);
        r = net_close_listen(cs[i].lc);
        CHECK(t, r == ncclSuccess, "closeListen right after accept = %d", r);
        cs[i].lc = NULL;
      }
    }
    if (left == 0) break;
    if (now_s() > deadline) {
      test_fail(t, "accept still returned NULL recvComm after %d s (%ld polls)", SETUP_DEADLINE_S,
                polls);
      return -1;
    }
    if ((polls & 255) == 0 && ctl_peer_aborted(ctl)) {
      test_fail(t, "peer gave up during connection setup");
      return -1;
    }
    sched_yield();
  }
  note("accepted %d comm(s) after %ld accept polls, slowest accept %.1f ms", n, polls,
       slowest * 1e3);
  CHECK(t, slowest < TEST_MAX_S, "one accept() call took %.2f s; it must never block", slowest);
  return 0;
}

/* Sender: receive the handles, poll connect until all are up. NCCL passes the same
 * handle buffer to every retry. */
static int setup_send(void* ctx, int dev, conn_t* cs, int n, ctl_t* ctl, test_t* t) {
  for (int i = 0; i < n; i++) {
    ctl_msg_t m;
    if (ctl_recv(ctl, MSG_HANDLE, &m, CTL_TIMEOUT_MS, t) != 0) return -1;
    if (!CHECK(t, m.a == (uint32_t)i, "handle %u arrived, expected %d", m.a, i)) return -1;
    memcpy(cs[i].handle, m.data, sizeof cs[i].handle);
  }
  double deadline = now_s() + SETUP_DEADLINE_S;
  double slowest = 0;
  int left = n;
  long polls = 0;
  while (left > 0) {
    for (int i = 0; i < n; i++) {
      if (cs[i].comm) continue;
      cs[i].devcomm = NULL;
      double t0 = now_s();
      ncclResult_t r = net_connect(ctx, dev, cs[i].handle, &cs[i].comm,
                                   cs[i].pass_null_devcomm ? NULL : &cs[i].devcomm);
      double dt = now_s() - t0;
      if (dt > slowest) slowest = dt;
      polls++;
      if (!CHECK(t, r == ncclSuccess, "connect(dev %d, handle %d) = %d after %ld polls", dev, i, r,
                 polls)) {
        if (cs[i].comm) net_close_send(cs[i].comm); /* NCCL closes a comm returned with an error */
        cs[i].comm = NULL;
        return -1;
      }
      if (cs[i].comm) {
        left--;
        CHECK(t, cs[i].devcomm == NULL, "connect wrote a device handle %p for a host plugin",
              (void*)cs[i].devcomm);
      }
    }
    if (left == 0) break;
    if (now_s() > deadline) {
      test_fail(t, "connect still returned NULL sendComm after %d s (%ld polls)", SETUP_DEADLINE_S,
                polls);
      return -1;
    }
    if ((polls & 255) == 0 && ctl_peer_aborted(ctl)) {
      test_fail(t, "peer gave up during connection setup");
      return -1;
    }
    sched_yield();
  }
  note("connected %d comm(s) after %ld connect polls, slowest connect %.1f ms", n, polls,
       slowest * 1e3);
  CHECK(t, slowest < TEST_MAX_S, "one connect() call took %.2f s; it must never block", slowest);
  return 0;
}

/* ------------------------------------------------------------ tests */

static int load_plugin(const char* path, test_t* t) {
  char sym[32];
  snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", g_version);
  P.v = g_version;
  P.dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!CHECK(t, P.dl != NULL, "dlopen(%s, RTLD_NOW|RTLD_LOCAL): %s", path, dlerror())) return -1;
  void* table = dlsym(P.dl, sym);
  if (!CHECK(t, table != NULL, "dlsym(%s): %s", sym, dlerror())) return -1;
  switch (g_version) {
    case 12: P.v12 = table; break;
    case 11: P.v11 = table; break;
    case 10: P.v10 = table; break;
    case 9: P.v9 = table; break;
    default: P.v8 = table; break;
  }
  const char* name = net_name();
  if (!CHECK(t, name != NULL, "%s->name is NULL", sym)) return -1;
  CHECK(t, strcmp(name, "railover") == 0, "%s->name is \"%s\", expected \"railover\"", sym, name);
  /* Members NCCL calls unconditionally must be there. */
#define MUST(m) CHECK(t, NET_CALL_PTR(m) != NULL, "%s->" #m " is NULL", sym)
#define NET_CALL_PTR(m)                                                              \
  (P.v == 12 ? (void*)P.v12->m : P.v == 11 ? (void*)P.v11->m : P.v == 10 ? (void*)P.v10->m \
   : P.v == 9 ? (void*)P.v9->m : (void*)P.v8->m)
  MUST(init);
  MUST(devices);
  MUST(getProperties);
  MUST(listen);
  MUST(connect);
  MUST(accept);
  MUST(regMr);
  MUST(deregMr);
  MUST(isend);
  MUST(irecv);
  MUST(iflush);
  MUST(test);
  MUST(closeSend);
  MUST(closeRecv);
  MUST(closeListen);
  if (P.v == 12) CHECK(t, P.v12->finalize != NULL, "%s->finalize is NULL", sym);
  if (P.v == 11) CHECK(t, P.v11->finalize != NULL, "%s->finalize is NULL", sym);
#undef MUST
#undef NET_CALL_PTR
  return t->failed ? -1 : 0;
}

/* Fills a props struct of the loaded version over `fill` bytes, with canaries after it. */
typedef union {
  ncclNetProperties_v8_t v8;
  ncclNetProperties_v9_t v9;
  ncclNetProperties_v10_t v10;
  ncclNetProperties_v11_t v11;
  ncclNetProperties_v12_t v12;
  unsigned char raw[sizeof(ncclNetProperties_v12_t) + 64];
} any_props_t;

static size_t props_size(void) {
  switch (P.v) {
    case 12: return sizeof(ncclNetProperties_v12_t);
    case 11: return sizeof(ncclNetProperties_v11_t);
    case 10: return sizeof(ncclNetProperties_v10_t);
    case 9: return sizeof(ncclNetProperties_v9_t);
    default: return sizeof(ncclNetProperties_v8_t);
  }
}

static ncclResult_t get_props(int dev, any_props_t* p, unsigned char fill) {
  memset(p, fill, sizeof *p);
  switch (P.v) {
    case 12: return P.v12->getProperties(dev, &p->v12);
    case 11: return P.v11->getProperties(dev, &p->v11);
    case 10: return P.v10->getProperties(dev, &p->v10);
    case 9: return P.v9->getProperties(dev, &p->v9);
    default: return P.v8->getProperties(dev, &p->v8);
  }
}

static int looks_filled(const void* ptr) {
  uintptr_t v = (uintptr_t)ptr;
  return v == (uintptr_t)0xABABABABABABABABULL || v == (uintptr_t)0x5454545454545454ULL;
}

/* Checks one device's properties. NCCL hands in uninitialised memory, so the struct is
 * filled twice with different garbage: any member that differs between the two calls
 * was not written. Bytes after the struct must stay untouched (v11 is 112 bytes: a
 * plugin writing the v12 layout there overruns NCCL's buffer). */
#define SAME(f)                                                                              \
  CHECK(t, memcmp(&a->f, &b->f, sizeof a->f) == 0, "dev %d: getProperties left '" #f       \
        "' unset (its value depends on the caller's garbage)", dev)
#define PROPS_COMMON(T)                                                                      \
  do {                                                                                       \
    const T* a = (const T*)&pa;                                                              \
    const T* b = (const T*)&pb;                                                              \
    if (CHECK(t, a->name && !looks_filled(a->name), "dev %d: name not set (%p)", dev,        \
              (void*)a->name) &&                                                             \
        CHECK(t, b->name && !looks_filled(b->name), "dev %d: name not set", dev)) {          \
      size_t len = strnlen(a->name, 256);                                                    \
      CHECK(t, len > 0 && len < 256, "dev %d: name has length %zu", dev, len);               \
      CHECK(t, strcmp(a->name, b->name) == 0, "dev %d: name changes between calls", dev);    \
      snprintf(names[dev < 64 ? dev : 63], 256, "%s", a->name);                              \
    }                                                                                        \
    if (CHECK(t, !looks_filled(a->pciPath) && !looks_filled(b->pciPath),                     \
              "dev %d: pciPath not set", dev) &&                                             \
        a->pciPath) {                                                                        \
      CHECK(t, b->pciPath && strcmp(a->pciPath, b->pciPath) == 0,                            \
            "dev %d: pciPath changes between calls", dev);                                   \
    }                                                                                        \
    SAME(guid);                                                                              \
    SAME(ptrSupport);                                                                        \
    SAME(regIsGlobal);                                                                       \
    SAME(speed);                                                                             \
    SAME(port);                                                                              \
    SAME(latency);                                                                           \
    SAME(maxComms);                                                                          \
    SAME(maxRecvs);                                                                          \
    SAME(netDeviceType);                                                                     \
    SAME(netDeviceVersion);                                                                  \
    CHECK(t, (a->ptrSupport & NCCL_PTR_HOST) != 0, "dev %d: ptrSupport 0x%x lacks NCCL_PTR_HOST", \
          dev, a->ptrSupport);                                                               \
    CHECK(t, (a->ptrSupport & ~(NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF)) == 0,      \
          "dev %d: ptrSupport 0x%x has unknown bits", dev, a->ptrSupport);                   \
    CHECK(t, !(a->ptrSupport & NCCL_PTR_DMABUF) || (a->ptrSupport & NCCL_PTR_CUDA),          \
          "dev %d: ptrSupport 0x%x has DMABUF without CUDA", dev, a->ptrSupport);            \
    if (dev == 0) g_gpu_ok = (a->ptrSupport & NCCL_PTR_CUDA) != 0;                           \
    CHECK(t, a->regIsGlobal == 0 || a->regIsGlobal == 1, "dev %d: regIsGlobal %d", dev,      \
          a->regIsGlobal);                                                                   \
    CHECK(t, a->speed >= 0 && a->speed <= 10000000, "dev %d: speed %d Mbps", dev, a->speed); \
    CHECK(t, a->port >= 0, "dev %d: port %d", dev, a->port);                                 \
    CHECK(t, isfinite(a->latency) && a->latency >= 0.0f, "dev %d: latency %g", dev,          \
          (double)a->latency);                                                               \
    CHECK(t, a->maxComms >= 1, "dev %d: maxComms %d", dev, a->maxComms);                     \
    CHECK(t, a->maxRecvs >= 1 && a->maxRecvs <= 8, "dev %d: maxRecvs %d", dev, a->maxRecvs); \
    CHECK(t, a->netDeviceType == NCCL_NET_DEVICE_HOST,                                       \
          "dev %d: netDeviceType %d (NCCL rejects anything but HOST(0) for a host plugin)",  \
          dev, (int)a->netDeviceType);                                                       \
    CHECK(t, a->netDeviceVersion == 0, "dev %d: netDeviceVersion %d", dev,                   \
          a->netDeviceVersion);                                                              \
    if (dev == 0) P.maxRecvs = a->maxRecvs;                                                  \
    note("dev %d: name=%s pciPath=%s guid=0x%" PRIx64 " ptrSupport=0x%x speed=%d port=%d "   \
         "latency=%g maxComms=%d maxRecvs=%d",                                               \
         dev, a->name && !looks_filled(a->name) ? a->name : "?",                             \
         a->pciPath && !looks_filled(a->pciPath) ? a->pciPath : "(null)", a->guid,           \
         a->ptrSupport, a->speed, a->port, (double)a->latency, a->maxComms, a->maxRecvs);    \
  } while (0)

#define PROPS_V9(T, K)                                                                       \
  do {                                                                                       \
    const T* a = (const T*)&pa;                                                              \
    const T* b = (const T*)&pb;                                                              \
    SAME(forceFlush);                                                                        \
    SAME(vProps.ndevs);                                                                      \
    SAME(maxP2pBytes);                                                                       \
    SAME(maxCollBytes);                                                                      \
    CHECK(t, a->forceFlush == 0 || a->forceFlush == 1, "dev %d: forceFlush %d", dev,         \
          a->forceFlush);                                                                    \
    if (CHECK(t, a->vProps.ndevs >= 1 && a->vProps.ndevs <= (K),                             \
              "dev %d: vProps.ndevs %d (want 1..%d)", dev, a->vProps.ndevs, (K))) {          \
      for (int i = 0; i < a->vProps.ndevs; i++) {                                            \
        SAME(vProps.devs[i]);                                                                \
        CHECK(t, a->vProps.devs[i] >= 0 && a->vProps.devs[i] < P.ndev,                       \
              "dev %d: vProps.devs[%d] = %d is not a device index", dev, i,                  \
              a->vProps.devs[i]);                                                            \
      }                                                                                      \
    }                                                                                        \
    CHECK(t, a->maxP2pBytes >= 1 && a->maxP2pBytes <= NCCL_MAX_NET_SIZE_BYTES,               \
          "dev %d: maxP2pBytes %zu not in 1..2^40 (NCCL fails connection setup)", dev,       \
          a->maxP2pBytes);                                                                   \
    CHECK(t, a->maxCollBytes <= NCCL_MAX_NET_SIZE_BYTES, "dev %d: maxCollBytes %zu", dev,    \
          a->maxCollBytes);                                                                  \
  } while (0)

static void check_device_props(int dev, test_t* t, char names[64][256]) {
  any_props_t pa, pb;
  ncclResult_t ra = get_props(dev, &pa, 0xAB);
  ncclResult_t rb = get_props(dev, &pb, 0x54);
  if (!CHECK(t, ra == ncclSuccess && rb == ncclSuccess, "getProperties(%d) = %d / %d", dev, ra, rb))
    return;
  size_t sz = props_size();
  long long over = check_bytes(pa.raw + sz, sizeof pa.raw - sz, 0xAB);
  CHECK(t, over < 0,
        "getProperties(%d) wrote past the end of ncclNetProperties_v%d_t (%zu bytes): byte %zu",
        dev, P.v, sz, sz + (size_t)over);
  switch (P.v) {
    case 12:
      PROPS_COMMON(ncclNetProperties_v12_t);
      PROPS_V9(ncclNetProperties_v12_t, NCCL_NET_MAX_DEVS_PER_NIC_V12);
      {
        const ncclNetProperties_v12_t* a = &pa.v12;
        const ncclNetProperties_v12_t* b = &pb.v12;
        SAME(maxMultiRequestSize);
        SAME(railId);
        SAME(planeId);
        CHECK(t, a->maxMultiRequestSize >= 1, "dev %d: maxMultiRequestSize %d", dev,
              a->maxMultiRequestSize);
        CHECK(t, a->railId >= -1, "dev %d: railId %d", dev, a->railId);
        CHECK(t, a->planeId >= -1, "dev %d: planeId %d", dev, a->planeId);
      }
      break;
    case 11:
      PROPS_COMMON(ncclNetProperties_v11_t);
      PROPS_V9(ncclNetProperties_v11_t, NCCL_NET_MAX_DEVS_PER_NIC_V11);
      {
        const ncclNetProperties_v11_t* a = &pa.v11;
        const ncclNetProperties_v11_t* b = &pb.v11;
        SAME(maxMultiRequestSize);
        CHECK(t, a->maxMultiRequestSize >= 1, "dev %d: maxMultiRequestSize %d", dev,
              a->maxMultiRequestSize);
      }
      break;
    case 10:
      PROPS_COMMON(ncclNetProperties_v10_t);
      PROPS_V9(ncclNetProperties_v10_t, NCCL_NET_MAX_DEVS_PER_NIC_V10);
      break;
    case 9:
      PROPS_COMMON(ncclNetProperties_v9_t);
      PROPS_V9(ncclNetProperties_v9_t, NCCL_NET_MAX_DEVS_PER_NIC_V9);
      break;
    default:
      PROPS_COMMON(ncclNetProperties_v8_t);
      break;
  }
}

static void test_properties(test_t* t) {
  static char names[64][256];
  memset(names, 0, sizeof names);
  for (int dev = 0; dev < P.ndev; dev++) check_device_props(dev, t, names);
  for (int i = 0; i < P.ndev && i < 64; i++)
    for (int j = i + 1; j < P.ndev && j < 64; j++)
      CHECK(t, !names[i][0] || strcmp(names[i], names[j]) != 0,
            "devices %d and %d share the name \"%s\" (NCCL keys its topology by name)", i, j,
            names[i]);
}

/* NCCL's GDR self-test and the net bootstrap ring: listen, then connect and accept
 * alternately on ONE thread (sendDevComm/recvDevComm NULL), register, a few
 * single-buffer transfers driven from the same thread, close. */
static void test_loopback_one_thread(void* ctx, test_t* t) {
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0xCD, sizeof handle);
  void *lc = NULL, *sc = NULL, *rc = NULL;
  ncclResult_t r = net_listen(ctx, 0, handle, &lc);
  if (!CHECK(t, r == ncclSuccess && lc != NULL, "listen(dev 0) = %d, listenComm %p", r, lc))
    return;
  double deadline = now_s() + SETUP_DEADLINE_S;
  long polls = 0;
  while (!sc || !rc) {
    if (!sc) {
      r = net_connect(ctx, 0, handle, &sc, NULL);
      if (!CHECK(t, r == ncclSuccess, "connect(dev 0, sendDevComm NULL) = %d", r)) goto out;
    }
    if (!rc) {
      r = net_accept(lc, &rc, NULL);
      if (!CHECK(t, r == ncclSuccess, "accept(recvDevComm NULL) = %d", r)) goto out;
    }
    polls++;
    if (now_s() > deadline) {
      test_fail(t, "connect/accept alternating on one thread did not finish in %d s "
                   "(sendComm %p, recvComm %p after %ld polls each)",
                SETUP_DEADLINE_S, sc, rc, polls);
      goto out;
    }
    if (!sc || !rc) sched_yield();
  }
  r = net_close_listen(lc);
  lc = NULL;
  CHECK(t, r == ncclSuccess, "closeListen = %d", r);

  enum { N = 3 };
  static const size_t sizes[N] = {0, 1, 1u << 20};
  unsigned char* sbuf = malloc((1u << 20) + GUARD);
  unsigned char* rbuf = malloc((1u << 20) + GUARD);
  void *smh = NULL, *rmh = NULL, *cmh = NULL;
  if (!CHECK(t, sbuf && rbuf, "out of memory")) goto bufs;
  r = net_regmr(sc, sbuf, 1u << 20, NCCL_PTR_HOST, &smh);
  CHECK(t, r == ncclSuccess, "regMr(sendComm, 1 MiB, NCCL_PTR_HOST) = %d", r);
  r = net_regmr(rc, rbuf, 1u << 20, NCCL_PTR_HOST, &rmh);
  CHECK(t, r == ncclSuccess, "regMr(recvComm, 1 MiB, NCCL_PTR_HOST) = %d", r);
  r = net_regmr(sc, sbuf, 1u << 20, NCCL_PTR_CUDA, &cmh);
  CHECK(t, (r == ncclSuccess) == g_gpu_ok,
        "regMr(sendComm, NCCL_PTR_CUDA) = %d, but ptrSupport %s NCCL_PTR_CUDA", r,
        g_gpu_ok ? "has" : "lacks");
  if (r == ncclSuccess) net_deregmr(sc, cmh);
  r = net_deregmr(rc, NULL);
  CHECK(t, r == ncclSuccess, "deregMr(recvComm, NULL) = %d", r);
  if (t->failed) goto dereg;

  for (int i = 0; i < N; i++) {
    uint64_t key = msg_key(0x10, 0, (uint32_t)i);
    fill_pattern(sbuf, sizes[i], key);
    memset(rbuf, 0, 1u << 20);
    memset(rbuf + (1u << 20), GUARD_BYTE, GUARD);
    void *sreq = NULL, *rreq = NULL;
    int sdone = 0, rdone = 0, rsize = -1;
    deadline = now_s() + SETUP_DEADLINE_S;
    while (!sdone || !rdone) {
      if (now_s() > deadline) {
        test_fail(t, "transfer %d (%zu bytes) on one thread did not complete in %d s: send %s, "
                     "recv %s", i, sizes[i], SETUP_DEADLINE_S, sdone ? "done" : "pending",
                  rdone ? "done" : "pending");
        goto dereg;
      }
      if (!rreq && !rdone) {
        rreq = STALE;
        r = net_irecv(rc, rbuf, 1u << 20, 0, rmh, NULL, &rreq);
        if (!CHECK(t, r == ncclSuccess && rreq != STALE, "irecv = %d, *request %p", r, rreq))
          goto dereg;
      }
      if (!sreq && !sdone) {
        sreq = STALE;
        r = net_isend(sc, sbuf, sizes[i], 0, smh, NULL, &sreq);
        if (!CHECK(t, r == ncclSuccess && sreq != STALE, "isend = %d, *request %p", r, sreq))
          goto dereg;
      }
      if (sreq && !sdone) {
        int d = 0;
        r = net_test(sreq, &d, NULL); /* bootstrap passes sizes == NULL */
        if (!CHECK(t, r == ncclSuccess, "test(send, sizes NULL) = %d", r)) goto dereg;
        if (d) sdone = 1;
      }
      if (rreq && !rdone) {
        int d = 0;
        int sz[PROXY_MAX_SUBS] = {0};
        r = net_test(rreq, &d, sz);
        if (!CHECK(t, r == ncclSuccess, "test(recv) = %d", r)) goto dereg;
        if (d) {
          rdone = 1;
          rsize = sz[0];
        }
      }
      if (!sdone || !rdone) sched_yield();
    }
    CHECK(t, rsize == (int)sizes[i], "transfer %d: recv reported %d bytes, sent %zu", i, rsize,
          sizes[i]);
    long long bad = check_pattern(rbuf, sizes[i], key);
    CHECK(t, bad < 0, "transfer %d: payload differs at byte %lld", i, bad);
    CHECK(t, check_bytes(rbuf + (1u << 20), GUARD, GUARD_BYTE) < 0,
          "transfer %d: wrote past the receive buffer", i);
  }
dereg:
  if (smh) CHECK(t, net_deregmr(sc, smh) == ncclSuccess, "deregMr(sendComm) failed");
  if (rmh) CHECK(t, net_deregmr(rc, rmh) == ncclSuccess, "deregMr(recvComm) failed");
bufs:
  free(sbuf);
  free(rbuf);
out:
  if (lc) net_close_listen(lc);
  if (sc) CHECK(t, (r = net_close_send(sc)) == ncclSuccess, "closeSend = %d", r);
  if (rc) CHECK(t, (r = net_close_recv(rc)) == ncclSuccess, "closeRecv = %d", r);
}

/* Listens on device 0 and connects a send comm to it from the same thread, as NCCL's
 * proxy does for a rank talking to itself. 0 = both comms are set up. */
static int connect_pair(void* ctx, void** lc, void** sc, void** rc, test_t* t) {
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0xCD, sizeof handle);
  ncclResult_t r = net_listen(ctx, 0, handle, lc);
  if (!CHECK(t, r == ncclSuccess && *lc != NULL, "listen(dev 0) = %d", r)) return -1;
  double deadline = now_s() + SETUP_DEADLINE_S;
  while (!*sc || !*rc) {
    if (!*sc && !CHECK(t, net_connect(ctx, 0, handle, sc, NULL) == ncclSuccess, "connect"))
      return -1;
    if (!*rc && !CHECK(t, net_accept(*lc, rc, NULL) == ncclSuccess, "accept")) return -1;
    if (now_s() > deadline) {
      test_fail(t, "connect/accept did not finish in %d s", SETUP_DEADLINE_S);
      return -1;
    }
    if (!*sc || !*rc) sched_yield();
  }
  return 0;
}

/* A grouped receive of maxRecvs buffers on one thread, as NCCL's shared comms use it: the
 * sends come in reverse tag order, each with its own size (one of zero bytes), and each must
 * land in the buffer with its tag; test() reports one size per buffer. */
static void test_grouped_receive(void* ctx, test_t* t) {
  enum { CAP = 4096, MAXN = 8 };
  int n = P.maxRecvs < MAXN ? P.maxRecvs : MAXN;
  if (n < 2) {
    note("grouped receive skipped: the plugin reports maxRecvs=%d", P.maxRecvs);
    return;
  }
  note("grouped receive of %d buffers", n);
  void *lc = NULL, *sc = NULL, *rc = NULL;
  unsigned char* sbuf[MAXN] = {0};
  unsigned char* rbuf[MAXN] = {0};
  void* smh[MAXN] = {0};
  void* rmh[MAXN] = {0};
  void* sreq[MAXN] = {0};
  int sdone[MAXN] = {0};
  void* rdata[MAXN] = {0};
  size_t caps[MAXN], want[MAXN];
  int tags[MAXN];
  void* rreq = STALE;
  int rdone = 0, got[PROXY_MAX_SUBS];
  for (int i = 0; i < PROXY_MAX_SUBS; i++) got[i] = -1;
  ncclResult_t r;
  if (connect_pair(ctx, &lc, &sc, &rc, t) != 0) goto out;
  double deadline;
  for (int i = 0; i < n; i++) {
    caps[i] = CAP;
    want[i] = i == 1 ? 0 : (size_t)(100 * i + 7);
    tags[i] = 1000 + 3 * i;
    sbuf[i] = malloc(CAP);
    rbuf[i] = malloc(CAP + GUARD);
    if (!CHECK(t, sbuf[i] && rbuf[i], "out of memory")) goto bufs;
    fill_pattern(sbuf[i], want[i], msg_key(0x30, 0, (uint32_t)i));
    memset(rbuf[i], GUARD_BYTE, CAP + GUARD);
    rdata[i] = rbuf[i];
    r = net_regmr(sc, sbuf[i], CAP, NCCL_PTR_HOST, &smh[i]);
    if (!CHECK(t, r == ncclSuccess, "regMr(sendComm) = %d", r)) goto bufs;
    r = net_regmr(rc, rbuf[i], CAP, NCCL_PTR_HOST, &rmh[i]);
    if (!CHECK(t, r == ncclSuccess, "regMr(recvComm) = %d", r)) goto bufs;
  }
  r = net_irecvn(rc, n, rdata, caps, tags, rmh, &rreq);
  if (!CHECK(t, r == ncclSuccess && rreq != STALE && rreq != NULL,
             "irecv(n=%d) = %d, *request %p", n, r, rreq))
    goto bufs;
  deadline = now_s() + SETUP_DEADLINE_S;
  for (;;) {
    int all = rdone;
    for (int j = 0; j < n; j++) {
      int i = n - 1 - j; /* reverse tag order */
      if (!sreq[i] && !sdone[i]) {
        void* q = STALE;
        r = net_isend(sc, sbuf[i], want[i], tags[i], smh[i], NULL, &q);
        if (!CHECK(t, r == ncclSuccess && q != STALE, "isend(tag %d) = %d", tags[i], r))
          goto bufs;
        sreq[i] = q;
      }
      if (sreq[i] && !sdone[i]) {
        int d = 0;
        r = net_test(sreq[i], &d, NULL);
        if (!CHECK(t, r == ncclSuccess, "test(send tag %d) = %d", tags[i], r)) goto bufs;
        sdone[i] = d;
      }
      all = all && sdone[i];
    }
    if (!rdone) {
      r = net_test(rreq, &rdone, got);
      if (!CHECK(t, r == ncclSuccess, "test(grouped recv) = %d", r)) goto bufs;
    }
    if (all && rdone) break;
    if (now_s() > deadline) {
      test_fail(t, "grouped receive of %d did not complete in %d s (recv %s)", n,
                SETUP_DEADLINE_S, rdone ? "done" : "pending");
      goto bufs;
    }
    sched_yield();
  }
  for (int i = 0; i < n; i++) {
    CHECK(t, got[i] == (int)want[i], "buffer %d (tag %d): test reported %d bytes, sent %zu", i,
          tags[i], got[i], want[i]);
    long long bad = check_pattern(rbuf[i], want[i], msg_key(0x30, 0, (uint32_t)i));
    CHECK(t, bad < 0, "buffer %d (tag %d): payload differs at byte %lld", i, tags[i], bad);
    CHECK(t, check_bytes(rbuf[i] + want[i], CAP + GUARD - want[i], GUARD_BYTE) < 0,
          "buffer %d: written past the %zu bytes sent to it", i, want[i]);
  }
  CHECK(t, got[n] == -1, "test wrote sizes[%d], past the %d buffers", n, n);
bufs:
  for (int i = 0; i < n; i++) {
    if (smh[i]) net_deregmr(sc, smh[i]);
    if (rmh[i]) net_deregmr(rc, rmh[i]);
  }
out:
  if (lc) net_close_listen(lc);
  if (sc) CHECK(t, (r = net_close_send(sc)) == ncclSuccess, "closeSend = %d", r);
  if (rc) CHECK(t, (r = net_close_recv(rc)) == ncclSuccess, "closeRecv = %d", r);
  /* After the closes: the plugin holds none of these buffers any more. */
  for (int i = 0; i < n; i++) {
    free(sbuf[i]);
    free(rbuf[i]);
  }
}

/* ------------------------------------------------------------ tag matching (NCCL's IB rules) */

/* Which buffer a send fills is NCCL's IB transport's choice (ncclIbIsend in
 * src/transport/net_ib/p2p.cc): the first free buffer with the send's tag in the oldest
 * posted receive not fully matched, for n = 1 too; none means *request = NULL ("call
 * again"), never an error; a send larger than its buffer is cut to it, and both ends
 * report the size that moved. Each case posts its receives, then plays a script of
 * sends: a step either expects NULL, where the rules force it whenever the receiver's
 * clear-to-send arrives (the head receive is known and lacks the tag, or is not even
 * posted), or calls again until the send is taken. The expected buffers and sizes are
 * written out by hand from those rules. */
#define MATCH_RECVS 3
#define MATCH_SENDS 10
#define MATCH_STEPS 16
typedef struct {
  const char* name;
  int nrecv;
  int n[MATCH_RECVS];
  int tag[MATCH_RECVS][8];
  size_t cap[MATCH_RECVS][8];
  int nsend;
  int stag[MATCH_SENDS];
  size_t ssize[MATCH_SENDS];
  int nstep;
  int step[MATCH_STEPS];    /* send i: taken (retried until it is); -1 - i: must be NULL */
  int from[MATCH_RECVS][8]; /* the send each buffer holds */
  int got[MATCH_RECVS][8];  /* and the size both ends report */
} match_case_t;

#define NOT_NOW(i) (-1 - (i))

static const match_case_t MATCH_CASES[] = {
    {"a group of one with tag 8, then a group of eight with tags 0-7",
     2,
     {1, 8},
     {{8}, {0, 1, 2, 3, 4, 5, 6, 7}},
     {{64}, {64, 64, 64, 64, 64, 64, 64, 64}},
     9,
     {0, 1, 2, 3, 4, 5, 6, 7, 8},
     {10, 11, 12, 13, 14, 15, 16, 17, 18},
     /* Tags 0-7 wait while the group of one (tag 8) is the head, however often asked. */
     16,
     {NOT_NOW(0), NOT_NOW(1), NOT_NOW(2), NOT_NOW(3), NOT_NOW(4), NOT_NOW(5), NOT_NOW(6),
      8, 7, 6, 5, 4, 3, 2, 1, 0},
     {{8}, {0, 1, 2, 3, 4, 5, 6, 7}},
     {{18}, {10, 11, 12, 13, 14, 15, 16, 17}}},
    {"groups back to back with the same tags",
     2,
     {2, 2},
     {{1, 2}, {1, 2}},
     {{64, 64}, {64, 64}},
     4,
     {1, 1, 2, 2},
     {20, 21, 22, 23},
     /* Send 1 (tag 1) finds tag 1 taken in the head group: it belongs to the next. */
     5,
     {0, NOT_NOW(1), 2, 1, 3},
     {{0, 2}, {1, 3}},
     {{20, 22}, {21, 23}}},
    {"a group of one whose tag the next send does not have",
     2,
     {1, 1},
     {{5}, {6}},
     {{64}, {64}},
     2,
     {6, 5},
     {30, 31},
     /* Send 0 (tag 6) waits while the tag-5 receive is the head. */
     3,
     {NOT_NOW(0), 1, 0},
     {{1}, {0}},
     {{31}, {30}}},
    {"two groups in flight with identical tags",
     2,
     {3, 3},
     {{4, 4, 9}, {4, 4, 9}},
     {{64, 64, 64}, {64, 64, 64}},
     6,
     {9, 9, 4, 4, 4, 4},
     {40, 41, 42, 43, 44, 45},
     /* Send 1 (tag 9) finds the head group's tag 9 taken: it waits for the next group. */
     7,
     {0, NOT_NOW(1), 2, 3, 1, 4, 5},
     {{2, 3, 0}, {4, 5, 1}},
     {{42, 43, 40}, {44, 45, 41}}},
    {"sends larger than their buffers are cut to them",
     3,
     {1, 2, 1},
     {{0}, {1, 2}, {3}},
     {{4096}, {100, 300}, {0}},
     4,
     {0, 2, 1, 3},
     {8192, 500, 50, 7},
     4,
     {0, 1, 2, 3},
     {{0}, {2, 1}, {3}},
     {{4096}, {50, 300}, {0}}},
};

/* Calls isend for send i until it is taken (`want_null` 0) or once (`want_null` 1, which
 * must give NULL). 0 = as expected. */
static int match_step(void* sc, const match_case_t* c, int i, int want_null,
                      unsigned char** sbuf, void** smh, void** sreq, test_t* t) {
  double deadline = now_s() + SETUP_DEADLINE_S;
  for (;;) {
    void* q = STALE;
    ncclResult_t r = net_isend(sc, sbuf[i], c->ssize[i], c->stag[i], smh[i], NULL, &q);
    if (!CHECK(t, r == ncclSuccess && q != STALE, "%s: isend(send %d, tag %d) = %d", c->name,
               i, c->stag[i], r))
      return -1;
    if (want_null)
      return CHECK(t, q == NULL, "%s: send %d (tag %d) was taken, but no free buffer of the "
                   "head receive has its tag", c->name, i, c->stag[i]) ? 0 : -1;
    if (q) {
      sreq[i] = q;
      return 0;
    }
    if (!CHECK(t, now_s() < deadline, "%s: send %d (tag %d) never taken in %d s", c->name, i,
               c->stag[i], SETUP_DEADLINE_S))
      return -1;
    sched_yield();
  }
}

static void run_match_case(void* ctx, const match_case_t* c, int idx, test_t* t) {
  void *lc = NULL, *sc = NULL, *rc = NULL;
  unsigned char* sbuf[MATCH_SENDS] = {0};
  void* smh[MATCH_SENDS] = {0};
  void* sreq[MATCH_SENDS] = {0};
  int sdone[MATCH_SENDS] = {0}, ssize[MATCH_SENDS];
  unsigned char* rbuf[MATCH_RECVS][8] = {{0}};
  void* rmh[MATCH_RECVS][8] = {{0}};
  void* rreq[MATCH_RECVS] = {0};
  int rdone[MATCH_RECVS] = {0};
  int got[MATCH_RECVS][PROXY_MAX_SUBS];
  ncclResult_t r;
  for (int q = 0; q < c->nrecv; q++) {
    if (c->n[q] > P.maxRecvs) {
      note("tag matching case %d skipped: the plugin reports maxRecvs=%d", idx, P.maxRecvs);
      return;
    }
  }
  if (connect_pair(ctx, &lc, &sc, &rc, t) != 0) goto out;
  for (int i = 0; i < c->nsend; i++) {
    sbuf[i] = malloc(c->ssize[i] + 1);
    if (!CHECK(t, sbuf[i] != NULL, "out of memory")) goto bufs;
    fill_pattern(sbuf[i], c->ssize[i], msg_key(0x40 + idx, 0, (uint32_t)i));
    r = net_regmr(sc, sbuf[i], c->ssize[i] + 1, NCCL_PTR_HOST, &smh[i]);
    if (!CHECK(t, r == ncclSuccess, "regMr(sendComm) = %d", r)) goto bufs;
  }
  for (int q = 0; q < c->nrecv; q++) {
    void* data[8];
    for (int b = 0; b < c->n[q]; b++) {
      rbuf[q][b] = malloc(c->cap[q][b] + GUARD);
      if (!CHECK(t, rbuf[q][b] != NULL, "out of memory")) goto bufs;
      memset(rbuf[q][b], GUARD_BYTE, c->cap[q][b] + GUARD);
      data[b] = rbuf[q][b];
      r = net_regmr(rc, rbuf[q][b], c->cap[q][b] + 1, NCCL_PTR_HOST, &rmh[q][b]);
      if (!CHECK(t, r == ncclSuccess, "regMr(recvComm) = %d", r)) goto bufs;
    }
    for (int i = 0; i < PROXY_MAX_SUBS; i++) got[q][i] = SIZES_SENTINEL;
    rreq[q] = STALE;
    r = net_irecvn(rc, c->n[q], data, c->cap[q], c->tag[q], rmh[q], &rreq[q]);
    if (!CHECK(t, r == ncclSuccess && rreq[q] != STALE && rreq[q] != NULL,
               "irecv(n=%d) on an idle comm = %d, request %p", c->n[q], r, rreq[q]))
      goto bufs;
  }
  for (int k = 0; k < c->nstep; k++) {
    int i = c->step[k] < 0 ? -1 - c->step[k] : c->step[k];
    if (match_step(sc, c, i, c->step[k] < 0, sbuf, smh, sreq, t) != 0) goto bufs;
  }
  double deadline = now_s() + DATA_DEADLINE_S;
  for (;;) {
    int all = 1;
    for (int i = 0; i < c->nsend; i++) {
      if (!CHECK(t, sreq[i] != NULL, "%s: the script leaves send %d untaken", c->name, i))
        goto bufs;
      if (!sdone[i]) {
        int sizes[PROXY_MAX_SUBS];
        sizes[0] = SIZES_SENTINEL;
        r = net_test(sreq[i], &sdone[i], sizes);
        if (!CHECK(t, r == ncclSuccess, "test(send %d, tag %d) = %d", i, c->stag[i], r))
          goto bufs;
        ssize[i] = sizes[0];
      }
      all = all && sdone[i];
    }
    for (int q = 0; q < c->nrecv; q++) {
      if (rdone[q]) continue;
      r = net_test(rreq[q], &rdone[q], got[q]);
      if (!CHECK(t, r == ncclSuccess, "test(receive %d) = %d", q, r)) goto bufs;
      all = all && rdone[q];
    }
    if (all) break;
    if (now_s() > deadline) {
      test_fail(t, "%s: not done in %d s", c->name, DATA_DEADLINE_S);
      goto bufs;
    }
    sched_yield();
  }
  note("tag matching: %s: done", c->name);
  for (int q = 0; q < c->nrecv; q++) {
    for (int b = 0; b < c->n[q]; b++) {
      int from = c->from[q][b], want = c->got[q][b];
      CHECK(t, got[q][b] == want, "%s: receive %d buffer %d (tag %d) reported %d bytes, not %d",
            c->name, q, b, c->tag[q][b], got[q][b], want);
      long long bad =
          check_pattern(rbuf[q][b], (size_t)want, msg_key(0x40 + idx, 0, (uint32_t)from));
      CHECK(t, bad < 0, "%s: receive %d buffer %d does not hold send %d (differs at byte %lld)",
            c->name, q, b, from, bad);
      CHECK(t, check_bytes(rbuf[q][b] + want, c->cap[q][b] + GUARD - want, GUARD_BYTE) < 0,
            "%s: receive %d buffer %d written past the %d bytes it got", c->name, q, b, want);
      CHECK(t, ssize[from] == want, "%s: send %d reported %d bytes, its buffer got %d", c->name,
            from, ssize[from], want);
    }
    CHECK(t, got[q][c->n[q]] == SIZES_SENTINEL, "%s: test wrote sizes[%d], past the %d buffers",
          c->name, c->n[q], c->n[q]);
  }
bufs:
  for (int i = 0; i < c->nsend; i++)
    if (smh[i]) net_deregmr(sc, smh[i]);
  for (int q = 0; q < c->nrecv; q++)
    for (int b = 0; b < c->n[q]; b++)
      if (rmh[q][b]) net_deregmr(rc, rmh[q][b]);
out:
  if (lc) net_close_listen(lc);
  if (sc) CHECK(t, (r = net_close_send(sc)) == ncclSuccess, "closeSend = %d", r);
  if (rc) CHECK(t, (r = net_close_recv(rc)) == ncclSuccess, "closeRecv = %d", r);
  for (int i = 0; i < c->nsend; i++) free(sbuf[i]);
  for (int q = 0; q < c->nrecv; q++)
    for (int b = 0; b < c->n[q]; b++) free(rbuf[q][b]);
}

static void test_tag_matching(void* ctx, test_t* t) {
  for (size_t i = 0; i < sizeof MATCH_CASES / sizeof MATCH_CASES[0]; i++)
    run_match_case(ctx, &MATCH_CASES[i], (int)i, t);
}

/* regMr on the main comm: host accepted, CUDA refused, deregMr(NULL) accepted. */
static void test_regmr(void* comm, int is_send, test_t* t) {
  size_t len = 3 * 65536;
  unsigned char* buf = malloc(len);
  if (!CHECK(t, buf != NULL, "out of memory")) return;
  void* mh = STALE;
  ncclResult_t r = net_regmr(comm, buf, len, NCCL_PTR_HOST, &mh);
  CHECK(t, r == ncclSuccess, "regMr(%s comm, %zu bytes, NCCL_PTR_HOST) = %d",
        is_send ? "send" : "recv", len, r);
  CHECK(t, r != ncclSuccess || mh != STALE, "regMr succeeded without writing *mhandle");
  if (r == ncclSuccess) {
    r = net_deregmr(comm, mh);
    CHECK(t, r == ncclSuccess, "deregMr(comm, mhandle) = %d", r);
  }
  void* cmh = NULL;
  r = net_regmr(comm, buf, len, NCCL_PTR_CUDA, &cmh);
  CHECK(t, (r == ncclSuccess) == g_gpu_ok, "regMr(%s comm, NCCL_PTR_CUDA) = %d, but ptrSupport %s NCCL_PTR_CUDA",
        is_send ? "send" : "recv", r, g_gpu_ok ? "has" : "lacks");
  if (r == ncclSuccess) net_deregmr(comm, cmh);
  r = net_deregmr(comm, NULL);
  CHECK(t, r == ncclSuccess, "deregMr(comm, NULL) = %d (NCCL passes NULL mhandles)", r);
  free(buf);
}

/* Main data stream over one comm pair. */
static void test_data(void* comm, int is_send, uint64_t seed, ctl_t* ctl, test_t* t) {
  static msg_spec_t msgs[64];
  int n = make_msgs(seed, 1, KIND_MAIN, msgs, 64);
  stream_t s;
  if (stream_init(&s, t, ctl, comm, is_send, 0, msgs, n, seed, 1, 0, MAX_INFLIGHT) == 0)
    run_streams(&s, 1, DATA_DEADLINE_S);
  stream_fini(&s);
}

/* Railover's contract: a send completes only once the receiver acknowledged it, so with
 * no receive posted no send may complete (NULL requests are fine: "retry later"). */
static void test_send_before_recv(void* comm, int is_send, uint64_t seed, ctl_t* ctl, test_t* t) {
  static msg_spec_t msgs[MAX_INFLIGHT];
  int n = make_msgs(seed, 2, KIND_THREAD, msgs, MAX_INFLIGHT);
  stream_t s;
  if (stream_init(&s, t, ctl, comm, is_send, 0, msgs, n, seed, 2, 0, MAX_INFLIGHT) != 0) {
    ctl_abort(ctl);
    goto out;
  }
  if (is_send) {
    int posted = stream_post_only(&s, n, now_s() + 0.3);
    int r = posted < 0 ? -1 : stream_poll_oldest(&s, 0.3);
    if (r < 0) {
      ctl_abort(ctl);
      goto out;
    }
    note("send_before_recv: %d of %d sends accepted before any receive was posted "
         "(%ld NULL-request answers)", posted, n, s.null_retries);
    /* ncclIbIsend: no receive posted, no request ("call again"). */
    CHECK(t, posted == 0, "%d sends were accepted before the receiver posted any receive",
          posted);
    CHECK(t, r == 0, "a %zu-byte send completed before the receiver posted any receive",
          msgs[0].size);
    ctl_send(ctl, MSG_READY, 0, 0, NULL);
  } else if (ctl_recv(ctl, MSG_READY, NULL, CTL_TIMEOUT_MS, t) != 0) {
    goto out;
  }
  run_streams(&s, 1, DATA_DEADLINE_S);
out:
  stream_fini(&s);
}

/* Receives posted long before the sends: all 8 must be accepted at once, none may
 * complete before data exists. */
static void test_recv_before_send(void* comm, int is_send, uint64_t seed, ctl_t* ctl, test_t* t) {
  static msg_spec_t msgs[MAX_INFLIGHT];
  int n = make_msgs(seed, 3, KIND_THREAD, msgs, MAX_INFLIGHT);
  stream_t s;
  if (stream_init(&s, t, ctl, comm, is_send, 0, msgs, n, seed, 3, 0, MAX_INFLIGHT) != 0) {
    ctl_abort(ctl);
    goto out;
  }
  if (!is_send) {
    int posted = stream_post_only(&s, n, now_s() + 2.0);
    int r = posted < 0 ? -1 : stream_poll_oldest(&s, 0.3);
    if (r < 0) {
      ctl_abort(ctl);
      goto out;
    }
    CHECK(t, posted == n, "only %d of %d receives accepted on an idle comm (at least 8 must be)",
          posted, n);
    CHECK(t, r == 0, "a receive completed although nothing had been sent");
    ctl_send(ctl, MSG_READY, 0, 0, NULL);
  } else if (ctl_recv(ctl, MSG_READY, NULL, CTL_TIMEOUT_MS, t) != 0) {
    goto out;
  }
  run_streams(&s, 1, DATA_DEADLINE_S);
out:
  stream_fini(&s);
}

/* NCCL_NET_MAX_REQUESTS: one comm must hold 32 outstanding requests. The receiver posts 33
 * before anything is sent (the 33rd may be a NULL "retry later", not an error), then the
 * sender posts as many as it can; everything must then complete in order. */
static void test_depth32(void* comm, int is_send, uint64_t seed, ctl_t* ctl, test_t* t) {
  static msg_spec_t msgs[MAX_SLOTS];
  int n = make_msgs(seed, 4, KIND_THREAD, msgs, MAX_SLOTS);
  stream_t s;
  if (stream_init(&s, t, ctl, comm, is_send, 0, msgs, n, seed, 4, 1, MAX_SLOTS) != 0) {
    ctl_abort(ctl);
    goto out;
  }
  if (!is_send) {
    /* 32 with NULL answers retried for up to 2 s, then a single try at the 33rd. */
    int posted = stream_post_only(&s, MAX_REQUESTS, now_s() + 2.0);
    if (posted >= 0) posted = stream_post_only(&s, 1, 0);
    if (posted < 0) {
      ctl_abort(ctl);
      goto out;
    }
    note("depth32: %d of %d receives outstanding at once on one comm", posted, n);
    CHECK(t, posted >= MAX_REQUESTS, "only %d receives accepted on one comm (NCCL requires 32)",
          posted);
    ctl_send(ctl, MSG_READY, 0, 0, NULL);
  } else {
    if (ctl_recv(ctl, MSG_READY, NULL, CTL_TIMEOUT_MS, t) != 0) goto out;
    int posted = stream_post_only(&s, MAX_REQUESTS, now_s() + 2.0);
    if (posted >= 0) posted = stream_post_only(&s, 1, 0);
    if (posted < 0) {
      ctl_abort(ctl);
      goto out;
    }
    note("depth32: %d of %d sends outstanding at once on one comm", posted, n);
    CHECK(t, posted >= MAX_INFLIGHT, "only %d sends accepted with 33 receives posted", posted);
  }
  run_streams(&s, 1, DATA_DEADLINE_S);
out:
  stream_fini(&s);
}

/* The peer of `comm` is gone and test has reported it. Like NCCL's own transports, every
 * further isend/irecv still hands out a request (the remote error is not returned at
 * once), test reports ncclRemoteError or ncclSystemError, and the finished request gives
 * its slot back: twice MAX_REQUESTS of them must fit. */
static void check_requests_after_remote_error(test_t* t, void* comm, int is_send, void* buf,
                                              size_t size, void* mh) {
  const char* op = is_send ? "isend" : "irecv";
  int warns = __atomic_load_n(&g_warn_count, __ATOMIC_SEQ_CST);
  for (int i = 0; i < 2 * MAX_REQUESTS; i++) {
    void* req = STALE;
    double t0 = now_s();
    ncclResult_t r = is_send ? net_isend(comm, buf, size, 0, mh, NULL, &req)
                             : net_irecv(comm, buf, size, 0, mh, NULL, &req);
    if (!CHECK(t, r == ncclSuccess && req != NULL && req != STALE,
               "%s %d on a comm whose peer is gone = %d with request %p (want ncclSuccess and "
               "a request whose test reports the error)",
               op, i, r, req))
      return;
    int done = 0;
    r = net_test(req, &done, NULL);
    double dt = now_s() - t0;
    CHECK(t, dt < TEST_MAX_S, "%s and test on a comm whose peer is gone took %.2f s", op, dt);
    if (!CHECK(t, r == ncclRemoteError || r == ncclSystemError,
               "test of %s %d on a comm whose peer is gone = %d (done %d), want "
               "ncclRemoteError or ncclSystemError",
               op, i, r, done))
      return;
  }
  warns = __atomic_load_n(&g_warn_count, __ATOMIC_SEQ_CST) - warns;
  note("%d %ss after the remote error: each got a request, each test reported the error "
       "(%d WARN lines meanwhile)", 2 * MAX_REQUESTS, op, warns);
  /* The comm's failure was reported already: its later requests fail quietly (the other
   * thread's comm may log meanwhile). */
  CHECK(t, warns <= 2, "%d WARN lines for %d failed requests of a failed comm: one per comm "
        "is enough", warns, 2 * MAX_REQUESTS);
}

/* After an abort NCCL closes comms with requests outstanding. The sender closes with two
 * sends in flight while the receiver has four receives posted; both closes must return
 * promptly and succeed, and test() on the orphaned receives must not block. What those
 * receives report is not specified: it is printed. */
static void test_close_pending(void* ctx, int is_recv, uint64_t seed, ctl_t* ctl, test_t* t) {
  enum { N = 4, SENT = 2 };
  static msg_spec_t msgs[N];
  for (int i = 0; i < N; i++) msgs[i] = (msg_spec_t){1u << 20, 1u << 20};
  conn_t c;
  memset(&c, 0, sizeof c);
  stream_t s;
  memset(&s, 0, sizeof s);
  int rc = is_recv ? setup_recv(ctx, 0, &c, 1, ctl, t) : setup_send(ctx, 0, &c, 1, ctl, t);
  if (rc != 0 ||
      stream_init(&s, t, ctl, c.comm, !is_recv, 0, msgs, N, seed, 5, 1, MAX_INFLIGHT) != 0) {
    ctl_abort(ctl);
    goto out;
  }
  if (is_recv) {
    int posted = stream_post_only(&s, N, now_s() + 2.0);
    if (posted < 0) {
      ctl_abort(ctl);
      goto out;
    }
    ctl_send(ctl, MSG_READY, 0, 0, NULL);
    if (ctl_recv(ctl, MSG_CLOSED, NULL, CTL_TIMEOUT_MS, t) != 0) goto out;
    int completed = 0;
    ncclResult_t err = ncclSuccess;
    double end = now_s() + 3.0;
    while (completed < posted && now_s() < end) {
      slot_t* sl = &s.slots[completed % s.depth];
      int done = 0, sizes[PROXY_MAX_SUBS] = {0};
      double t0 = now_s();
      ncclResult_t r = net_test(sl->req, &done, sizes);
      double dt = now_s() - t0;
      CHECK(t, dt < TEST_MAX_S, "test() on a receive whose sender closed took %.2f s", dt);
      if (r != ncclSuccess) {
        err = r;
        break;
      }
      if (done) {
        long long bad = check_pattern(sl->buf, (size_t)sizes[0],
                                      msg_key(seed, 5, (uint32_t)completed));
        CHECK(t, sizes[0] == (int)msgs[completed].size && bad < 0,
              "receive %d completed after the sender closed with size %d (sent %zu), "
              "payload bad at %lld", completed, sizes[0], msgs[completed].size, bad);
        completed++;
        continue;
      }
      sched_yield();
    }
    note("close_pending: sender closed with %d sends in flight; %d of %d receives completed, "
         "then the next %s (code %d)", SENT, completed, posted,
         err != ncclSuccess ? "failed" : completed < posted ? "stayed pending for 3 s" : "-",
         err);
    CHECK(t, completed <= SENT, "%d receives completed but only %d were sent", completed, SENT);
    if (err != ncclSuccess)
      check_requests_after_remote_error(t, c.comm, 0, s.staging, s.slot_size, s.staging_mh);
  } else {
    if (ctl_recv(ctl, MSG_READY, NULL, CTL_TIMEOUT_MS, t) != 0) goto out;
    if (stream_post_only(&s, SENT, now_s() + 2.0) < 0) {
      ctl_abort(ctl);
      goto out;
    }
  }
  stream_dereg(&s);
  double t0 = now_s();
  ncclResult_t r = is_recv ? net_close_recv(c.comm) : net_close_send(c.comm);
  double dt = now_s() - t0;
  c.comm = NULL;
  CHECK(t, r == ncclSuccess, "close%s with requests outstanding = %d", is_recv ? "Recv" : "Send",
        r);
  CHECK(t, dt < CLOSE_MAX_S, "close%s with requests outstanding took %.1f s",
        is_recv ? "Recv" : "Send", dt);
  if (!is_recv) {
    /* NCCL frees its buffers once the comm is closed. Scribble over the send buffers
     * instead: a plugin still reading them makes the receiver see a bad payload. */
    memset(s.staging, 0xDD, s.slot_size * (size_t)s.depth);
    ctl_send(ctl, MSG_CLOSED, 0, 0, NULL);
    ctl_recv(ctl, MSG_RESULT, NULL, CTL_TIMEOUT_MS, t);
  } else {
    ctl_send(ctl, MSG_RESULT, 0, 0, NULL);
  }
out:
  if (c.comm) {
    stream_dereg(&s);
    if (is_recv)
      net_close_recv(c.comm);
    else
      net_close_send(c.comm);
  }
  stream_free(&s);
}

/* The receiver closes with four receives posted and nothing received, then the sender
 * sends into the closed comm. After closeRecv returns the plugin owns none of the receive
 * buffers any more (NCCL frees them): they are filled with a canary that must survive. */
static void test_close_recv_pending(void* ctx, int is_recv, uint64_t seed, ctl_t* ctl,
                                    test_t* t) {
  enum { N = 4 };
  static msg_spec_t msgs[N];
  for (int i = 0; i < N; i++) msgs[i] = (msg_spec_t){1u << 20, 1u << 20};
  conn_t c;
  memset(&c, 0, sizeof c);
  stream_t s;
  memset(&s, 0, sizeof s);
  int rc = is_recv ? setup_recv(ctx, 0, &c, 1, ctl, t) : setup_send(ctx, 0, &c, 1, ctl, t);
  if (rc != 0 ||
      stream_init(&s, t, ctl, c.comm, !is_recv, 0, msgs, N, seed, 6, 1, MAX_INFLIGHT) != 0) {
    ctl_abort(ctl);
    goto out;
  }
  size_t total = s.slot_size * (size_t)s.depth;
  if (is_recv) {
    if (stream_post_only(&s, N, now_s() + 2.0) < 0) {
      ctl_abort(ctl);
      goto out;
    }
    /* Close only once the sender has registered its buffers, as after a NCCL abort. */
    if (ctl_recv(ctl, MSG_READY, NULL, CTL_TIMEOUT_MS, t) != 0) goto out;
    stream_dereg(&s);
    double t0 = now_s();
    ncclResult_t r = net_close_recv(c.comm);
    double dt = now_s() - t0;
    c.comm = NULL;
    CHECK(t, r == ncclSuccess, "closeRecv with %d receives posted = %d", s.posted, r);
    CHECK(t, dt < CLOSE_MAX_S, "closeRecv with receives posted took %.1f s", dt);
    memset(s.staging, 0xDD, total);
    ctl_send(ctl, MSG_CLOSED, 0, 0, NULL);
    if (ctl_recv(ctl, MSG_RESULT, NULL, CTL_TIMEOUT_MS, t) != 0) goto out;
    struct timespec ts = {0, 200 * 1000 * 1000};
    nanosleep(&ts, NULL);
    long long bad = check_bytes(s.staging, total, 0xDD);
    CHECK(t, bad < 0,
          "the plugin wrote into receive buffer memory after closeRecv returned (byte %lld of "
          "%zu, receive %lld)", bad, total, bad / (long long)s.slot_size);
  } else {
    ctl_send(ctl, MSG_READY, 0, 0, NULL);
    if (ctl_recv(ctl, MSG_CLOSED, NULL, CTL_TIMEOUT_MS, t) != 0) goto out;
    /* The peer is gone: isend still hands out requests (as NCCL's own transports do) and
     * test reports the error; blocking and crashing are never fine. */
    int posted = 0, completed = 0;
    ncclResult_t err = ncclSuccess, post_err = ncclSuccess;
    void* reqs[N] = {0};
    double end = now_s() + 10.0;
    while (err == ncclSuccess && post_err == ncclSuccess && completed < N && now_s() < end) {
      double t0 = now_s();
      if (posted < N) {
        void* req = STALE;
        unsigned char* buf = s.staging + (size_t)posted * s.slot_size;
        fill_pattern(buf, msgs[posted].size, msg_key(seed, 6, (uint32_t)posted));
        post_err = net_isend(c.comm, buf, msgs[posted].size, 0, s.staging_mh, NULL, &req);
        if (post_err == ncclSuccess && req) reqs[posted++] = req;
      } else {
        int done = 0;
        ncclResult_t r = net_test(reqs[completed], &done, NULL);
        if (r == ncclSuccess && done) completed++;
        if (r != ncclSuccess) err = r;
      }
      CHECK(t, now_s() - t0 < TEST_MAX_S, "a data call on a comm whose peer closed took %.2f s",
            now_s() - t0);
      sched_yield();
    }
    note("close_recv_pending: after the receiver closed, %d sends posted, %d completed, "
         "%s (code %d)", posted, completed,
         err != ncclSuccess ? "then test reported an error" : "no error within 10 s", err);
    CHECK(t, post_err == ncclSuccess,
          "isend on a comm whose peer closed = %d; the error belongs in test", post_err);
    CHECK(t, completed == 0, "%d sends completed into a closed receiver", completed);
    if (CHECK(t, err == ncclRemoteError || err == ncclSystemError,
              "test after the receiver closed = %d, want ncclRemoteError or ncclSystemError",
              err)) {
      /* The requests still posted finish too (with the error), so their slots free up. */
      for (int i = completed + 1; i < posted; i++) {
        int done = 0;
        ncclResult_t r = ncclSuccess;
        double until = now_s() + 10.0;
        while (r == ncclSuccess && !done && now_s() < until) {
          r = net_test(reqs[i], &done, NULL);
          sched_yield();
        }
        CHECK(t, r != ncclSuccess || done, "send %d stayed pending after the peer closed", i);
      }
      check_requests_after_remote_error(t, c.comm, 1, s.staging, msgs[0].size, s.staging_mh);
    }
    stream_dereg(&s);
    double t0 = now_s();
    ncclResult_t r = net_close_send(c.comm);
    c.comm = NULL;
    CHECK(t, r == ncclSuccess, "closeSend after the peer closed = %d", r);
    CHECK(t, now_s() - t0 < CLOSE_MAX_S, "closeSend after the peer closed took %.1f s",
          now_s() - t0);
    ctl_send(ctl, MSG_RESULT, 0, 0, NULL);
  }
out:
  if (c.comm) {
    stream_dereg(&s);
    if (is_recv)
      net_close_recv(c.comm);
    else
      net_close_send(c.comm);
  }
  stream_free(&s);
}

/* A send larger than the posted receive, across two processes: as in NCCL's IB transport
 * (ncclIbIsend cuts the send to the buffer), both ends complete and report the 4096 bytes
 * that moved, which are the first 4096 of the send, and nothing is written past them. */
static void test_truncation(void* ctx, int is_recv, ctl_t* ctl, test_t* t) {
  enum { CAP = 4096, SEND = 8192 };
  conn_t c;
  memset(&c, 0, sizeof c);
  int rc = is_recv ? setup_recv(ctx, 0, &c, 1, ctl, t) : setup_send(ctx, 0, &c, 1, ctl, t);
  if (rc != 0) {
    ctl_abort(ctl);
    return;
  }
  unsigned char* buf = malloc(SEND + GUARD);
  void* mh = NULL;
  void* req = NULL;
  ncclResult_t r = ncclSuccess;
  int done = 0, reported = SIZES_SENTINEL;
  if (!CHECK(t, buf != NULL, "out of memory")) goto close;
  if (is_recv) {
    memset(buf, GUARD_BYTE, SEND + GUARD);
  } else {
    fill_pattern(buf, SEND, 0x77);
  }
  r = net_regmr(c.comm, buf, is_recv ? CAP : SEND, NCCL_PTR_HOST, &mh);
  if (!CHECK(t, r == ncclSuccess, "regMr = %d", r)) goto close;

  double deadline = now_s() + TRUNC_DEADLINE_S;
  if (is_recv) {
    do {
      req = STALE;
      r = net_irecv(c.comm, buf, CAP, 0, mh, NULL, &req);
    } while (r == ncclSuccess && req == NULL && now_s() < deadline && (sched_yield(), 1));
    ctl_send(ctl, MSG_READY, 0, 0, NULL);
  } else {
    if (ctl_recv(ctl, MSG_READY, NULL, CTL_TIMEOUT_MS, t) != 0) goto close;
    do {
      req = STALE;
      r = net_isend(c.comm, buf, SEND, 0, mh, NULL, &req);
    } while (r == ncclSuccess && req == NULL && now_s() < deadline && (sched_yield(), 1));
  }
  if (!CHECK(t, r == ncclSuccess && req != NULL && req != STALE, "%s = %d, request %p",
             is_recv ? "irecv" : "isend", r, req))
    goto close;
  while (!done && now_s() < deadline) {
    int sizes[PROXY_MAX_SUBS];
    for (int i = 0; i < PROXY_MAX_SUBS; i++) sizes[i] = SIZES_SENTINEL;
    r = net_test(req, &done, sizes);
    if (!CHECK(t, r == ncclSuccess, "test(%s of %d bytes) = %d", is_recv ? "receive" : "send",
               is_recv ? CAP : SEND, r))
      goto close;
    if (done) reported = sizes[0];
    sched_yield();
  }
  note("truncation: this side (%s) %s, reporting %d bytes", is_recv ? "recv 4096" : "send 8192",
       done ? "completed" : "still pending", reported);
  if (!CHECK(t, done, "the %s did not complete in %d s", is_recv ? "receive" : "send",
             TRUNC_DEADLINE_S))
    goto close;
  CHECK(t, reported == CAP, "an 8192-byte send into a 4096-byte receive: the %s reported %d "
        "bytes, not the 4096 that moved", is_recv ? "receive" : "send", reported);
  if (is_recv) {
    long long bad = check_pattern(buf, CAP, 0x77);
    CHECK(t, bad < 0, "the receive does not hold the send's first 4096 bytes (differs at %lld)",
          bad);
    long long g = check_bytes(buf + CAP, GUARD + SEND - CAP, GUARD_BYTE);
    CHECK(t, g < 0, "the receive wrote %lld bytes past its 4096-byte buffer", g + 1);
  }
close:
  if (mh) {
    r = net_deregmr(c.comm, mh);
    CHECK(t, r == ncclSuccess, "deregMr = %d", r);
  }
  if (c.comm) {
    double t0 = now_s();
    r = is_recv ? net_close_recv(c.comm) : net_close_send(c.comm);
    CHECK(t, now_s() - t0 < CLOSE_MAX_S, "close took %.1f s", now_s() - t0);
    CHECK(t, r == ncclSuccess, "close%s = %d", is_recv ? "Recv" : "Send", r);
  }
  free(buf);
}

/* ------------------------------------------------------------ two threads, two comms each */

typedef struct {
  int idx;
  int is_recv;
  uint64_t seed;
  ctl_t ctl;
  void* shared_ctx; /* v8-v10: the process-wide "context" is NULL anyway */
} thread_arg_t;

static void* comm_thread(void* p) {
  thread_arg_t* a = p;
  char name[3][32];
  snprintf(name[0], sizeof name[0], "thread%d.setup", a->idx);
  snprintf(name[1], sizeof name[1], "thread%d.data", a->idx);
  snprintf(name[2], sizeof name[2], "thread%d.close_order", a->idx);
  test_t ts, td, tc;
  conn_t c[2];
  memset(c, 0, sizeof c);
  c[1].pass_null_devcomm = 1;
  void* ctx = a->shared_ctx;

  test_begin(&ts, name[0]);
  if (P.v >= 11) {
    /* A new communicator: its own init, concurrent with the other thread's. */
    ncclResult_t r = net_init(&ctx, 0x1000 + (uint64_t)a->idx, profiler_callback);
    if (!CHECK(&ts, r == ncclSuccess, "init(commId 0x%x) = %d", 0x1000 + a->idx, r)) {
      ctl_abort(&a->ctl);
      test_end(&ts);
      return NULL;
    }
    any_props_t pr;
    r = get_props(0, &pr, 0xAB);
    CHECK(&ts, r == ncclSuccess, "getProperties(0) from a second init thread = %d", r);
  }
  int rc = a->is_recv ? setup_recv(ctx, 0, c, 2, &a->ctl, &ts)
                      : setup_send(ctx, 0, c, 2, &a->ctl, &ts);
  if (rc != 0) ctl_abort(&a->ctl);
  test_end(&ts);

  if (rc == 0) {
    test_begin(&td, name[1]);
    static msg_spec_t msgs[4][64];
    stream_t s[2];
    memset(s, 0, sizeof s);
    int ok = 1;
    static int phandle_dummy;
    for (int k = 0; k < 2 && ok; k++) {
      uint32_t id = 100 + (uint32_t)(a->idx * 2 + k);
      msg_spec_t* m = msgs[a->idx * 2 + k];
      /* Parent thread 0 receives, child thread 0 sends: same stream ids on both sides. */
      int n = make_msgs(a->seed, id, KIND_THREAD, m, 64);
      ok = stream_init(&s[k], &td, &a->ctl, c[k].comm, !a->is_recv, 7 + a->idx, m, n, a->seed,
                       id, 1, MAX_INFLIGHT) == 0;
      s[k].phandle = &phandle_dummy; /* NCCL passes profiler handles from v10 on */
    }
    if (!ok) ctl_abort(&a->ctl);
    if (ok) run_streams(s, 2, DATA_DEADLINE_S);
    stream_fini(&s[0]);
    stream_fini(&s[1]);
    test_end(&td);

    /* Comm 0: the sender closes first. Comm 1: the receiver closes first. */
    test_begin(&tc, name[2]);
    for (int k = 0; k < 2; k++) {
      int i_close_first = a->is_recv ? (k == 1) : (k == 0);
      if (!i_close_first && ctl_recv(&a->ctl, MSG_CLOSED, NULL, CTL_TIMEOUT_MS, &tc) != 0) break;
      double t0 = now_s();
      ncclResult_t r = a->is_recv ? net_close_recv(c[k].comm) : net_close_send(c[k].comm);
      double dt = now_s() - t0;
      c[k].comm = NULL;
      CHECK(&tc, r == ncclSuccess, "close%s(comm %d, %s) = %d", a->is_recv ? "Recv" : "Send", k,
            i_close_first ? "closing first" : "peer already closed", r);
      CHECK(&tc, dt < CLOSE_MAX_S, "close%s(comm %d) took %.1f s: it must not wait for the peer",
            a->is_recv ? "Recv" : "Send", k, dt);
      if (i_close_first) ctl_send(&a->ctl, MSG_CLOSED, (uint32_t)k, 0, NULL);
    }
    test_end(&tc);
  }
  for (int k = 0; k < 2; k++) {
    if (c[k].comm) {
      if (a->is_recv)
        net_close_recv(c[k].comm);
      else
        net_close_send(c[k].comm);
    }
    if (c[k].lc) net_close_listen(c[k].lc);
  }
  if (P.v >= 11 && ctx) {
    test_t tf;
    char fname[32];
    snprintf(fname, sizeof fname, "thread%d.finalize", a->idx);
    test_begin(&tf, fname);
    ncclResult_t r = net_finalize(ctx);
    CHECK(&tf, r == ncclSuccess, "finalize(ctx of commId 0x%x) = %d", 0x1000 + a->idx, r);
    test_end(&tf);
  }
  return NULL;
}

/* ------------------------------------------------------------ bad input */

static void test_bad_input(void* comm, int is_send, test_t* t) {
  int done = 0, sizes[PROXY_MAX_SUBS] = {0};
  unsigned char buf[64];
  void* req = NULL;
  ncclResult_t r;
  r = net_test(NULL, &done, sizes);
  CHECK(t, is_arg_error(r), "test(NULL request) = %d, expected 4 or 3", r);
  r = net_isend(NULL, buf, sizeof buf, 0, NULL, NULL, &req);
  CHECK(t, is_arg_error(r), "isend(NULL sendComm) = %d, expected 4 or 3", r);
  r = net_irecv(NULL, buf, sizeof buf, 0, NULL, NULL, &req);
  CHECK(t, is_arg_error(r), "irecv(NULL recvComm) = %d, expected 4 or 3", r);
  r = net_close_send(NULL);
  CHECK(t, is_arg_error(r), "closeSend(NULL) = %d, expected 4 or 3", r);
  r = net_close_recv(NULL);
  CHECK(t, is_arg_error(r), "closeRecv(NULL) = %d, expected 4 or 3", r);
  r = net_close_listen(NULL);
  CHECK(t, is_arg_error(r), "closeListen(NULL) = %d, expected 4 or 3", r);

  /* Close the main comm, then close it again: the second must be refused. */
  r = is_send ? net_close_send(comm) : net_close_recv(comm);
  CHECK(t, r == ncclSuccess, "close%s(main comm) = %d", is_send ? "Send" : "Recv", r);
  g_phase = t_phase = "bad_input (double close)";
  r = is_send ? net_close_send(comm) : net_close_recv(comm);
  CHECK(t, is_arg_error(r), "second close%s on the same comm = %d, expected 4 or 3",
        is_send ? "Send" : "Recv", r);
}

/* Further bad arguments a plugin should refuse rather than crash on. */
static void test_bad_input_more(void* ctx, test_t* t) {
  ncclResult_t r;
  any_props_t pr;
  r = get_props(P.ndev, &pr, 0xAB);
  CHECK(t, is_arg_error(r), "getProperties(dev %d = ndev) = %d, expected 4 or 3", P.ndev, r);
  r = get_props(-1, &pr, 0xAB);
  CHECK(t, is_arg_error(r), "getProperties(dev -1) = %d, expected 4 or 3", r);
  r = NET_CALL(getProperties, 0, NULL);
  CHECK(t, is_arg_error(r), "getProperties(0, NULL) = %d, expected 4 or 3", r);
  r = net_devices(NULL);
  CHECK(t, is_arg_error(r), "devices(NULL) = %d, expected 4 or 3", r);
  void* c = NULL;
  r = net_accept(NULL, &c, NULL);
  CHECK(t, is_arg_error(r), "accept(NULL listenComm) = %d, expected 4 or 3", r);
  void* lc = NULL;
  r = net_listen(ctx, 0, NULL, &lc);
  CHECK(t, is_arg_error(r), "listen(handle NULL) = %d, expected 4 or 3", r);
  if (r == ncclSuccess && lc) net_close_listen(lc);
  unsigned char buf[16];
  void* mh = NULL;
  r = net_regmr(NULL, buf, sizeof buf, NCCL_PTR_HOST, &mh);
  CHECK(t, is_arg_error(r), "regMr(NULL comm) = %d, expected 4 or 3", r);
}

/* NCCL dlcloses the library after the last finalize and opens it again for the next
 * communicator: everything must work a second time. */
static void test_reload(const char* so, test_t* t) {
  int ndev = P.ndev;
  if (load_plugin(so, t) != 0) return;
  void* ctx = NULL;
  ncclResult_t r = net_init(&ctx, 0xC0FFEE + 1, NULL);
  if (!CHECK(t, r == ncclSuccess && ctx != NULL, "init after reload = %d, ctx %p", r, ctx)) return;
  int n = -1;
  r = net_devices(&n);
  CHECK(t, r == ncclSuccess && n == ndev, "devices after reload = %d, %d devices (before: %d)", r,
        n, ndev);
  any_props_t pr;
  r = get_props(0, &pr, 0xAB);
  CHECK(t, r == ncclSuccess, "getProperties(0) after reload = %d", r);
  test_loopback_one_thread(ctx, t);
  r = net_finalize(ctx);
  CHECK(t, r == ncclSuccess, "finalize after reload = %d", r);
  CHECK(t, dlclose(P.dl) == 0, "second dlclose: %s", dlerror());
}

/* ------------------------------------------------------------ one process */

static int run(const char* so, int is_recv, uint64_t seed, ctl_t* ctl, ctl_t thr[2]) {
  test_t t;
  void* ctx = NULL;
  conn_t main_conn;
  memset(&main_conn, 0, sizeof main_conn);
  int ok;

  test_begin(&t, "load");
  ok = load_plugin(so, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "init");
  ncclResult_t r = net_init(&ctx, 0xC0FFEE, NULL);
  ok = CHECK(&t, r == ncclSuccess, "init = %d", r);
  if (P.v >= 11) CHECK(&t, ctx != NULL, "init succeeded but returned a NULL context");
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "devices");
  P.ndev = -12345;
  r = net_devices(&P.ndev);
  ok = CHECK(&t, r == ncclSuccess, "devices = %d", r) &&
       CHECK(&t, P.ndev > 0 && P.ndev < 1024, "devices reported %d devices", P.ndev);
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "properties");
  P.maxRecvs = 1;
  test_properties(&t);
  test_end(&t);

  test_begin(&t, "loopback_one_thread");
  test_loopback_one_thread(ctx, &t);
  test_end(&t);

  test_begin(&t, "grouped_receive");
  test_grouped_receive(ctx, &t);
  test_end(&t);

  test_begin(&t, "tag_matching");
  test_tag_matching(ctx, &t);
  test_end(&t);

  test_begin(&t, "connect");
  ok = (is_recv ? setup_recv(ctx, 0, &main_conn, 1, ctl, &t)
                : setup_send(ctx, 0, &main_conn, 1, ctl, &t)) == 0;
  test_end(&t);
  if (!ok) {
    ctl_abort(ctl);
    return -1;
  }

  test_begin(&t, "regmr");
  test_regmr(main_conn.comm, !is_recv, &t);
  test_end(&t);

  test_begin(&t, "data");
  test_data(main_conn.comm, !is_recv, seed, ctl, &t);
  ok = barrier(ctl, 1, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "send_before_recv");
  test_send_before_recv(main_conn.comm, !is_recv, seed, ctl, &t);
  ok = barrier(ctl, 10, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "recv_before_send");
  test_recv_before_send(main_conn.comm, !is_recv, seed, ctl, &t);
  ok = barrier(ctl, 11, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "depth32");
  test_depth32(main_conn.comm, !is_recv, seed, ctl, &t);
  ok = barrier(ctl, 12, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "truncation");
  test_truncation(ctx, is_recv, ctl, &t);
  ok = barrier(ctl, 2, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "close_pending");
  test_close_pending(ctx, is_recv, seed, ctl, &t);
  ok = barrier(ctl, 13, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "close_recv_pending");
  test_close_recv_pending(ctx, is_recv, seed, ctl, &t);
  ok = barrier(ctl, 14, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  /* Parent: thread 0 receives, thread 1 sends; the child the other way round. */
  g_phase = "threads";
  thread_arg_t targ[2];
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    targ[i] = (thread_arg_t){.idx = i, .is_recv = is_recv ? (i == 0) : (i == 1), .seed = seed,
                             .ctl = thr[i], .shared_ctx = ctx};
    if (pthread_create(&th[i], NULL, comm_thread, &targ[i]) != 0) {
      test_begin(&t, "threads");
      test_fail(&t, "pthread_create failed");
      test_end(&t);
      return -1;
    }
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  test_begin(&t, "threads");
  ok = barrier(ctl, 3, &t) == 0;
  test_end(&t);
  if (!ok) return -1;

  test_begin(&t, "bad_input");
  test_bad_input(main_conn.comm, !is_recv, &t);
  main_conn.comm = NULL;
  test_end(&t);

  test_begin(&t, "bad_input_more");
  test_bad_input_more(ctx, &t);
  test_end(&t);

  test_begin(&t, "finalize");
  if (P.v >= 11) {
    r = net_finalize(ctx);
    CHECK(&t, r == ncclSuccess, "finalize(ctx) = %d", r);
    /* After the last finalize NCCL dlcloses the library: no plugin thread may be left. */
    g_phase = "finalize (dlclose)";
    int dr = dlclose(P.dl);
    CHECK(&t, dr == 0, "dlclose: %s", dlerror());
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, NULL);
    test_end(&t);
    test_begin(&t, "reload");
    test_reload(so, &t);
    test_end(&t);
  } else {
    note("finalize: v%d has no finalize; library stays loaded", P.v);
    test_end(&t);
  }
  test_begin(&t, "teardown");
  barrier(ctl, 4, &t);
  test_end(&t);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s <plugin.so> <version 8..12> [seed]\n", argv[0]);
    return 2;
  }
  const char* so = argv[1];
  g_version = atoi(argv[2]);
  if (g_version < 8 || g_version > 12) {
    fprintf(stderr, "version must be 8..12\n");
    return 2;
  }
  uint64_t seed;
  const char* env_seed = getenv("RAILOVER_ABI_SEED");
  if (argc > 3)
    seed = strtoull(argv[3], NULL, 0);
  else if (env_seed && *env_seed)
    seed = strtoull(env_seed, NULL, 0);
  else
    seed = splitmix64((uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32));
  g_verbose = getenv("RAILOVER_ABI_VERBOSE") != NULL;
  const char* env_ptr = getenv("RAILOVER_ABI_PTR");
  if (env_ptr && strcmp(env_ptr, "cuda") == 0) g_data_ptr = NCCL_PTR_CUDA;

  setvbuf(stdout, NULL, _IOLBF, 0);
  /* Tests may only use loopback. */
  setenv("RAILOVER_IFNAME", "lo", 1);
  printf("driver: plugin %s, ncclNetPlugin_v%d, seed 0x%016" PRIx64
         " (rerun with RAILOVER_ABI_SEED=0x%" PRIx64 ")\n",
         so, g_version, seed, seed);

  int sp[3][2];
  for (int i = 0; i < 3; i++) {
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp[i]) != 0) {
      perror("socketpair");
      return 2;
    }
  }
  install_signal_handlers();
  fflush(stdout);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    return 2;
  }
  int is_recv = pid > 0;
  ctl_t ctl = {.fd = sp[0][is_recv ? 0 : 1]};
  ctl_t thr[2] = {{.fd = sp[1][is_recv ? 0 : 1]}, {.fd = sp[2][is_recv ? 0 : 1]}};
  for (int i = 0; i < 3; i++) close(sp[i][is_recv ? 1 : 0]);
  if (pid == 0) {
    g_role = "send";
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(3);
  } else {
    g_role = "recv";
    g_child = pid;
  }
  alarm(OVERALL_ALARM_S);

  run(so, is_recv, seed, &ctl, thr);
  int failures = __atomic_load_n(&g_failures, __ATOMIC_SEQ_CST);
  printf("  [%s] %d failed test(s), %d WARN log line(s) from the plugin\n", g_role, failures,
         g_warn_count);
  fflush(stdout);

  if (pid == 0) _exit(failures ? 1 : 0);

  /* Parent: give the child a while to finish, then kill it; always reap it. */
  if (failures) ctl_abort(&ctl);
  int status = 0;
  double deadline = now_s() + (failures ? 10.0 : 60.0);
  pid_t w;
  while ((w = waitpid(pid, &status, WNOHANG)) == 0 && now_s() < deadline) {
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  if (w == 0) {
    printf("FAIL recv.child: sender process did not exit; killing it\n");
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    failures++;
  } else if (WIFSIGNALED(status)) {
    printf("FAIL recv.child: sender process died with signal %d\n", WTERMSIG(status));
    failures++;
  } else if (WEXITSTATUS(status) != 0) {
    printf("FAIL recv.child: sender process exited with status %d\n", WEXITSTATUS(status));
    failures++;
  }
  g_child = 0;
  printf("driver v%d: %s\n", g_version, failures ? "FAILED" : "all checks passed");
  return failures ? 1 : 0;
}
