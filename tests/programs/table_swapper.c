/* A hostile local user's loop over a name in a shared directory (tests/shared_host.rs): for
 * SECONDS, the name at TABLE is in turn the user's real table (kept at KEEP between turns), a
 * FIFO (kept at FIFO), symbolic links to a device node (DEVICE), to a FIFO the test holds
 * (HELD), to a root-owned table (FORGED) and to a directory (/), a hard link to the real table,
 * and a huge sparse file (kept at SPARSE). Each turn is a rename over the name: atomic, as an
 * attacker would do it. FIFO and SPARSE are made by the test (so that it watches them from the
 * start), as this user's. Prints "SWAPPED <turns>" and puts the real table back at the end.
 *
 * Usage: table_swapper TABLE KEEP FIFO SPARSE DEVICE HELD FORGED SECONDS */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static char tmp[4096];

/* A short while with TABLE as it is now. */
static void hold(void) {
    for (int i = 0; i < 20; i++) sched_yield();
}

static void plant_link(const char *target, const char *table) {
    unlink(tmp);
    if (symlink(target, tmp) == 0 && rename(tmp, table) == 0) hold();
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: table_swapper TABLE KEEP FIFO SPARSE DEVICE HELD FORGED SECONDS\n");
        return 2;
    }
    const char *table = argv[1], *keep = argv[2], *fifo = argv[3], *sparse = argv[4];
    const char *device = argv[5], *held = argv[6], *forged = argv[7];
    double seconds = atof(argv[8]);
    snprintf(tmp, sizeof tmp, "%s.tmp", table);
    if (rename(table, keep) != 0) {
        perror("rename the real table away");
        return 1;
    }
    long turns = 0;
    double end = now() + seconds;
    while (now() < end) {
        /* The real table, then each hostile thing in its place. */
        if (rename(keep, table) == 0) {
            hold();
            rename(table, keep);
        }
        if (rename(fifo, table) == 0) {
            hold();
            rename(table, fifo);
        }
        if (rename(sparse, table) == 0) {
            hold();
            rename(table, sparse);
        }
        plant_link(device, table);
        plant_link(held, table);
        plant_link(forged, table);
        plant_link("/", table);
        unlink(tmp);
        if (link(keep, tmp) == 0 && rename(tmp, table) == 0) hold();
        unlink(table);
        turns++;
    }
    unlink(tmp);
    if (rename(keep, table) != 0) {
        perror("put the real table back");
        return 1;
    }
    printf("SWAPPED %ld\n", turns);
    fflush(stdout);
    return 0;
}
