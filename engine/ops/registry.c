/* registry.c — the op table, generated from the one list in op_list.h: entry TIDE_OP_<ID> is {"name", forward,
   backward}. Sized by its initialisers, so the assertion below fails the build if the table and the enum ever
   disagree; test-ops fails when an op has no test case. */
#include "../internal.h"

#define TIDE_OP_DEF_X(ID, name, fw, bw) [TIDE_OP_##ID] = {#name, tide_##fw##_forward, tide_##bw##_backward},
#define TIDE_OP_DEF_N(ID, name, fw) [TIDE_OP_##ID] = {#name, tide_##fw##_forward, NULL},
const tide_op_def tide_op_defs[] = {TIDE_OP_LIST(TIDE_OP_DEF_X, TIDE_OP_DEF_N)};
_Static_assert(sizeof tide_op_defs / sizeof tide_op_defs[0] == TIDE_OP_COUNT, "every op id needs a registry entry");
