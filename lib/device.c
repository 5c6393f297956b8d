/* device.c — the device list (cpu:0 first, then the GPUs a registered
 * backend finds at first use, then on rank 0 the remote devices other ranks
 * serve), the per-thread device-scope stack of API.md §7, and copies of
 * tensors between devices. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "ops.h"

static const device_backend *gpu_backend;
static pthread_once_t devices_once = PTHREAD_ONCE_INIT;
static int n_devices = 1; /* local: cpu:0 and the GPUs */
static _Atomic int n_remote;
static pthread_mutex_t add_mutex = PTHREAD_MUTEX_INITIALIZER;
static char device_names[KILN_MAX_DEVICES][24] = {"cpu:0"};

enum { DEVICE_STACK = 64 };
static _Thread_local int device_stack[DEVICE_STACK];
static _Thread_local int device_depth;
_Thread_local int device_now KILN_TLS_FAST;

void device_register(const device_backend *b) { gpu_backend = b; }

/* Asks the backend once (it loads the driver then): nothing about GPUs is
 * decided at load time, so a process that never names a device never opens
 * the driver. */
static void devices_init(void) {
  int g = gpu_backend ? gpu_backend->count() : 0;
  if (g > KILN_MAX_DEVICES - 1) g = KILN_MAX_DEVICES - 1;
  for (int i = 0; i < g; i++) snprintf(device_names[i + 1], sizeof device_names[0], "gpu:%d", i);
  n_devices = 1 + g;
}

static int devices_ready(void) {
  pthread_once(&devices_once, devices_init);
  return n_devices;
}

int device_add(const char *name) {
  int local = devices_ready();
  pthread_mutex_lock(&add_mutex);
  int d = local + n_remote;
  if (d < KILN_MAX_DEVICES) {
    snprintf(device_names[d], sizeof device_names[0], "%s", name);
    n_remote++; /* after the name: a reader that sees the count sees the name */
  }
  pthread_mutex_unlock(&add_mutex);
  return d < KILN_MAX_DEVICES ? d : -1;
}

bool device_is_remote(int device) { return device > 0 && device >= devices_ready() && device < KILN_MAX_DEVICES; }

int kiln_device_count(void) {
  remote_refresh();
  return devices_ready() + n_remote;
}

/* cpu:0 is known without asking the backend: CPU-only work never loads a driver */
const char *kiln_device_name(int i) {
  return i == 0 || (i > 0 && i < devices_ready() + n_remote) ? device_names[i] : NULL;
}

int device_find(const char *name) {
  if (!name) return -1;
  if (strcmp(name, "cpu:0") == 0 || strcmp(name, "cpu") == 0) return 0;
  if (strncmp(name, "task:", 5) == 0) return remote_find(name);
  int n = devices_ready();
  for (int i = 1; i < n; i++)
    if (strcmp(name, device_names[i]) == 0) return i;
  if (strcmp(name, "gpu") == 0 && n > 1) return 1;
  return -1;
}

static int unknown_device(const char *op, const char *name) {
  char list[256] = "";
  size_t used = 0;
  int n = devices_ready(), all = n + n_remote;
  for (int i = 0; i < all && used < sizeof list; i++)
    used += (size_t)snprintf(list + used, sizeof list - used, i ? ", %s" : "%s", device_names[i]);
  if (name && strncmp(name, "task:", 5) == 0)
    return kiln_set_error("%s: unknown device '%s' (devices: %s): %s", op, name, list, remote_why());
  const char *why = n == 1 && gpu_backend ? gpu_backend->status() : "";
  return kiln_set_error("%s: unknown device '%s' (devices: %s%s%s)", op, name ? name : "(null)", list,
                        *why ? "; no GPU: " : "", why);
}

int device_current(void) { return device_now; }

const char *kiln_device_current(void) { return device_names[device_now]; }

int kiln_device_push(const char *name) {
  int d = device_find(name);
  if (d < 0) return unknown_device("device_push", name);
  if (device_depth == DEVICE_STACK)
    return kiln_set_error("device_push: device scopes nest deeper than %d", DEVICE_STACK);
  device_stack[device_depth++] = d;
  device_now = d;
  return 0;
}

void kiln_device_pop(void) {
  if (device_depth > 0) device_depth--;
  device_now = device_depth ? device_stack[device_depth - 1] : 0;
}

/* ---- device memory and copies: only GPU tensors get here ---- */

void *device_alloc(const char *op, int device, size_t bytes, int32_t *cls) {
  return gpu_backend->alloc(op, device - 1, bytes, cls);
}

void device_free(int device, void *p, int32_t cls) {
  if (device_is_remote(device))
    remote_free(device, p);
  else
    gpu_backend->free(device - 1, p, cls);
}

kiln_tensor *tensor_to_device(const char *op, const kiln_tensor *t, int device) {
  if (device_is_remote(device) || device_is_remote(t->device)) return remote_copy(op, t, device);
  kiln_tensor *c = tensor_alloc_device(op, (kiln_dtype)t->dtype, t->rank, t->shape, device);
  size_t bytes = c ? tensor_bytes(c) : 0;
  if (!c || !bytes) return c;
  if (t->device == 0 && device == 0) {
    memcpy(c->data, t->data, bytes);
  } else if (gpu_backend->copy(op, device - 1, c->data, t->device - 1, t->data, bytes)) {
    kiln_release(c);
    return NULL;
  }
  return c;
}

const kiln_tensor *tensor_on_host(const char *op, const kiln_tensor *t, kiln_tensor **copy) {
  *copy = NULL;
  if (t->flags & TF_SYMBOLIC) {
    kiln_set_error("%s: the tensor is symbolic (being traced) and has no value; call this outside the "
                   "staged function", op);
    return NULL;
  }
  if (t->device == 0) return t;
  return *copy = tensor_to_device(op, t, 0);
}

int device_read(const char *op, const kiln_tensor *t, void *dst, size_t bytes) {
  if (!bytes) return 0;
  if (t->device == 0) {
    memcpy(dst, t->data, bytes);
    return 0;
  }
  if (device_is_remote(t->device)) return remote_read(op, t, dst, bytes);
  return gpu_backend->copy(op, -1, dst, t->device - 1, t->data, bytes);
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
  /* already there (tensors are immutable, so share it), or symbolic */
  if (d == t->device || (t->flags & TF_SYMBOLIC)) return scope_own(kiln_retain(t));
  return scope_own(tensor_to_device("to_device", t, d));
}
