/*
 * Bad RAILOVER_* values must reach NCCL's log, run by tests/abi.rs.
 *
 *   env_warn <path to librailover.so>
 *
 * dlopens the plugin, hands v12 `init` a logger of NCCL's type (variadic, printf-style)
 * and, for each bad value, checks that `init` fails with ncclInvalidArgument and that
 * exactly one WARN line came with it, naming the variable, the value and what is
 * accepted. Values that are not UTF-8 are set for every variable the plugin reads: they
 * are errors, not "unset". Numbers and keywords are strict: blanks around them, a sign
 * or a trailing newline make a bad value. RAILOVER_SYSFS_ROOT must be a directory with a
 * class/net directory. Last, an interface filter that matches nothing must give a WARN
 * naming the filter and the interfaces there are, and 0 devices.
 *
 * Prints "PASS <check>" or "FAIL <check>: <why>" and exits 0 only if all passed. Uses
 * only loopback (no endpoint is bound: RAILOVER_METRICS_PORT=off where init succeeds).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nccl_net.h"

static int g_failures;
static int g_warns;
static char g_last_warn[4096];

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                   const char* fmt, ...) {
  (void)flags;
  (void)file;
  (void)line;
  if (level != NCCL_LOG_WARN) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_warn, sizeof g_last_warn, fmt, ap);
  va_end(ap);
  g_warns++;
}

static void check(int ok, const char* name, const char* fmt, ...) {
  if (ok) {
    printf("PASS %s\n", name);
    return;
  }
  char why[4096 + 256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  printf("FAIL %s: %s\n", name, why);
  g_failures++;
}

static ncclNet_v12_t* net;

static ncclResult_t init_once(void** ctx) {
  ncclNetCommConfig_v12_t config = {.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF};
  g_warns = 0;
  g_last_warn[0] = 0;
  *ctx = NULL;
  return net->init(ctx, 0, &config, logger, NULL);
}

/* One bad value: init fails, with one WARN naming `var`, `shown` and "expected". */
static void bad_value(const char* var, const char* value, const char* shown) {
  char name[256];
  snprintf(name, sizeof name, "bad.%s", var);
  const char* had = getenv(var);
  char* old = had ? strdup(had) : NULL;
  setenv(var, value, 1);
  void* ctx;
  ncclResult_t r = init_once(&ctx);
  if (old)
    setenv(var, old, 1);
  else
    unsetenv(var);
  free(old);
  if (r == ncclSuccess) {
    net->finalize(ctx);
    check(0, name, "init accepted %s=%s", var, shown);
    return;
  }
  printf("  WARN: %s\n", g_last_warn);
  check(r == ncclInvalidArgument && g_warns == 1 && strstr(g_last_warn, var) &&
            strstr(g_last_warn, shown) && strstr(g_last_warn, "expected"),
        name, "init = %d with %d WARN line(s) for %s=%s; last: \"%s\"", r, g_warns, var, shown,
        g_last_warn);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s <plugin.so>\n", argv[0]);
    return 2;
  }
  void* dl = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    printf("FAIL dlopen: %s\n", dlerror());
    return 1;
  }
  net = (ncclNet_v12_t*)dlsym(dl, "ncclNetPlugin_v12");
  if (!net) {
    printf("FAIL dlsym: %s\n", dlerror());
    return 1;
  }
  /* No endpoint, and where a value turns it on, on loopback only. */
  setenv("RAILOVER_METRICS_PORT", "off", 1);
  setenv("RAILOVER_METRICS_ADDR", "127.0.0.1", 1);
  setenv("RAILOVER_IFNAME", "lo", 1);

  /* Values the parsers refuse, as text. */
  bad_value("RAILOVER_SPIN_US", "fast", "fast");
  bad_value("RAILOVER_LOG", "loud", "loud");
  bad_value("RAILOVER_IFNAME", "^", "^");
  bad_value("RAILOVER_COMPLETION_TIMEOUT_MS", "5", "5");
  bad_value("RAILOVER_RAILS", "lo", "lo");
  bad_value("RAILOVER_METRICS_ADDR", "everywhere", "everywhere");
  bad_value("RAILOVER_STRIPES", "many", "many");
  bad_value("RAILOVER_STRIPE_WEIGHTS", "fast", "fast");
  bad_value("RAILOVER_TRANSPORT", "rdma", "rdma");
  bad_value("RAILOVER_HCA", "mlx5_0:x", "mlx5_0:x");
  bad_value("RAILOVER_PROGRESS", "both", "both");
  bad_value("RAILOVER_IB_GID_INDEX", "first", "first");
  bad_value("RAILOVER_IB_ROCE_VERSION", "3", "3");
  bad_value("RAILOVER_IB_ADDR_FAMILY", "AF_UNIX", "AF_UNIX");
  bad_value("RAILOVER_IB_TIMEOUT", "32", "32");
  bad_value("RAILOVER_IB_RETRY_CNT", "8", "8");
  bad_value("RAILOVER_IB_TC", "256", "256");
  bad_value("RAILOVER_IB_SL", "16", "16");
  bad_value("RAILOVER_QPS_PER_LANE", "17", "17");
  bad_value("RAILOVER_ZERO_COPY", "sometimes", "sometimes");
  bad_value("RAILOVER_CONTROL_DIR", "relative/dir", "relative/dir");
  bad_value("RAILOVER_DRAIN_FILE", "drain.txt", "drain.txt");
  bad_value("RAILOVER_GDR", "yes", "yes");
  bad_value("RAILOVER_GDR_HCA", "mlx5_0:0", "mlx5_0:0");
  bad_value("RAILOVER_UNMATCHED_WARN_MS", "0", "0");
  bad_value("LOCAL_RANK", "first", "first");

  /* Numbers are plain decimal digits: no blanks around them, no sign, no newline. The
   * WARN shows the value quoted and escaped, as Rust's {:?} does. */
  bad_value("RAILOVER_SPIN_US", " 5", "RAILOVER_SPIN_US=\" 5\"");
  bad_value("RAILOVER_PROBE_BYTES", "4096 ", "RAILOVER_PROBE_BYTES=\"4096 \"");
  bad_value("RAILOVER_STRIPES", "2\t", "RAILOVER_STRIPES=\"2\\t\"");
  bad_value("RAILOVER_COMPLETION_TIMEOUT_MS", "+250", "RAILOVER_COMPLETION_TIMEOUT_MS=\"+250\"");
  bad_value("RAILOVER_IB_TIMEOUT", "+20", "RAILOVER_IB_TIMEOUT=\"+20\"");
  bad_value("RAILOVER_GIVEUP_MS", "5000\n", "RAILOVER_GIVEUP_MS=\"5000\\n\"");
  bad_value("RAILOVER_QPS_PER_LANE", "2\n", "RAILOVER_QPS_PER_LANE=\"2\\n\"");
  bad_value("RAILOVER_RAILS", "lo:+0", "RAILOVER_RAILS=\"lo:+0\"");
  bad_value("RAILOVER_HCA", "mlx5_0: 1", "RAILOVER_HCA=\"mlx5_0: 1\"");
  bad_value("RAILOVER_METRICS_PORT", " 9000", "RAILOVER_METRICS_PORT=\" 9000\"");
  bad_value("RAILOVER_METRICS_PORT", "+9000", "RAILOVER_METRICS_PORT=\"+9000\"");
  bad_value("RAILOVER_METRICS_PORT", "9000\n", "RAILOVER_METRICS_PORT=\"9000\\n\"");
  bad_value("LOCAL_RANK", " 1", "LOCAL_RANK=\" 1\"");
  bad_value("LOCAL_RANK", "+1", "LOCAL_RANK=\"+1\"");
  bad_value("LOCAL_RANK", "1\n", "LOCAL_RANK=\"1\\n\"");
  /* Keywords keep their case but not surrounding blanks; lists take no blanks. */
  bad_value("RAILOVER_LOG", " info", "RAILOVER_LOG=\" info\"");
  bad_value("RAILOVER_TRANSPORT", "tcp\n", "RAILOVER_TRANSPORT=\"tcp\\n\"");
  bad_value("RAILOVER_METRICS_PORT", "off ", "RAILOVER_METRICS_PORT=\"off \"");
  bad_value("RAILOVER_IFNAME", "lo, eth0", "RAILOVER_IFNAME=\"lo, eth0\"");

  /* RAILOVER_SYSFS_ROOT must exist and look like sysfs. */
  bad_value("RAILOVER_SYSFS_ROOT", "/nonexistent",
            "RAILOVER_SYSFS_ROOT=\"/nonexistent\" is not valid: expected an existing directory "
            "laid out like /sys, with a class/net directory (this one does not exist)");
  bad_value("RAILOVER_SYSFS_ROOT", "/",
            "RAILOVER_SYSFS_ROOT=\"/\" is not valid: expected an existing directory laid out "
            "like /sys, with a class/net directory (this one has none)");
  /* 100 kB: refused, and the WARN shows its start and length, so what is accepted still
   * fits in the line (g_last_warn keeps 4 kB, NCCL's last error 1 kB). */
  {
    size_t n = 100000;
    char* huge = malloc(n + 1);
    memset(huge, 'a', n);
    huge[n] = 0;
    char shown[256];
    snprintf(shown, sizeof shown, "RAILOVER_SYSFS_ROOT=\"%.48s\"\xe2\x80\xa6 (100000 bytes)", huge);
    bad_value("RAILOVER_SYSFS_ROOT", huge, shown);
    check(strlen(g_last_warn) < 1024, "bad.RAILOVER_SYSFS_ROOT.short_warn",
          "the WARN is %zu bytes long", strlen(g_last_warn));
    free(huge);
  }
  /* A tree that has class/net is taken, without a WARN. */
  {
    char root[] = "/tmp/railover-env-warn.XXXXXX";
    char class_dir[sizeof root + 16], net_dir[sizeof root + 16];
    if (!mkdtemp(root)) {
      check(0, "good.sysfs_root", "mkdtemp failed");
    } else {
      snprintf(class_dir, sizeof class_dir, "%s/class", root);
      snprintf(net_dir, sizeof net_dir, "%s/class/net", root);
      mkdir(class_dir, 0755);
      mkdir(net_dir, 0755);
      setenv("RAILOVER_SYSFS_ROOT", root, 1);
      void* ctx;
      ncclResult_t r = init_once(&ctx);
      unsetenv("RAILOVER_SYSFS_ROOT");
      check(r == ncclSuccess && g_warns == 0, "good.sysfs_root",
            "init = %d with %d WARN line(s) for RAILOVER_SYSFS_ROOT=%s: %s", r, g_warns, root,
            g_last_warn);
      if (r == ncclSuccess) net->finalize(ctx);
      rmdir(net_dir);
      rmdir(class_dir);
      rmdir(root);
    }
  }

  /* Not UTF-8: an error for every variable, shown with U+FFFD for the bad bytes. Some
   * of these would be accepted as text (a path, an interface name). */
  static const char* vars[] = {
      "RAILOVER_IFNAME",           "RAILOVER_SPIN_US",
      "RAILOVER_LOG",              "RAILOVER_COMPLETION_TIMEOUT_MS",
      "RAILOVER_PROBE_TIMEOUT_MS", "RAILOVER_FAILBACK_INTERVAL_MS",
      "RAILOVER_FAILBACK_PROBES",  "RAILOVER_PROBE_BYTES",
      "RAILOVER_FAIR_SHARE",       "RAILOVER_LOOPBACK_NICS",
      "RAILOVER_RAIL_RULE",        "RAILOVER_DISTANCE_LIMIT",
      "RAILOVER_RAILS",            "RAILOVER_SYSFS_ROOT",
      "RAILOVER_METRICS_PORT",     "RAILOVER_METRICS_ADDR",
      "RAILOVER_GIVEUP_MS",        "RAILOVER_STRIPES",
      "RAILOVER_TRANSPORT",        "RAILOVER_HCA",
      "RAILOVER_IB_GID_INDEX",     "RAILOVER_IB_ROCE_VERSION",
      "RAILOVER_IB_ADDR_FAMILY",   "RAILOVER_IB_TIMEOUT",
      "RAILOVER_IB_RETRY_CNT",     "RAILOVER_IB_TC",
      "RAILOVER_IB_SL",            "RAILOVER_QPS_PER_LANE",
      "RAILOVER_ZERO_COPY",        "RAILOVER_GDR",
      "RAILOVER_GDR_HCA",          "RAILOVER_UNMATCHED_WARN_MS",
      "RAILOVER_PROGRESS",         "LOCAL_RANK",
      "RAILOVER_CONTROL_DIR",      "RAILOVER_DRAIN_FILE",
      "RAILOVER_STRIPE_WEIGHTS",
  };
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
    bad_value(vars[i], "lo\xff\xfe", "lo\xef\xbf\xbd");

  /* Odd values for every variable: each is either accepted or refused with one WARN
   * naming the variable; nothing is refused silently. */
  static const char* odd[] = {"",   " ",    "0",  "-1", "1e3", "18446744073709551616",
                              "off", "on",  "^",  "=",  ",",   "lo,",
                              "\t", "%s%n", "1\n2", "\xc3\x28", "65536", "::"};
  int refused = 0, accepted = 0;
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    for (size_t j = 0; j < sizeof odd / sizeof odd[0]; j++) {
      const char* had = getenv(vars[i]);
      char* old = had ? strdup(had) : NULL;
      setenv(vars[i], odd[j], 1);
      void* ctx;
      ncclResult_t r = init_once(&ctx);
      if (old)
        setenv(vars[i], old, 1);
      else
        unsetenv(vars[i]);
      free(old);
      if (r == ncclSuccess) {
        accepted++;
        net->finalize(ctx);
        continue;
      }
      refused++;
      char name[256];
      snprintf(name, sizeof name, "odd.%s.%zu", vars[i], j);
      if (!(r == ncclInvalidArgument && g_warns == 1 && strstr(g_last_warn, vars[i]) &&
            strstr(g_last_warn, "expected")))
        check(0, name, "init = %d with %d WARN line(s); last: \"%s\"", r, g_warns,
              g_last_warn);
    }
  }
  printf("odd values: %d refused, each with one WARN naming its variable; %d accepted\n",
         refused, accepted);

  /* A filter that matches nothing: init succeeds with 0 devices and one WARN naming the
   * filter and the interfaces that exist (loopback is always there). */
  setenv("RAILOVER_IFNAME", "=nosuchif0", 1);
  void* ctx;
  ncclResult_t r = init_once(&ctx);
  int ndev = -1;
  if (r == ncclSuccess) net->devices(&ndev);
  check(r == ncclSuccess && ndev == 0 && g_warns == 1 && strstr(g_last_warn, "nosuchif0") &&
            strstr(g_last_warn, "lo ("),
        "ifname.matches_nothing", "init = %d, %d devices, %d WARN line(s); last: \"%s\"", r,
        ndev, g_warns, g_last_warn);
  if (r == ncclSuccess) net->finalize(ctx);

  /* And a good configuration warns about nothing. */
  setenv("RAILOVER_IFNAME", "lo", 1);
  r = init_once(&ctx);
  check(r == ncclSuccess && g_warns == 0, "good.no_warn", "init = %d with %d WARN line(s): %s",
        r, g_warns, g_last_warn);
  if (r == ncclSuccess) net->finalize(ctx);

  printf("env_warn: %s\n", g_failures ? "FAILED" : "all checks passed");
  return g_failures ? 1 : 0;
}
