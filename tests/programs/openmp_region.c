/* A real OpenMP (libgomp) workload for the runtime tests, built as a shared object with
 * -fopenmp and called through ctypes (runtime_helpers.py).
 *
 * rt_omp_run runs one parallel region of the default team size (OMP_NUM_THREADS) doing real
 * floating-point work; every member writes its kernel tid into tids[omp_get_thread_num()]. The
 * caller is member 0; members 1.. are the calling thread's libgomp pool, which libgomp keeps
 * alive (docked) between regions, so their masks can be read from /proc after the call returns.
 * Each thread that starts a region gets its own pool: a host thread's pool and a worker thread's
 * pool are different threads. */
#define _GNU_SOURCE
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

int rt_omp_run(int *tids, int max, double *result) {
    int team = 0;
    double sum = 0.0;
#pragma omp parallel reduction(+ : sum)
    {
        int me = omp_get_thread_num();
        if (me < max) tids[me] = (int)syscall(SYS_gettid);
#pragma omp single
        team = omp_get_num_threads();
        double x = 0.0;
        for (long k = 1; k <= 200000; k++) x += 1.0 / ((double)k * (double)(me + 1));
        sum += x;
    }
    if (result) *result = sum;
    return team;
}
