/* fake_cuda.h — what tests read of the fake driver's launches (fake_cuda.c),
 * through dlsym on the handle Kiln opened. */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fake_launch {
  char name[64];            /* the kernel's .entry */
  int dev;                  /* the device of the context it was launched in */
  unsigned grid[3], block[3];
  unsigned shared_bytes;
  int n_params;             /* from the .entry's parameter list in the PTX */
  int bad_params;           /* pointer parameters that are neither 0 nor memory of dev */
  unsigned long long ptr[16]; /* the first 16 (pointer) parameters' values */
} fake_launch;

/* Launches recorded since the last clear, in call order. */
int fake_cuda_launch_count(void);
/* The i-th launch; 0, or -1 when i is out of range. */
int fake_cuda_launch_get(int i, fake_launch *out);
void fake_cuda_launch_clear(void);
/* Launches of kernel `name` (NULL: any) fail with code (0: stop failing). */
void fake_cuda_fail_launch(const char *name, int code);
/* Launches of kernel `name` (NULL: stop) write the int value into the
 * memory their last parameter points at, in stream order: a kernel raising
 * Kiln's error word. */
void fake_cuda_launch_write(const char *name, int value);
/* A value of a script that writes nothing at that launch. */
#define FAKE_CUDA_SKIP (-2147483647 - 1)
/* Launches of kernel `name` from now on write, in stream order (as the
 * kernel's own store), values[i] at their i-th launch (values[n - 1] at
 * every launch after the n-th) into the memory their pointer parameter
 * `param` points at (-1: the last, Kiln's error word), `width` bytes of it
 * (1: a bool, 4: an int); FAKE_CUDA_SKIP writes nothing. n = 0 ends that
 * kernel's script, name NULL every script. Up to 8 kernels have scripts at
 * once. The values a kernel computes are thus scripted: a while loop's
 * predicate kernel writing 1, 1, 1, 0 runs its body three times. */
void fake_cuda_launch_script(const char *name, int param, int width, const int *values, int n);
/* The PTX text of the last module loaded, into buf (n bytes, NUL-ended,
 * cut short when it does not fit); returns its full length (0: none yet). */
size_t fake_cuda_last_ptx(char *buf, size_t n);
/* Modules loaded and not unloaded. */
int fake_cuda_modules_live(void);

#ifdef __cplusplus
}
#endif
#endif
