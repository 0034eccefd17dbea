/* SPEC §9: memory does not grow with the plugins a process has ever had.
 *
 * argv[1] is a plugin (reload_plugin.c); argv[2] and argv[3] are cycle counts W < N. Each cycle
 * loads the plugin, starts a thread from it, joins it and unloads the plugin. Before each load a
 * page is reserved (and kept) where the plugin was: the next copy lands a page lower, as when
 * other mappings of a long-lived process come and go, so no two loads share an address. Prints
 * "HEAP after=<W> <bytes> after=<N> <bytes> moved=<cycles where the plugin's address changed>",
 * the heap in use (mallinfo2: arena and mmapped chunks) after W and after N cycles. */
#include "reload_common.h"

#include <malloc.h>
#include <sys/mman.h>

static size_t heap_in_use(void) {
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s <plugin> <warm-up cycles> <cycles>\n", argv[0]);
        return 2;
    }
    int warm = atoi(argv[2]), total = atoi(argv[3]);
    size_t at_warm = 0;
    void *last = NULL;
    int moved = 0;
    for (int i = 0; i < total; i++) {
        if (mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) ==
            MAP_FAILED)
            return 7;
        struct plugin p = plugin_load(argv[1]);
        if (last && p.routine != last) moved++;
        last = p.routine;
        if (p.start() < 0) return 4;
        p.stop();
        plugin_unload(&p);
        if (i + 1 == warm) at_warm = heap_in_use();
    }
    printf("HEAP after=%d %zu after=%d %zu moved=%d\n", warm, at_warm, total, heap_in_use(), moved);
    return 0;
}
