/*
 * preadv256: time 1 MiB O_DIRECT preadv calls of 256 x 4 KiB iovecs, one call at a time.
 *
 *   preadv256 FILE [CALLS [WARMUP [SEED]]]     (defaults: 2000 calls, 20 warm-up calls, seed 1)
 *
 * Opens FILE with O_RDONLY | O_DIRECT, gives every iovec its own 4 KiB-aligned 4 KiB buffer
 * (the shape of a guest's scattered pages in a VM image read), and issues WARMUP untimed and
 * then CALLS timed preadv(2) calls at pseudo-random 1 MiB-aligned offsets inside the file
 * (xorshift64, SEED). Each call is timed alone with CLOCK_MONOTONIC and must return 1 MiB.
 * Prints one JSON line on stdout:
 *   {"calls":N,"warmup":W,"bytes":B,"p50_us":..,"p90_us":..,"p99_us":..,"min_us":..,
 *    "max_us":..,"mean_us":..,"wall_s":..,"cpu_s":..}
 * bytes counts every call, warm-up included; wall_s is the sum of the timed calls; cpu_s is
 * this process's own user+system time over the whole run. Exit status 1 on any error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define NIOV 256
#define IOV_LEN 4096
#define CALL_BYTES (NIOV * IOV_LEN)

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t xorshift64(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static double pct(const double *sorted, long n, double p) {
    long i = (long)(p * (double)(n - 1) + 0.5);
    return sorted[i < 0 ? 0 : (i >= n ? n - 1 : i)];
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 5) {
        fprintf(stderr, "usage: %s FILE [CALLS [WARMUP [SEED]]]\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    long calls = argc > 2 ? atol(argv[2]) : 2000;
    long warmup = argc > 3 ? atol(argv[3]) : 20;
    uint64_t seed = argc > 4 ? strtoull(argv[4], NULL, 0) : 1;
    if (calls < 1 || warmup < 0) {
        fprintf(stderr, "preadv256: CALLS must be >= 1 and WARMUP >= 0\n");
        return 2;
    }
    if (seed == 0)
        seed = 1;

    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) {
        fprintf(stderr, "preadv256: open %s: %s\n", path, strerror(errno));
        return 1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        fprintf(stderr, "preadv256: fstat %s: %s\n", path, strerror(errno));
        return 1;
    }
    uint64_t slots = (uint64_t)st.st_size / CALL_BYTES;
    if (slots == 0) {
        fprintf(stderr, "preadv256: %s is smaller than 1 MiB\n", path);
        return 1;
    }

    struct iovec iov[NIOV];
    for (int i = 0; i < NIOV; i++) {
        void *p;
        if (posix_memalign(&p, IOV_LEN, IOV_LEN) != 0) {
            fprintf(stderr, "preadv256: out of memory\n");
            return 1;
        }
        memset(p, 0, IOV_LEN); /* fault the pages in before timing */
        iov[i].iov_base = p;
        iov[i].iov_len = IOV_LEN;
    }
    double *lat = malloc(sizeof(double) * (size_t)calls);
    if (lat == NULL) {
        fprintf(stderr, "preadv256: out of memory\n");
        return 1;
    }

    uint64_t rng = seed;
    double sum = 0;
    for (long i = -warmup; i < calls; i++) {
        off_t off = (off_t)(xorshift64(&rng) % slots) * CALL_BYTES;
        double t0 = now_us();
        ssize_t n = preadv(fd, iov, NIOV, off);
        double t1 = now_us();
        if (n != CALL_BYTES) {
            if (n < 0)
                fprintf(stderr, "preadv256: preadv at %lld: %s\n", (long long)off, strerror(errno));
            else
                fprintf(stderr, "preadv256: preadv at %lld returned %zd bytes, not %d\n",
                        (long long)off, n, CALL_BYTES);
            return 1;
        }
        if (i >= 0) {
            lat[i] = t1 - t0;
            sum += t1 - t0;
        }
    }
    close(fd);

    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
                 ru.ru_stime.tv_usec / 1e6;
    qsort(lat, (size_t)calls, sizeof(double), cmp_double);
    printf("{\"calls\":%ld,\"warmup\":%ld,\"bytes\":%lld,\"p50_us\":%.1f,\"p90_us\":%.1f,"
           "\"p99_us\":%.1f,\"min_us\":%.1f,\"max_us\":%.1f,\"mean_us\":%.1f,\"wall_s\":%.4f,"
           "\"cpu_s\":%.3f}\n",
           calls, warmup, (long long)(calls + warmup) * CALL_BYTES, pct(lat, calls, 0.5),
           pct(lat, calls, 0.9), pct(lat, calls, 0.99), lat[0], lat[calls - 1], sum / calls,
           sum / 1e6, cpu);
    return 0;
}
