/*
 * metaops: time one metadata operation over a tree of small files.
 *
 *   metaops create|stat|readdir|unlink DIR NDIRS FILES_PER_DIR FILE_BYTES
 *
 * The tree is DIR/dNNNN/fNNNNNN (NDIRS directories of FILES_PER_DIR files).
 * create:  mkdir DIR and every dNNNN, create every file (O_CREAT|O_EXCL),
 *          write FILE_BYTES bytes into it, close it.
 * stat:    lstat every file (by path, in creation order).
 * readdir: open every directory of the tree and read all its entries
 *          (no stat: what `ls -f` does).
 * unlink:  unlink every file, rmdir every dNNNN, rmdir DIR.
 *
 * Prints one JSON line: {"op":..., "ops":N, "ns":N}, ops = files handled
 * (readdir: entries read, without . and ..). Exit 1 on the first error.
 */
#define _GNU_SOURCE
#include <dirent.h>
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

static int fail(const char *what, const char *path)
{
	fprintf(stderr, "metaops: %s %s: %s\n", what, path, strerror(errno));
	return 1;
}

int main(int argc, char **argv)
{
	if (argc != 6) {
		fprintf(stderr, "usage: metaops create|stat|readdir|unlink DIR NDIRS FILES_PER_DIR FILE_BYTES\n");
		return 2;
	}
	const char *op = argv[1], *dir = argv[2];
	long ndirs = atol(argv[3]), per = atol(argv[4]), bytes = atol(argv[5]);
	if (ndirs <= 0 || per <= 0 || bytes < 0 || bytes > 65536) {
		fprintf(stderr, "metaops: bad sizes\n");
		return 2;
	}
	char *buf = calloc(1, bytes > 0 ? (size_t)bytes : 1);
	char path[4096];
	uint64_t ops = 0;
	if (!buf)
		return 1;
	memset(buf, 'x', (size_t)bytes);
	uint64_t t0 = now_ns();
	if (strcmp(op, "create") == 0) {
		if (mkdir(dir, 0755) != 0)
			return fail("mkdir", dir);
		for (long d = 0; d < ndirs; d++) {
			snprintf(path, sizeof path, "%s/d%04ld", dir, d);
			if (mkdir(path, 0755) != 0)
				return fail("mkdir", path);
			for (long f = 0; f < per; f++) {
				snprintf(path, sizeof path, "%s/d%04ld/f%06ld", dir, d, f);
				int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
				if (fd < 0)
					return fail("create", path);
				if (bytes > 0 && write(fd, buf, (size_t)bytes) != bytes)
					return fail("write", path);
				if (close(fd) != 0)
					return fail("close", path);
				ops++;
			}
		}
	} else if (strcmp(op, "stat") == 0) {
		struct stat st;
		for (long d = 0; d < ndirs; d++)
			for (long f = 0; f < per; f++) {
				snprintf(path, sizeof path, "%s/d%04ld/f%06ld", dir, d, f);
				if (lstat(path, &st) != 0)
					return fail("lstat", path);
				ops++;
			}
	} else if (strcmp(op, "readdir") == 0) {
		for (long d = 0; d < ndirs; d++) {
			snprintf(path, sizeof path, "%s/d%04ld", dir, d);
			DIR *dp = opendir(path);
			if (!dp)
				return fail("opendir", path);
			struct dirent *de;
			errno = 0;
			while ((de = readdir(dp)) != NULL) {
				if (strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0)
					ops++;
				errno = 0;
			}
			if (errno != 0)
				return fail("readdir", path);
			closedir(dp);
		}
	} else if (strcmp(op, "unlink") == 0) {
		for (long d = 0; d < ndirs; d++) {
			for (long f = 0; f < per; f++) {
				snprintf(path, sizeof path, "%s/d%04ld/f%06ld", dir, d, f);
				if (unlink(path) != 0)
					return fail("unlink", path);
				ops++;
			}
			snprintf(path, sizeof path, "%s/d%04ld", dir, d);
			if (rmdir(path) != 0)
				return fail("rmdir", path);
		}
		if (rmdir(dir) != 0)
			return fail("rmdir", dir);
	} else {
		fprintf(stderr, "metaops: unknown op %s\n", op);
		return 2;
	}
	uint64_t ns = now_ns() - t0;
	printf("{\"op\":\"%s\",\"ops\":%llu,\"ns\":%llu}\n", op, (unsigned long long)ops, (unsigned long long)ns);
	free(buf);
	return 0;
}
