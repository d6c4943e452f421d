/* Width-generic vector helpers: floatV/intV are VEC-wide (4, 8 or 16) float/int vectors.
 *   VLOADV(i, p) / VSTOREV(x, i, p)   vloadN / vstoreN at p[VEC*i ..]
 *   LDS_LOADV(i, p)                   floatV at p[VEC*i ..] of a VEC-aligned __local float array
 *   IOTA_V                            (0, 1, ..., VEC-1)
 *   HMAX_V(x) / HSUM_V(x)             horizontal max / sum of a floatV
 */
#ifndef FLASHCL_VEC_H
#define FLASHCL_VEC_H

#include "common.h"   /* FLASHCL_CAT, LDS_ALIGNED */

#define floatV FLASHCL_CAT(float, VEC)
#define intV FLASHCL_CAT(int, VEC)
#define VLOADV(i, p) FLASHCL_CAT(vload, VEC)((i), (p))
#define VSTOREV(x, i, p) FLASHCL_CAT(vstore, VEC)((x), (i), (p))
/* one wide load, not VEC scalar ones (NVIDIA split vloadN from local memory into ld.shared.f32):
 * the array is declared LDS_ALIGNED and every offset is a multiple of VEC */
#define LDS_LOADV(i, p) (((__local const floatV *)(p))[i])

#define HMAX4(x) fmax(fmax((x).s0, (x).s1), fmax((x).s2, (x).s3))
#define HSUM4(x) (((x).s0 + (x).s1) + ((x).s2 + (x).s3))
#if VEC == 4
#define IOTA_V ((int4)(0, 1, 2, 3))
#define HMAX_V(x) HMAX4(x)
#define HSUM_V(x) HSUM4(x)
#elif VEC == 8
#define IOTA_V ((int8)(0, 1, 2, 3, 4, 5, 6, 7))
#define HMAX_V(x) HMAX4(fmax((x).lo, (x).hi))
#define HSUM_V(x) HSUM4((x).lo + (x).hi)
#elif VEC == 16
#define IOTA_V ((int16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
#define HMAX_V(x) HMAX4(fmax(fmax((x).lo.lo, (x).lo.hi), fmax((x).hi.lo, (x).hi.hi)))
#define HSUM_V(x) HSUM4(((x).lo.lo + (x).lo.hi) + ((x).hi.lo + (x).hi.hi))
#endif

#endif
