/* saved_fuzz.c — libFuzzer target for kiln_function_load (scripts/fuzz.sh
 * saved). An input is a saved function's directory packed as its four files
 * (manifest.json, trace0.kir, variables.safetensors, constants.safetensors)
 * separated by the marker "\n#KILNFILE#\n" (scripts/fuzz.sh packs the seeds
 * from tests/fuzz/saved/). Any input must load or fail cleanly with an error
 * naming function_load, without leaks; what loads must save and load again.
 * Nothing loaded is called: a fuzzed IR may name any symbol as a host call. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <kiln.h>

static const char *const files[] = {"manifest.json", "trace0.kir", "variables.safetensors",
                                    "constants.safetensors"};
#define N_FILES 4
#define MARKER "\n#KILNFILE#\n"

static char dir[256], again[300];

static void write_file(const char *name, const uint8_t *p, size_t n) {
  char path[400];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) abort();
  if (n && fwrite(p, 1, n, f) != n) abort();
  fclose(f);
}

static void remove_tree(const char *d) { /* a directory of files */
  DIR *h = opendir(d);
  struct dirent *e;
  while (h && (e = readdir(h))) {
    char path[700];
    snprintf(path, sizeof path, "%s/%s", d, e->d_name);
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) unlink(path);
  }
  if (h) closedir(h);
  rmdir(d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!dir[0]) {
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(dir, sizeof dir, "%s/kiln_saved_fuzz_%ld", base, (long)getpid());
    snprintf(again, sizeof again, "%s.again", dir);
  }
  mkdir(dir, 0700);
  /* split at the markers; missing parts are missing files */
  const uint8_t *p = data, *end = data + size;
  size_t ml = strlen(MARKER);
  for (int i = 0; i < N_FILES; i++) {
    char path[400];
    snprintf(path, sizeof path, "%s/%s", dir, files[i]);
    unlink(path);
    if (!p) continue;
    const uint8_t *q = p;
    while (q + ml <= end && memcmp(q, MARKER, ml)) q++;
    if (q + ml > end) q = end;
    write_file(files[i], p, (size_t)(q - p));
    p = q == end ? NULL : q + ml;
  }
  kiln_function *f = kiln_function_load(dir);
  if (!f) {
    if (strncmp(kiln_last_error(), "function_load: ", 15)) {
      fprintf(stderr, "error without the load's name: %s\n", kiln_last_error());
      abort();
    }
  } else {
    if (kiln_function_variables(f, 0, NULL) < 0) abort();
    if (kiln_function_save(f, again)) {
      fprintf(stderr, "a loaded function does not save: %s\n", kiln_last_error());
      abort();
    }
    kiln_function *g = kiln_function_load(again);
    if (!g) {
      fprintf(stderr, "a saved loaded function does not load: %s\n", kiln_last_error());
      abort();
    }
    kiln_function_free(g);
    kiln_function_free(f);
    remove_tree(again);
  }
  kiln_clear_error();
  remove_tree(dir);
  return 0;
}
