/* random.h — the general Philox-4x32-10 block function (full 128-bit
 * counter), exported only so the tests can check it against Random123's
 * known-answer vectors. Internal: the library itself uses philox4x32. */
#ifndef KILN_RANDOM_H
#define KILN_RANDOM_H

#include <stdint.h>

#include "compat.h"

KILN_EXPORT void kiln_debug_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

#endif
