/* libnbd's ceiling without FUSE: random preads of BS bytes at queue depth QD through libnbd's
 * aio API on one handle, for SECONDS; prints IOPS and MiB/s. Used for docs/nbd.md's comparison.
 * Build: gcc -O2 -o libnbd_qd libnbd_qd.c -lnbd
 * Run:   ./libnbd_qd URI BS QD SECONDS [seq]                                                   */
#include <libnbd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s URI BS QD SECONDS [seq]\n", argv[0]);
    return 2;
  }
  size_t bs = strtoul(argv[2], NULL, 0);
  int qd = atoi(argv[3]);
  double secs = atof(argv[4]);
  int seq = argc > 5 && strcmp(argv[5], "seq") == 0;
  struct nbd_handle *h = nbd_create();
  if (!h || nbd_connect_uri(h, argv[1]) == -1) {
    fprintf(stderr, "%s\n", nbd_get_error());
    return 1;
  }
  int64_t size = nbd_get_size(h);
  uint64_t blocks = size / bs, next = 0, done = 0, rng = 88172645463325252ull;
  char *buf = aligned_alloc(4096, bs * qd);
  double t0 = now(), end = t0 + secs;
  while (now() < end) {
    while (nbd_aio_in_flight(h) < qd) {
      uint64_t b;
      if (seq) {
        b = next++ % blocks;
      } else {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        b = rng % blocks;
      }
      if (nbd_aio_pread(h, buf + (done % qd) * bs, bs, b * bs, NBD_NULL_COMPLETION, 0) == -1) {
        fprintf(stderr, "%s\n", nbd_get_error());
        return 1;
      }
    }
    if (nbd_poll(h, -1) == -1) {
      fprintf(stderr, "%s\n", nbd_get_error());
      return 1;
    }
    int64_t c;
    while ((c = nbd_aio_peek_command_completed(h)) > 0) {
      if (nbd_aio_command_completed(h, c) == -1) {
        fprintf(stderr, "%s\n", nbd_get_error());
        return 1;
      }
      done++;
    }
  }
  double el = now() - t0;
  printf("bs=%zu qd=%d %s: %.0f IOPS, %.1f MiB/s\n", bs, qd, seq ? "seq" : "rand", done / el,
         done * bs / el / 1048576.0);
  nbd_shutdown(h, 0);
  nbd_close(h);
  return 0;
}
