/* Prints what the NVML on this host answers, in the format tests/programs/nvml_double.c reads
 * (see there), so the test double can be checked against a real driver. scripts/device-check
 * carries it prebuilt. It dlopens libnvidia-ml.so.1 itself, independently of the library, and
 * uses only nvml.h's prototypes (declared here: no header is needed to build it).
 *
 * Exit status: 0 when NVML answered, 2 when it is not there or nvmlInit_v2 failed (an "init"
 * line then carries the code), 1 on a later error (a "#" line says which).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t is 68 bytes in nvml.h");

#define WORDS 64 /* 4096 CPUs */
#define WORD_BITS (8 * sizeof(unsigned long))

static void print_cpus(const unsigned long *set) {
    int first = 1;
    for (unsigned c = 0; c < WORDS * WORD_BITS; c++) {
        if (!(set[c / WORD_BITS] >> (c % WORD_BITS) & 1)) continue;
        unsigned hi = c;
        while (hi + 1 < WORDS * WORD_BITS && (set[(hi + 1) / WORD_BITS] >> ((hi + 1) % WORD_BITS) & 1)) hi++;
        if (hi > c) printf("%s%u-%u", first ? "" : ",", c, hi);
        else printf("%s%u", first ? "" : ",", c);
        first = 0;
        c = hi;
    }
    if (first) printf("-");
}

int main(void) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        printf("# no NVML: %s\n", dlerror());
        return 2;
    }
#define SYM(name, ...) nvmlReturn_t (*name)(__VA_ARGS__) = (nvmlReturn_t(*)(__VA_ARGS__))dlsym(lib, #name)
    SYM(nvmlInit_v2, void);
    SYM(nvmlShutdown, void);
    SYM(nvmlDeviceGetCount_v2, unsigned *);
    SYM(nvmlDeviceGetHandleByIndex_v2, unsigned, nvmlDevice_t *);
    SYM(nvmlDeviceGetPciInfo_v3, nvmlDevice_t, nvmlPciInfo_t *);
    SYM(nvmlDeviceGetUUID, nvmlDevice_t, char *, unsigned);
    SYM(nvmlDeviceGetCpuAffinityWithinScope, nvmlDevice_t, unsigned, unsigned long *, unsigned);
    SYM(nvmlDeviceGetMaxMigDeviceCount, nvmlDevice_t, unsigned *);
    SYM(nvmlDeviceGetMigDeviceHandleByIndex, nvmlDevice_t, unsigned, nvmlDevice_t *);
    SYM(nvmlDeviceGetNumaNodeId, nvmlDevice_t, unsigned *);
    if (!nvmlInit_v2 || !nvmlShutdown || !nvmlDeviceGetCount_v2 || !nvmlDeviceGetHandleByIndex_v2 ||
        !nvmlDeviceGetPciInfo_v3 || !nvmlDeviceGetUUID) {
        printf("# no NVML: a required entry point is missing\n");
        return 2;
    }
    nvmlReturn_t rc = nvmlInit_v2();
    if (rc != 0) {
        printf("init %d\n", rc);
        return 2;
    }
    unsigned count = 0;
    if ((rc = nvmlDeviceGetCount_v2(&count)) != 0) {
        printf("# nvmlDeviceGetCount_v2 returned %d\n", rc);
        nvmlShutdown();
        return 1;
    }
    for (unsigned i = 0; i < count; i++) {
        nvmlDevice_t d = NULL;
        nvmlPciInfo_t pci;
        char uuid[96] = "";
        unsigned long set[WORDS];
        memset(&pci, 0, sizeof pci);
        memset(set, 0, sizeof set);
        if ((rc = nvmlDeviceGetHandleByIndex_v2(i, &d)) != 0 || !d ||
            (rc = nvmlDeviceGetPciInfo_v3(d, &pci)) != 0 || (rc = nvmlDeviceGetUUID(d, uuid, sizeof uuid)) != 0) {
            printf("# device %u: error %d\n", i, rc);
            nvmlShutdown();
            return 1;
        }
        printf("gpu %s %s ", pci.busId, uuid);
        if (nvmlDeviceGetCpuAffinityWithinScope && nvmlDeviceGetCpuAffinityWithinScope(d, WORDS, set, 0) == 0)
            print_cpus(set);
        else
            printf("-");
        unsigned node = 0;
        if (nvmlDeviceGetNumaNodeId && nvmlDeviceGetNumaNodeId(d, &node) == 0) printf(" %u", node);
        printf("\n");
        unsigned max = 0;
        if (nvmlDeviceGetMaxMigDeviceCount && nvmlDeviceGetMigDeviceHandleByIndex &&
            nvmlDeviceGetMaxMigDeviceCount(d, &max) == 0) {
            for (unsigned m = 0; m < max; m++) {
                nvmlDevice_t mig = NULL;
                char mu[96] = "";
                if (nvmlDeviceGetMigDeviceHandleByIndex(d, m, &mig) == 0 && mig &&
                    nvmlDeviceGetUUID(mig, mu, sizeof mu) == 0)
                    printf("mig %u %s\n", i, mu);
            }
        }
    }
    nvmlShutdown();
    return 0;
}
