/* A server-shaped process for `scripts/bench --ps`: THREADS threads (64 KiB stacks) parked in
 * pause(); the first birth publishes the library's table. Prints "READY" once all exist, then
 * waits for stdin to close. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void *park(void *arg) {
    for (;;) pause();
    return arg;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 512;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    for (int i = 1; i < threads; i++) {
        pthread_t t;
        if (pthread_create(&t, &attr, park, NULL) != 0) {
            fprintf(stderr, "thread %d: cannot create\n", i);
            return 1;
        }
    }
    printf("READY\n");
    fflush(stdout);
    char line[16];
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
