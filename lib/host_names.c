/* host_names.c — the library's own host callbacks by name (runtime.h), so
 * that the IR text of a trace that embeds one (a staged label check) parses
 * back, and a saved function loads, bound to the same callback. */
#include <string.h>

#include "runtime.h"

static const struct {
  const char *name;
  kiln_host_fn fn;
  bool check; /* its only effect is to fail: it reads its inputs and passes one on */
} builtins[] = {
    {"kiln.check_labels", composite_check_labels_host, true},
};
#define N_BUILTINS ((int)(sizeof builtins / sizeof builtins[0]))

kiln_host_fn host_builtin_fn(const char *name) {
  for (int i = 0; i < N_BUILTINS; i++)
    if (!strcmp(builtins[i].name, name)) return builtins[i].fn;
  return NULL;
}

const char *host_builtin_name(kiln_host_fn fn) {
  for (int i = 0; i < N_BUILTINS; i++)
    if (builtins[i].fn == fn) return builtins[i].name;
  return NULL;
}

bool host_builtin_is_check(kiln_host_fn fn) {
  for (int i = 0; i < N_BUILTINS; i++)
    if (builtins[i].fn == fn) return builtins[i].check;
  return false;
}
