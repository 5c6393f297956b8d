/* device.c — the device list (cpu:0 first; GPUs join with the CUDA
 * backend) and the per-thread device-scope stack of API.md §7. */
#include <stdlib.h>

#include "ops.h"

static const char *const device_names[] = {"cpu:0"};
static const int n_devices = 1;

enum { DEVICE_STACK = 64 };
static _Thread_local int device_stack[DEVICE_STACK];
static _Thread_local int device_depth;

int kiln_device_count(void) { return n_devices; }

const char *kiln_device_name(int i) { return i >= 0 && i < n_devices ? device_names[i] : NULL; }

int device_find(const char *name) {
  if (!name) return -1;
  for (int i = 0; i < n_devices; i++)
    if (strcmp(name, device_names[i]) == 0) return i;
  if (strcmp(name, "cpu") == 0) return 0;
  return -1;
}

static int unknown_device(const char *op, const char *name) {
  char list[256] = "";
  size_t used = 0;
  for (int i = 0; i < n_devices && used < sizeof list; i++)
    used += (size_t)snprintf(list + used, sizeof list - used, i ? ", %s" : "%s", device_names[i]);
  return kiln_set_error("%s: unknown device '%s' (devices: %s)", op, name ? name : "(null)", list);
}

int device_current(void) { return device_depth ? device_stack[device_depth - 1] : 0; }

const char *kiln_device_current(void) { return device_names[device_current()]; }

int kiln_device_push(const char *name) {
  int d = device_find(name);
  if (d < 0) return unknown_device("device_push", name);
  if (device_depth == DEVICE_STACK)
    return kiln_set_error("device_push: device scopes nest deeper than %d", DEVICE_STACK);
  device_stack[device_depth++] = d;
  return 0;
}

void kiln_device_pop(void) {
  if (device_depth > 0) device_depth--;
}

kiln_tensor *kiln_to_device(kiln_tensor *t, const char *name) {
  if (!t) {
    if (!kiln_has_error()) kiln_set_error("to_device: input is NULL");
    return NULL;
  }
  int d = device_find(name);
  if (d < 0) {
    unknown_device("to_device", name);
    return NULL;
  }
  /* one device so far: the tensor is already there; immutable, so share it */
  return scope_own(kiln_retain(t));
}
