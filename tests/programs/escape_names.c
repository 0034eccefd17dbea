/* A process whose names are terminal escapes (tests/shared_host.rs): its comm (PR_SET_NAME) is
 * ESC ] 0 ; pwned BEL ESC [ 2 J (retitle the terminal, then clear it), and a thread it makes is
 * named with a C1 CSI (UTF-8 C2 9B), DEL and a byte that is no UTF-8 (FF), another with bidi
 * controls that reorder what a terminal or an editor shows (U+202E, U+2066, U+200F, U+061C). With
 * the library preloaded the thread's birth publishes the table, so the host view lists it. Prints
 * "WAIT <pid>", then waits for a line on stdin. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>

static void *idle(void *arg) {
    pause();
    return arg;
}

int main(void) {
    prctl(PR_SET_NAME, "\x1b]0;pwned\x07\x1b[2J", 0, 0, 0);
    pthread_t t, bidi;
    if (pthread_create(&t, NULL, idle, NULL) != 0) return 1;
    pthread_setname_np(t, "\xc2\x9b" "31m\x7f\xffx");
    if (pthread_create(&bidi, NULL, idle, NULL) != 0) return 1;
    pthread_setname_np(bidi, "\xe2\x80\xae" "ev" "\xe2\x81\xa6" "\xe2\x80\x8f" "\xd8\x9c");
    printf("WAIT %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 0;
    return 0;
}
