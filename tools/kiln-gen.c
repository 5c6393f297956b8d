/* kiln-gen — prints the random program of a seed (tests/ir_gen.h) as .kir,
 * to replay or minimise a failure of the random-program tests by hand:
 *   kiln-gen SEED [--instrs=MIN,MAX] | kiln-opt --passes=simplify -
 * Exit codes: 0 ok, 1 generator error (on stderr), 2 usage. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ir_gen.h"

static int usage(const char *why) {
  if (why) fprintf(stderr, "kiln-gen: %s\n", why);
  fprintf(stderr, "usage: kiln-gen SEED [--instrs=MIN,MAX]\n");
  return 2;
}

int main(int argc, char **argv) {
  ir_gen_options opt = ir_gen_default_options();
  const char *seed_text = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strncmp(a, "--instrs=", 9)) {
      if (sscanf(a + 9, "%d,%d", &opt.min_instrs, &opt.max_instrs) != 2) return usage("--instrs wants MIN,MAX");
    } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(NULL);
      return 0;
    } else if (a[0] == '-') {
      fprintf(stderr, "kiln-gen: unknown option '%s'\n", a);
      return usage(NULL);
    } else if (seed_text) {
      return usage("more than one seed");
    } else {
      seed_text = a;
    }
  }
  if (!seed_text) return usage("no seed");
  char *end = NULL;
  errno = 0;
  unsigned long long seed = strtoull(seed_text, &end, 0);
  if (errno || !*seed_text || *end) return usage("the seed must be an unsigned integer");
  ir_module *m = ir_gen_program((uint64_t)seed, &opt);
  char *text = m ? ir_print_module(m) : NULL;
  if (!text) {
    fprintf(stderr, "kiln-gen: %s\n", kiln_last_error());
    ir_module_free(m);
    return 1;
  }
  fputs(text, stdout);
  free(text);
  ir_module_free(m);
  return 0;
}
