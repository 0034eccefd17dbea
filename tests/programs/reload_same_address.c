/* SPEC §2, §9: a worker library unloaded and a host library then mapped at its address.
 *
 * argv[1] is the plugin under a TLLM_AFFINITY_WORKER_LIBS name, argv[2] the same plugin under
 * another name. W configures (a lease is open, the main thread stays host); the main thread loads
 * argv[1] and starts P1 from it (a worker: phase "worker_lib"), stops it and unloads the object,
 * loads argv[2] and starts P2 from it (phase "reloaded": P2 must be host, on the host mask). The
 * line "ADDRESS first=<p> second=<p> same=<0|1>" says whether the second object took the first
 * one's place. */
#include "reload_common.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <worker plugin> <host plugin>\n", argv[0]);
        return 2;
    }
    lc_init();
    note("main");
    (void)configured_agent("W", 0);

    struct plugin first = plugin_load(argv[1]);
    int p1 = first.start();
    if (p1 < 0) return 4;
    note_tid("P1", p1);
    phase("worker_lib");
    first.stop();
    void *old_routine = first.routine;
    plugin_unload(&first);

    struct plugin second = plugin_load(argv[2]);
    lc_say("ADDRESS first=%p second=%p same=%d", old_routine, second.routine,
           old_routine == second.routine);
    int p2 = second.start();
    if (p2 < 0) return 4;
    note_tid("P2", p2);
    phase("reloaded");
    second.stop();
    plugin_unload(&second);
    return 0;
}
