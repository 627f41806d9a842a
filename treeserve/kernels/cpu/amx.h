/* What the AMX kernels share: the tile configuration's layout and the run-time check that this
 * process may use tiles. Included by q8_kernels.c and amx_linear.c (the builder hashes this
 * header with each source). Only under __AMX_TILE__, or TREESERVE_AMX_EMULATED (the tile
 * instructions in plain C: amx_emulated.h). */
#ifndef TREESERVE_AMX_H
#define TREESERVE_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#ifdef TREESERVE_AMX_EMULATED
#include "amx_emulated.h"
#else
/* AMX where Linux hands out tile state (asked once a process) and a tile instruction runs: a
 * child process tries one first, since a CPU flag alone has not been enough on every VM (a
 * hypervisor that does not pass tile state through kills the instruction with SIGILL).
 * TREESERVE_AMX=0 turns tiles off: the kernels then take the paths of an AVX-512 CPU without
 * AMX (to compare them, or to test those paths on an AMX machine). */
static int amx_usable(void) {
    static int state = -1;
    if (state >= 0) return state;
    state = 0;
    const char *setting = getenv("TREESERVE_AMX");
    if (setting && setting[0] == '0' && setting[1] == 0) return state;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return state;
    const pid_t child = fork();
    if (child == 0) {
        tile_config cfg = {0};
        cfg.palette = 1, cfg.rows[0] = 1, cfg.colsb[0] = 64;
        _tile_loadconfig(&cfg);
        _tile_zero(0);
        _tile_release();
        _exit(0);
    }
    int status = 0;
    state = child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    return state;
}
#endif
#endif
