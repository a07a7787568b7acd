/*
 * mla_decode_impl.h — one absorbed MLA decoding step of R rows over their own latent caches (kernels/backend.h:
 * mla_decode_rows; spec/mla.md §6), instantiated by mla.c for T = float / double with EXP. Each (row, head) is
 * one task: its scores, softmax and weighted sum of latents run over its own cached tokens in a fixed order
 * (tokens in sequence, the latent dims in fixed lanes), so a row's result does not depend on R or on the other
 * rows. No BLAS: a BLAS product picks its blocking from the sizes, which would tie a row's bits to its length's
 * neighbours.
 */
#define DCAT_(a, b) a##_##b
#define DCAT(a, b) DCAT_(a, b)

/* x · y over n elements: lanes of 8 in sequence, then a fixed pairwise sum of the lanes */
static inline T DCAT(decode_dot, SFX)(const T *x, const T *y, int64_t n)
{
    T l[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) l[j] += x[i + j] * y[i + j];
    for (int j = 0; i + j < n; j++) l[j] += x[i + j] * y[i + j];
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static int DCAT(decode_rows, SFX)(T *out, const T *qt, const T *qr, const T *c_new, const T *kr_new, void *const *c_bufs,
                                  void *const *kr_bufs, const int64_t *lens, int64_t R, int64_t H, int64_t dc,
                                  int64_t dr, double scale)
{
    int64_t Lmax = 0;
    for (int64_t r = 0; r < R; r++) {
        /* the new token first: every head of the row then reads its latents from the buffers alone */
        memcpy((T *)c_bufs[r] + lens[r] * dc, c_new + r * dc, (size_t)dc * sizeof(T));
        if (dr) memcpy((T *)kr_bufs[r] + lens[r] * dr, kr_new + r * dr, (size_t)dr * sizeof(T));
        if (lens[r] + 1 > Lmax) Lmax = lens[r] + 1;
    }
    int bad = 0;
    _Pragma("omp parallel if(R * H * Lmax * (dc + dr) > TIDE_OMP_MIN) reduction(|:bad)")
    {
        T *s = malloc((size_t)Lmax * sizeof(T));
        if (!s) bad = 1;
        _Pragma("omp for schedule(static)")
        for (int64_t rh = 0; rh < R * H; rh++) {
            if (!s) continue;
            int64_t r = rh / H, L = lens[r] + 1;
            const T *c = c_bufs[r], *kr = dr ? (const T *)kr_bufs[r] : NULL;
            const T *q1 = qt + rh * dc, *q2 = dr ? qr + rh * dr : NULL;
            T m = -INFINITY;
            for (int64_t t = 0; t < L; t++) {
                T v = DCAT(decode_dot, SFX)(q1, c + t * dc, dc);
                if (dr) v += DCAT(decode_dot, SFX)(q2, kr + t * dr, dr);
                s[t] = v * (T)scale;
                if (s[t] > m) m = s[t];
            }
            T sum = 0;
            for (int64_t t = 0; t < L; t++) {
                s[t] = EXP(s[t] - m);
                sum += s[t];
            }
            T *o = out + rh * dc;
            for (int64_t j = 0; j < dc; j++) o[j] = 0;
            for (int64_t t = 0; t < L; t++) {
                const T *ct = c + t * dc;
                T p = s[t];
                for (int64_t j = 0; j < dc; j++) o[j] += p * ct[j];
            }
            T inv = (T)1 / sum;
            for (int64_t j = 0; j < dc; j++) o[j] *= inv;
        }
        free(s);
    }
    return bad ? tide_set_error("mla_decode_rows: out of memory for %lld scores", (long long)Lmax) : 0;
}

#undef DCAT
#undef DCAT_
