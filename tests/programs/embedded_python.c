/* A program that embeds CPython through libpython, as a C++ inference server's Python backend
 * does: Py_Initialize (the environment honoured and `site` imported, as the `python` command
 * does), then a Python program run as __main__ with PyRun_SimpleFile. Nothing of tllm-affinity
 * in it: under `tllm-affinity run` the embedded interpreter must get the start-up hook as
 * `python` does (tests/zero_code.rs).
 *
 * Usage: embedded_python SCRIPT   exits 0 when the script ran to its end, 1 when it raised.
 * Built with the flags of the tests' interpreter's python3-config (--cflags, --ldflags --embed). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdio.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SCRIPT\n", argv[0]);
        return 2;
    }
    FILE *script = fopen(argv[1], "r");
    if (script == NULL) {
        perror(argv[1]);
        return 2;
    }
    Py_Initialize();
    /* Closes the file; prints the traceback itself when the script raises. */
    int raised = PyRun_SimpleFileEx(script, argv[1], 1);
    if (Py_FinalizeEx() < 0) {
        return 120;
    }
    return raised ? 1 : 0;
}
