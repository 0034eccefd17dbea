/* A test double of the NVIDIA driver's NVML ABI (libnvidia-ml.so.1), for hosts without a GPU.
 *
 * It exports the entry points libtllm_affinity.so uses, with the prototypes, struct layouts and
 * return codes of the real nvml.h (NVML 12.x; the sizes are asserted below), and answers from the
 * file named by TLLM_NVML_DOUBLE, one statement a line:
 *
 *   gpu <busId> <uuid> <cpulist>|- [<node>|-]
 *                                    a GPU, in NVML's index order (busId as NVML writes it:
 *                                    00000000:3B:00.0); "-": the affinity calls say NOT_SUPPORTED.
 *                                    <node>: what nvmlDeviceGetNumaNodeId answers (the NUMA node
 *                                    holding the GPU's memory); absent or "-": NOT_SUPPORTED, as
 *                                    on a GPU whose memory is no NUMA node
 *   mig <gpu index> <mig uuid>       a MIG instance of that GPU
 *   init <code>                      what nvmlInit_v2 returns (default 0, NVML_SUCCESS)
 *   fail <function> <code>           what that entry point returns instead of answering
 *   null_handle <index>              nvmlDeviceGetHandleByIndex_v2 succeeds with a NULL handle
 *                                    for that index (one line per index)
 *
 * scripts/device-check writes the same format from the real driver, so the double can be checked
 * against it. Each nvmlInit_v2 appends "init" to $TLLM_NVML_DOUBLE.calls, so a test can see when
 * (and how often) NVML was loaded. Built with -DOMIT_PCI_INFO_V3 it lacks nvmlDeviceGetPciInfo_v3,
 * as an old driver lacks a newer entry point; with -DOMIT_NUMA_NODE_ID it lacks
 * nvmlDeviceGetNumaNodeId, as drivers before NVML 12 do.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* From nvml.h. */
typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_UNKNOWN 999
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96
#define NVML_AFFINITY_SCOPE_NODE 0
#define NVML_AFFINITY_SCOPE_SOCKET 1
typedef unsigned int nvmlAffinityScope_t;
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct nvmlPciInfo_st {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t is 68 bytes in nvml.h");
_Static_assert(sizeof(nvmlDevice_t) == sizeof(void *), "nvmlDevice_t is a pointer");
_Static_assert(sizeof(nvmlReturn_t) == 4, "nvmlReturn_t is a C enum");

#define MAX_GPUS 16
#define MAX_MIGS 7
#define MAX_CPUS 4096
#define WORD_BITS (8 * sizeof(unsigned long))

/* The double's handles point at these. */
struct nvmlDevice_st {
    int is_mig;
    int index;          /* GPU index, or MIG slot */
    int parent;         /* the GPU of a MIG instance */
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    int has_cpus;
    int has_numa_node;
    unsigned int numa_node;
    unsigned long cpus[MAX_CPUS / (8 * sizeof(unsigned long))];
    int n_migs;
    struct nvmlDevice_st *migs[MAX_MIGS];
};

static struct nvmlDevice_st gpus[MAX_GPUS];
static struct nvmlDevice_st migs[MAX_GPUS * MAX_MIGS];
static int n_gpus, n_migs_total;
static int init_code, initialised;
static int null_handles[MAX_GPUS];
static struct { char name[64]; int code; } fails[16];
static int n_fails;

static int failure(const char *fn) {
    for (int i = 0; i < n_fails; i++)
        if (strcmp(fails[i].name, fn) == 0) return fails[i].code;
    return NVML_SUCCESS;
}

static void set_cpus(struct nvmlDevice_st *d, const char *list) {
    if (strcmp(list, "-") == 0) return;
    d->has_cpus = 1;
    for (const char *p = list; *p;) {
        char *end;
        long lo = strtol(p, &end, 10), hi = lo;
        if (*end == '-') hi = strtol(end + 1, &end, 10);
        for (long c = lo; c <= hi && c < MAX_CPUS; c++) d->cpus[c / WORD_BITS] |= 1UL << (c % WORD_BITS);
        p = *end == ',' ? end + 1 : end;
        if (end == p && *p) break;
    }
}

static void load(void) {
    n_gpus = n_migs_total = n_fails = 0;
    init_code = 0;
    memset(null_handles, 0, sizeof null_handles);
    memset(gpus, 0, sizeof gpus);
    memset(migs, 0, sizeof migs);
    const char *path = getenv("TLLM_NVML_DOUBLE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return;
    char line[512], a[128], b[128], c[128], d[128];
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "%127s", a) != 1 || a[0] == '#') continue;
        int fields;
        if (strcmp(a, "gpu") == 0 && n_gpus < MAX_GPUS &&
            (fields = sscanf(line, "gpu %127s %127s %127s %127s", a, b, c, d)) >= 3) {
            struct nvmlDevice_st *g = &gpus[n_gpus];
            g->index = n_gpus++;
            snprintf(g->bus_id, sizeof g->bus_id, "%.31s", a);
            snprintf(g->uuid, sizeof g->uuid, "%.95s", b);
            set_cpus(g, c);
            char *end;
            unsigned long node = fields == 4 && strcmp(d, "-") != 0 ? strtoul(d, &end, 10) : 0;
            if (fields == 4 && strcmp(d, "-") != 0 && *end == '\0') {
                g->has_numa_node = 1;
                g->numa_node = (unsigned int)node;
            }
        } else if (strcmp(a, "mig") == 0) {
            int parent;
            if (sscanf(line, "mig %d %127s", &parent, b) == 2 && parent >= 0 && parent < n_gpus &&
                gpus[parent].n_migs < MAX_MIGS) {
                struct nvmlDevice_st *m = &migs[n_migs_total++];
                m->is_mig = 1;
                m->parent = parent;
                m->index = gpus[parent].n_migs;
                snprintf(m->uuid, sizeof m->uuid, "%.95s", b);
                gpus[parent].migs[gpus[parent].n_migs++] = m;
            }
        } else if (strcmp(a, "init") == 0) {
            sscanf(line, "init %d", &init_code);
        } else if (strcmp(a, "fail") == 0 && n_fails < 16) {
            if (sscanf(line, "fail %63s %d", fails[n_fails].name, &fails[n_fails].code) == 2) n_fails++;
        } else if (strcmp(a, "null_handle") == 0) {
            int index;
            if (sscanf(line, "null_handle %d", &index) == 1 && index >= 0 && index < MAX_GPUS)
                null_handles[index] = 1;
        }
    }
    fclose(f);
}

static int valid(nvmlDevice_t d) {
    if (!d) return 0;
    for (int i = 0; i < n_gpus; i++) if (d == &gpus[i]) return 1;
    for (int i = 0; i < n_migs_total; i++) if (d == &migs[i]) return 1;
    return 0;
}

#define GUARD(fn)                                                       \
    do {                                                                \
        if (!initialised) return NVML_ERROR_UNINITIALIZED;              \
        int code_ = failure(fn);                                        \
        if (code_ != NVML_SUCCESS) return code_;                        \
    } while (0)

/* Real NVML is thread-safe and counts its initialisations: the first loads the driver's state,
 * later ones only count, so a thread's handles stay valid while another thread initialises. The
 * double does the same (reading its file on the first nvmlInit_v2 only), under a spin lock: a
 * server's worker, step and result threads ask NVML at once. */
static char state_lock;

static void lock_state(void) {
    while (__atomic_test_and_set(&state_lock, __ATOMIC_ACQUIRE)) {
    }
}

static void unlock_state(void) { __atomic_clear(&state_lock, __ATOMIC_RELEASE); }

nvmlReturn_t nvmlInit_v2(void) {
    lock_state();
    if (!initialised) load();
    const char *path = getenv("TLLM_NVML_DOUBLE");
    if (path) {
        char calls[4096];
        snprintf(calls, sizeof calls, "%s.calls", path);
        FILE *f = fopen(calls, "a");
        if (f) { fputs("init\n", f); fclose(f); }
    }
    nvmlReturn_t rc = init_code;
    if (rc == NVML_SUCCESS) initialised++;
    unlock_state();
    return rc;
}

nvmlReturn_t nvmlShutdown(void) {
    lock_state();
    nvmlReturn_t rc = initialised ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (initialised) initialised--;
    unlock_state();
    return rc;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case 9: return "Driver Not Loaded";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    GUARD("nvmlDeviceGetCount_v2");
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = (unsigned int)n_gpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    GUARD("nvmlDeviceGetHandleByIndex_v2");
    if (!device || index >= (unsigned int)n_gpus) return NVML_ERROR_INVALID_ARGUMENT;
    *device = null_handles[index] ? NULL : &gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    GUARD("nvmlDeviceGetHandleByUUID");
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n_gpus; i++)
        if (strcmp(gpus[i].uuid, uuid) == 0) { *device = &gpus[i]; return NVML_SUCCESS; }
    for (int i = 0; i < n_migs_total; i++)
        if (strcmp(migs[i].uuid, uuid) == 0) { *device = &migs[i]; return NVML_SUCCESS; }
    return NVML_ERROR_NOT_FOUND;
}

#ifndef OMIT_PCI_INFO_V3
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    GUARD("nvmlDeviceGetPciInfo_v3");
    if (!valid(device) || !pci || device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    unsigned int domain = 0, bus = 0, dev = 0;
    sscanf(device->bus_id, "%x:%x:%x", &domain, &bus, &dev);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = 0x233010de;
    snprintf(pci->busId, sizeof pci->busId, "%s", device->bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", device->bus_id + 4);
    return NVML_SUCCESS;
}
#endif

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    GUARD("nvmlDeviceGetUUID");
    if (!valid(device) || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(device->uuid) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(uuid, device->uuid);
    return NVML_SUCCESS;
}

static nvmlReturn_t affinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet) {
    if (!valid(device) || !cpuSet || cpuSetSize == 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->has_cpus) return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned int w = 0; w < cpuSetSize; w++)
        cpuSet[w] = w < MAX_CPUS / WORD_BITS ? device->cpus[w] : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                 unsigned long *cpuSet, nvmlAffinityScope_t scope) {
    GUARD("nvmlDeviceGetCpuAffinityWithinScope");
    if (scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET)
        return NVML_ERROR_INVALID_ARGUMENT;
    return affinity(device, cpuSetSize, cpuSet);
}

nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet) {
    GUARD("nvmlDeviceGetCpuAffinity");
    return affinity(device, cpuSetSize, cpuSet);
}

#ifndef OMIT_NUMA_NODE_ID
nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    GUARD("nvmlDeviceGetNumaNodeId");
    if (!valid(device) || !node || device->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->has_numa_node) return NVML_ERROR_NOT_SUPPORTED;
    *node = device->numa_node;
    return NVML_SUCCESS;
}
#endif

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    GUARD("nvmlDeviceIsMigDeviceHandle");
    if (!valid(device) || !isMigDevice) return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = (unsigned int)device->is_mig;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    GUARD("nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
    if (!valid(migDevice) || !migDevice->is_mig || !device) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[migDevice->parent];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    GUARD("nvmlDeviceGetMaxMigDeviceCount");
    if (!valid(device) || device->is_mig || !count) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->n_migs == 0) return NVML_ERROR_NOT_SUPPORTED;
    *count = MAX_MIGS;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice) {
    GUARD("nvmlDeviceGetMigDeviceHandleByIndex");
    if (!valid(device) || device->is_mig || !migDevice) return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= (unsigned int)device->n_migs) return NVML_ERROR_NOT_FOUND;
    *migDevice = device->migs[index];
    return NVML_SUCCESS;
}
