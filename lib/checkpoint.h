/* checkpoint.h — the reader behind kiln_checkpoint_restore, on any stdio
 * stream, so the fuzz target (tests/fuzz/checkpoint_fuzz.c) can feed it
 * bytes from memory through fmemopen. Internal. */
#ifndef KILN_CHECKPOINT_H
#define KILN_CHECKPOINT_H

#include <stdio.h>

#include "runtime.h"

/* kiln_checkpoint_restore from an open, seekable stream; label names it in
 * error messages ("checkpoint_restore: <label>: ..."). 0 / -1. */
int checkpoint_restore_stream(const char *label, FILE *f, int n, kiln_variable *const *vars);

#endif
