/* A cpu_set_t as the kernel writes a cpulist ("0-3,8"), for the programs that print masks. */
#ifndef TLLM_CPULIST_H
#define TLLM_CPULIST_H

#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>

static void cpulist(const cpu_set_t *set, char *out, size_t len) {
    size_t used = 0;
    out[0] = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, set)) continue;
        int hi = c;
        while (hi + 1 < CPU_SETSIZE && CPU_ISSET(hi + 1, set)) hi++;
        int n = hi > c ? snprintf(out + used, len - used, "%s%d-%d", used ? "," : "", c, hi)
                       : snprintf(out + used, len - used, "%s%d", used ? "," : "", c);
        if (n < 0 || (size_t)n >= len - used) break;
        used += (size_t)n;
        c = hi;
    }
}

#endif
