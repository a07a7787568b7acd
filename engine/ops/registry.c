/* registry.c — the op table: one entry per public op (test-ops iterates it; an op missing here or in
   the test table fails the build or the test). */
#include "../internal.h"

#define DECL(name) int tide_##name##_forward(tide_node *, tide_tensor **, tide_tensor **); \
                   int tide_##name##_backward(tide_node *, tide_tensor **, tide_tensor **);
DECL(reshape) DECL(permute) DECL(slice) DECL(expand) DECL(concat) DECL(split) DECL(index_select) DECL(gather)
DECL(scatter_add) DECL(to_dtype) DECL(binary) DECL(unary) DECL(swiglu) DECL(sum) DECL(dimreduce) DECL(matmul)
DECL(embedding) DECL(rmsnorm) DECL(layernorm) DECL(softmax) DECL(cross_entropy) DECL(rope) DECL(attention)
DECL(kda) DECL(kda_gate) DECL(causal_conv1d) DECL(l2norm)
DECL(mla_attention)
DECL(attnres)
DECL(situ_glu) DECL(topk) DECL(moe_experts)
int tide_contiguous_forward(tide_node *, tide_tensor **, tide_tensor **);
int tide_identity_backward(tide_node *, tide_tensor **, tide_tensor **);

#define OP(id, name, fw, bw) [id] = {name, tide_##fw##_forward, bw}
const tide_op_def tide_op_defs[TIDE_OP_COUNT] = {
    OP(TIDE_OP_RESHAPE, "reshape", reshape, tide_reshape_backward),
    OP(TIDE_OP_PERMUTE, "permute", permute, tide_permute_backward),
    OP(TIDE_OP_SLICE, "slice", slice, tide_slice_backward),
    OP(TIDE_OP_CONTIGUOUS, "contiguous", contiguous, tide_identity_backward),
    OP(TIDE_OP_EXPAND, "expand", expand, tide_expand_backward),
    OP(TIDE_OP_CONCAT, "concat", concat, tide_concat_backward),
    OP(TIDE_OP_SPLIT, "split", split, tide_split_backward),
    OP(TIDE_OP_INDEX_SELECT, "index_select", index_select, tide_index_select_backward),
    OP(TIDE_OP_GATHER, "gather", gather, tide_gather_backward),
    OP(TIDE_OP_SCATTER_ADD, "scatter_add", scatter_add, tide_scatter_add_backward),
    OP(TIDE_OP_TO_DTYPE, "to_dtype", to_dtype, tide_to_dtype_backward),
    OP(TIDE_OP_TO_DEVICE, "to_device", to_dtype, tide_to_dtype_backward),
    OP(TIDE_OP_ADD, "add", binary, tide_binary_backward),
    OP(TIDE_OP_SUB, "sub", binary, tide_binary_backward),
    OP(TIDE_OP_MUL, "mul", binary, tide_binary_backward),
    OP(TIDE_OP_DIV, "div", binary, tide_binary_backward),
    OP(TIDE_OP_ADD_SCALAR, "add_scalar", unary, tide_unary_backward),
    OP(TIDE_OP_MUL_SCALAR, "mul_scalar", unary, tide_unary_backward),
    OP(TIDE_OP_POW_SCALAR, "pow_scalar", unary, tide_unary_backward),
    OP(TIDE_OP_NEG, "neg", unary, tide_unary_backward),
    OP(TIDE_OP_EXP, "exp", unary, tide_unary_backward),
    OP(TIDE_OP_LOG, "log", unary, tide_unary_backward),
    OP(TIDE_OP_SQRT, "sqrt", unary, tide_unary_backward),
    OP(TIDE_OP_RSQRT, "rsqrt", unary, tide_unary_backward),
    OP(TIDE_OP_TANH, "tanh", unary, tide_unary_backward),
    OP(TIDE_OP_SIGMOID, "sigmoid", unary, tide_unary_backward),
    OP(TIDE_OP_SILU, "silu", unary, tide_unary_backward),
    OP(TIDE_OP_GELU, "gelu", unary, tide_unary_backward),
    OP(TIDE_OP_SOFTPLUS, "softplus", unary, tide_unary_backward),
    OP(TIDE_OP_RELU, "relu", unary, tide_unary_backward),
    OP(TIDE_OP_ABS, "abs", unary, tide_unary_backward),
    OP(TIDE_OP_SWIGLU, "swiglu", swiglu, tide_swiglu_backward),
    OP(TIDE_OP_SUM, "sum", sum, tide_sum_backward),
    OP(TIDE_OP_MEAN, "mean", sum, tide_sum_backward),
    OP(TIDE_OP_MAX, "max", dimreduce, tide_dimreduce_backward),
    OP(TIDE_OP_ARGMAX, "argmax", dimreduce, NULL),
    OP(TIDE_OP_LOGSUMEXP, "logsumexp", dimreduce, tide_dimreduce_backward),
    OP(TIDE_OP_MATMUL, "matmul", matmul, tide_matmul_backward),
    OP(TIDE_OP_EMBEDDING, "embedding", embedding, tide_embedding_backward),
    OP(TIDE_OP_RMSNORM, "rmsnorm", rmsnorm, tide_rmsnorm_backward),
    OP(TIDE_OP_LAYERNORM, "layernorm", layernorm, tide_layernorm_backward),
    OP(TIDE_OP_SOFTMAX, "softmax", softmax, tide_softmax_backward),
    OP(TIDE_OP_LOG_SOFTMAX, "log_softmax", softmax, tide_softmax_backward),
    OP(TIDE_OP_CROSS_ENTROPY, "cross_entropy", cross_entropy, tide_cross_entropy_backward),
    OP(TIDE_OP_ROPE, "rope", rope, tide_rope_backward),
    OP(TIDE_OP_ATTENTION, "attention", attention, tide_attention_backward),
    OP(TIDE_OP_KDA, "kda", kda, tide_kda_backward),
    OP(TIDE_OP_KDA_GATE, "kda_gate", kda_gate, tide_kda_gate_backward),
    OP(TIDE_OP_CAUSAL_CONV1D, "causal_conv1d", causal_conv1d, tide_causal_conv1d_backward),
    OP(TIDE_OP_L2NORM, "l2norm", l2norm, tide_l2norm_backward),
    OP(TIDE_OP_MLA_ATTENTION, "mla_attention", mla_attention, tide_mla_attention_backward),
    OP(TIDE_OP_ATTNRES, "attnres", attnres, tide_attnres_backward),
    OP(TIDE_OP_SITU_GLU, "situ_glu", situ_glu, tide_situ_glu_backward),
    OP(TIDE_OP_TOPK, "topk", topk, tide_topk_backward),
    OP(TIDE_OP_MOE_EXPERTS, "moe_experts", moe_experts, tide_moe_experts_backward),
};
_Static_assert(sizeof tide_op_defs / sizeof tide_op_defs[0] == TIDE_OP_COUNT, "every op id needs a registry entry");
