/*
 * fileaccess: read one file sequentially or randomly, time it, count reads.
 *
 * Reproduces the file-access test of seeds/004 (FUSE passthrough question,
 * Nov 2024): files of 1 MiB, 500 MiB and 1000 MiB read with 4 KiB, 128 KiB
 * and 256 KiB buffers.
 *
 *   fileaccess PATH seq|rand BUFSIZE [MAX_SECONDS]
 *
 * seq:  read(2) from offset 0 until EOF.
 * rand: every BUFSIZE block once, in a shuffled order (fixed seed), pread(2).
 * MAX_SECONDS (default 0 = none) stops a pass early; "complete" is then false.
 *
 * Prints one JSON line: {"path":..., "mode":..., "bufsize":N, "size":N,
 * "bytes":N, "calls":N, "ns":N, "complete":true|false}. Exit 1 on error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t xorshift64(uint64_t *s)
{
	uint64_t x = *s;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

static void json_string(const char *s)
{
	putchar('"');
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			putchar('\\');
		putchar(*s);
	}
	putchar('"');
}

int main(int argc, char **argv)
{
	if (argc < 4 || (strcmp(argv[2], "seq") && strcmp(argv[2], "rand"))) {
		fprintf(stderr, "usage: %s PATH seq|rand BUFSIZE [MAX_SECONDS]\n", argv[0]);
		return 2;
	}
	const char *path = argv[1];
	int random_order = !strcmp(argv[2], "rand");
	size_t bufsize = strtoull(argv[3], NULL, 0);
	double max_seconds = argc > 4 ? strtod(argv[4], NULL) : 0;
	uint64_t deadline_ns = max_seconds > 0 ? (uint64_t)(max_seconds * 1e9) : 0;
	if (bufsize == 0) {
		fprintf(stderr, "fileaccess: bad BUFSIZE\n");
		return 2;
	}

	int fd = open(path, O_RDONLY);
	if (fd < 0) {
		fprintf(stderr, "fileaccess: open %s: %s\n", path, strerror(errno));
		return 1;
	}
	struct stat st;
	if (fstat(fd, &st) < 0) {
		fprintf(stderr, "fileaccess: stat %s: %s\n", path, strerror(errno));
		return 1;
	}
	uint64_t size = (uint64_t)st.st_size;
	void *buf;
	if (posix_memalign(&buf, 4096, bufsize)) {
		fprintf(stderr, "fileaccess: out of memory\n");
		return 1;
	}

	uint64_t nblocks = (size + bufsize - 1) / bufsize;
	uint64_t *order = NULL;
	if (random_order) {
		order = malloc(sizeof(*order) * (nblocks ? nblocks : 1));
		if (!order) {
			fprintf(stderr, "fileaccess: out of memory\n");
			return 1;
		}
		for (uint64_t i = 0; i < nblocks; i++)
			order[i] = i;
		uint64_t seed = 0x9e3779b97f4a7c15ull;
		for (uint64_t i = nblocks; i > 1; i--) {
			uint64_t j = xorshift64(&seed) % i;
			uint64_t t = order[i - 1];
			order[i - 1] = order[j];
			order[j] = t;
		}
	}

	uint64_t calls = 0, bytes = 0;
	int complete = 1;
	uint64_t start = now_ns(), end;
	if (!random_order) {
		for (;;) {
			ssize_t n = read(fd, buf, bufsize);
			if (n < 0) {
				if (errno == EINTR)
					continue;
				fprintf(stderr, "fileaccess: read: %s\n", strerror(errno));
				return 1;
			}
			if (n == 0)
				break;
			calls++;
			bytes += (uint64_t)n;
			if (deadline_ns && (calls & 63) == 0 && now_ns() - start > deadline_ns) {
				complete = bytes >= size;
				break;
			}
		}
	} else {
		for (uint64_t i = 0; i < nblocks; i++) {
			ssize_t n = pread(fd, buf, bufsize, (off_t)(order[i] * bufsize));
			if (n < 0) {
				if (errno == EINTR) {
					i--;
					continue;
				}
				fprintf(stderr, "fileaccess: pread: %s\n", strerror(errno));
				return 1;
			}
			calls++;
			bytes += (uint64_t)n;
			if (deadline_ns && (calls & 63) == 0 && now_ns() - start > deadline_ns) {
				complete = i + 1 >= nblocks;
				break;
			}
		}
	}
	end = now_ns();
	close(fd);

	printf("{\"path\":");
	json_string(path);
	printf(",\"mode\":\"%s\",\"bufsize\":%zu,\"size\":%llu,\"bytes\":%llu,\"calls\":%llu,"
	       "\"ns\":%llu,\"complete\":%s}\n",
	       random_order ? "rand" : "seq", bufsize, (unsigned long long)size,
	       (unsigned long long)bytes, (unsigned long long)calls,
	       (unsigned long long)(end - start), complete ? "true" : "false");
	free(order);
	free(buf);
	return 0;
}
