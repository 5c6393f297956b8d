/* error.c — the per-thread error message that every failing call leaves
 * behind (API.md §1), and small formatting helpers for messages. */
#include <stdarg.h>
#include <stdio.h>

#include "runtime.h"

static _Thread_local char error_message[1024];

const char *kiln_version(void) { return "0.1.0"; }

const char *kiln_last_error(void) { return error_message; }

void kiln_clear_error(void) { error_message[0] = '\0'; }

bool kiln_has_error(void) { return error_message[0] != '\0'; }

static void set_error_v(const char *fmt, va_list ap) {
  vsnprintf(error_message, sizeof error_message, fmt, ap);
}

int kiln_set_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error_v(fmt, ap);
  va_end(ap);
  return -1;
}

int kiln_fail(const char *fmt, ...) {
  if (!fmt) return kiln_set_error("fail: (no message)");
  va_list ap;
  va_start(ap, fmt);
  set_error_v(fmt, ap);
  va_end(ap);
  return -1;
}

char *shape_str(char *buf, size_t n, int rank, const int64_t *shape) {
  size_t used = (size_t)snprintf(buf, n, "(");
  for (int i = 0; i < rank && used < n; i++)
    used += (size_t)snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)shape[i]);
  if (used < n) snprintf(buf + used, n - used, rank == 1 ? ",)" : ")");
  return buf;
}
