/* The kernel's PMD-sized transparent huge page: 2 MiB on 4 KiB base pages, 32 MiB on 16 KiB,
 * 512 MiB on 64 KiB (/sys/kernel/mm/transparent_hugepage/hpage_pmd_size); 2 MiB where the kernel
 * does not say. Buffers aligned to it never share a huge page with a neighbour. */
#ifndef TLLM_HUGE_PAGE_H
#define TLLM_HUGE_PAGE_H

#include <stdint.h>
#include <stdio.h>

static uintptr_t pmd_huge_page_bytes(void) {
    unsigned long bytes = 0;
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r");
    if (f) {
        if (fscanf(f, "%lu", &bytes) != 1) bytes = 0;
        fclose(f);
    }
    return bytes ? (uintptr_t)bytes : (uintptr_t)2 << 20;
}

#endif
