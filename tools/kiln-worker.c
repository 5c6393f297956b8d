/* kiln-worker — serves this process's devices to rank 0 (API.md §12, remote
 * devices): started beside a program by an MPI launcher, e.g.
 *   mpirun -np 1 ./train : -np 2 kiln-worker
 * where ./train (rank 0) runs ops under kiln_device_push("task:1/cpu:0").
 * It returns when rank 0 calls kiln_dist_finalize. Exit codes: 0 ok, 1 an
 * error (on stderr), 2 usage. */
#include <stdio.h>
#include <string.h>

#include "kiln.h"

int main(int argc, char **argv) {
  if (argc > 1) {
    bool help = !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help");
    fprintf(help ? stdout : stderr,
            "usage: mpirun -np 1 PROGRAM : -np N kiln-worker\n"
            "serves this rank's devices (task:K/cpu:0, task:K/gpu:G) to rank 0 until it finalizes\n");
    return help ? 0 : 2;
  }
  if (kiln_dist_init()) {
    fprintf(stderr, "kiln-worker: %s\n", kiln_last_error());
    return 1;
  }
  int rc = kiln_dist_serve();
  if (rc) fprintf(stderr, "kiln-worker: rank %d: %s\n", kiln_dist_rank(), kiln_last_error());
  kiln_dist_finalize();
  return rc ? 1 : 0;
}
