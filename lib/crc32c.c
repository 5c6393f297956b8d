/* crc32c.c — CRC-32C (Castagnoli), bit by bit: summaries checksum a few
 * kilobytes per record, so the eight-fold table is not worth its code. */
#include "crc32c.h"

uint32_t crc32c(const void *p, size_t n) {
  const uint8_t *q = p;
  uint32_t crc = 0xffffffffu;
  for (size_t i = 0; i < n; i++) {
    crc ^= q[i];
    for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1)));
  }
  return ~crc;
}

uint32_t crc32c_masked(const void *p, size_t n) {
  uint32_t crc = crc32c(p, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}
