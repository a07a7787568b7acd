/*
 * op_list.h — THE list of ops. One line per op: X(ID, name, forward, backward) for a differentiable op,
 * N(ID, name, forward) for one without a gradient. Everything else comes from it (internal.h, registry.c):
 * the enum entry TIDE_OP_<ID>, the registry entry {"name", tide_<forward>_forward, tide_<backward>_backward}
 * and the prototypes of those functions, which the op files see through internal.h so the compiler checks
 * every definition against them (-Wmissing-prototypes catches a forward that is not listed here). Several
 * ops share one forward/backward pair (the binary and unary families), told apart by their attributes.
 */
#ifndef TIDE_OP_LIST_H
#define TIDE_OP_LIST_H

#define TIDE_OP_LIST(X, N)                                             \
    /* layout.c */                                                     \
    X(RESHAPE, reshape, reshape, reshape)                              \
    X(PERMUTE, permute, permute, permute)                              \
    X(SLICE, slice, slice, slice)                                      \
    X(CONTIGUOUS, contiguous, contiguous, identity)                    \
    X(EXPAND, expand, expand, expand)                                  \
    X(CONCAT, concat, concat, concat)                                  \
    X(SPLIT, split, split, split)                                      \
    X(INDEX_SELECT, index_select, index_select, index_select)          \
    X(GATHER, gather, gather, gather)                                  \
    X(SCATTER_ADD, scatter_add, scatter_add, scatter_add)              \
    X(TO_DTYPE, to_dtype, to_dtype, to_dtype)                          \
    X(TO_DEVICE, to_device, to_dtype, to_dtype)                        \
    /* elementwise.c */                                                \
    X(ADD, add, binary, binary)                                        \
    X(SUB, sub, binary, binary)                                        \
    X(MUL, mul, binary, binary)                                        \
    X(DIV, div, binary, binary)                                        \
    X(ADD_SCALAR, add_scalar, unary, unary)                            \
    X(MUL_SCALAR, mul_scalar, unary, unary)                            \
    X(POW_SCALAR, pow_scalar, unary, unary)                            \
    X(NEG, neg, unary, unary)                                          \
    X(EXP, exp, unary, unary)                                          \
    X(LOG, log, unary, unary)                                          \
    X(SQRT, sqrt, unary, unary)                                        \
    X(RSQRT, rsqrt, unary, unary)                                      \
    X(TANH, tanh, unary, unary)                                        \
    X(SIGMOID, sigmoid, unary, unary)                                  \
    X(SILU, silu, unary, unary)                                        \
    X(GELU, gelu, unary, unary)                                        \
    X(GELU_ERF, gelu_erf, unary, unary)                                \
    X(SOFTPLUS, softplus, unary, unary)                                \
    X(RELU, relu, unary, unary)                                        \
    X(ABS, abs, unary, unary)                                          \
    X(SWIGLU, swiglu, swiglu, swiglu)                                  \
    /* reduce.c */                                                     \
    X(SUM, sum, sum, sum)                                              \
    X(MEAN, mean, sum, sum)                                            \
    X(MAX, max, dimreduce, dimreduce)                                  \
    N(ARGMAX, argmax, dimreduce)                                       \
    X(LOGSUMEXP, logsumexp, dimreduce, dimreduce)                      \
    /* matmul.c */                                                     \
    X(MATMUL, matmul, matmul, matmul)                                  \
    X(LINEAR, linear, linear, linear)                                  \
    /* embedding.c */                                                  \
    X(EMBEDDING, embedding, embedding, embedding)                      \
    /* norm.c */                                                       \
    X(RMSNORM, rmsnorm, rmsnorm, rmsnorm)                              \
    X(LAYERNORM, layernorm, layernorm, layernorm)                      \
    /* softmax.c */                                                    \
    X(SOFTMAX, softmax, softmax, softmax)                              \
    X(LOG_SOFTMAX, log_softmax, softmax, softmax)                      \
    /* loss.c */                                                       \
    X(CROSS_ENTROPY, cross_entropy, cross_entropy, cross_entropy)      \
    X(TOKEN_LOGPROBS, token_logprobs, token_logprobs, token_logprobs) \
    /* rope.c */                                                       \
    X(ROPE, rope, rope, rope)                                          \
    /* vision.c */                                                     \
    X(ROPE2D, rope2d, rope2d, rope2d)                                  \
    X(POS_INTERP, pos_interp, pos_interp, pos_interp)                  \
    /* attention.c */                                                  \
    X(ATTENTION, attention, attention, attention)                      \
    /* kda.c */                                                        \
    X(KDA, kda, kda, kda)                                              \
    X(KDA_PAIRS, kda_pairs, kda_pairs, kda_pairs)                      \
    N(KDA_DECODE_ROWS, kda_decode_rows, kda_decode_rows)               \
    X(KDA_GATE, kda_gate, kda_gate, kda_gate)                          \
    X(CAUSAL_CONV1D, causal_conv1d, causal_conv1d, causal_conv1d)      \
    N(CONV_DECODE_ROWS, conv_decode_rows, conv_decode_rows)            \
    X(L2NORM, l2norm, l2norm, l2norm)                                  \
    /* mla.c */                                                        \
    X(MLA_ATTENTION, mla_attention, mla_attention, mla_attention)      \
    X(MLA_LATENT_ATTENTION, mla_latent_attention, mla_latent_attention, mla_latent_attention) \
    N(MLA_DECODE_ROWS, mla_decode_rows, mla_decode_rows)               \
    /* vision_attention.c */                                           \
    X(VARLEN_ATTENTION, varlen_attention, varlen_attention, varlen_attention) \
    /* attnres.c */                                                    \
    X(ATTNRES, attnres, attnres, attnres)                              \
    /* moe.c */                                                        \
    X(SITU_GLU, situ_glu, situ_glu, situ_glu)                          \
    X(TOPK, topk, topk, topk)                                          \
    X(MOE_EXPERTS, moe_experts, moe_experts, moe_experts)              \
    /* collective.c */                                                 \
    X(ALLTOALLV, alltoallv, alltoallv, alltoallv)

#endif
