/* The architecture kernels' entry points (arch/x86, arch/arm), which kernels.c
 * selects among beside its scalar reference: each returns NULL / 0 for a kernel that
 * is not its own or that this CPU lacks. */
#ifndef SPEL_ARCH_H
#define SPEL_ARCH_H

#include "spel_internal.h"

#define SPEL_LUT16(F) F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), F(9), F(10), F(11), F(12), F(13), F(14), F(15)

#if defined(__x86_64__) || defined(__i386__)
#define SPEL_X86 1
int spel_x86_available(int kernel);               /* avx2, vnni */
spel_tern_rows_fn spel_x86_tern(int kernel);
spel_q8_rows_fn spel_x86_q8(int kernel);
#endif

#if defined(__aarch64__)
int spel_arm_available(int kernel);               /* dotprod, addsub */
spel_tern_rows_fn spel_arm_tern(int kernel);
spel_q8_rows_fn spel_arm_q8(int kernel);
#endif

#endif
