/* kir_fuzz.c — libFuzzer target for the .kir parser (scripts/fuzz.sh kir).
 * Any input must parse or fail cleanly; what parses must verify, print, and
 * parse back to the same text (the round trip), without leaks. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ir.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (!text) return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  ir_module *m = ir_parse(text, "fuzz.kir");
  free(text);
  if (!m) {
    if (strncmp(kiln_last_error(), "fuzz.kir:", 9)) abort(); /* every parse error has a location */
    return 0;
  }
  if (ir_verify_module(m)) abort();
  char *a = ir_print_module(m);
  ir_module *m2 = a ? ir_parse(a, "printed.kir") : NULL;
  char *b = m2 ? ir_print_module(m2) : NULL;
  if (!a || !b || strcmp(a, b)) {
    fprintf(stderr, "round trip failed: %s\n--- printed\n%s\n", kiln_last_error(), a ? a : "(null)");
    abort();
  }
  free(a);
  free(b);
  ir_module_free(m);
  ir_module_free(m2);
  return 0;
}
