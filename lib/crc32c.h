/* crc32c.h — CRC-32C (Castagnoli), the checksum of TFRecord framing
 * (summary.c). Internal. */
#ifndef KILN_CRC32C_H
#define KILN_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* The CRC-32C of n bytes at p ("123456789" gives 0xe3069283). */
uint32_t crc32c(const void *p, size_t n);
/* TFRecord's masked form: rotated right by 15 and offset, so that a CRC
 * stored inside checksummed data does not checksum to a constant. */
uint32_t crc32c_masked(const void *p, size_t n);

#endif
