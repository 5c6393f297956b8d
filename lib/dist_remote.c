/* dist_remote.c — remote devices (API.md §12, the TF Eager paper's §4.5):
 * a process that serves its devices to rank 0, where they are task:K/cpu:0.
 * Not built yet: kiln_dist_serve exists so that programs written against
 * the contract link, and says so when called. */
#include "dist.h"

int kiln_dist_serve(void) {
  return kiln_set_error("dist_serve: remote devices are not built yet (this Kiln has API.md §12's collectives "
                        "and data-parallel training, not task:K devices)");
}
