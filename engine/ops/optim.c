/* optim.c — the AdamW update, in place and outside the graph (optim.md §2); the checked form also reports a
   non-finite result through a flag the update's own kernel sets (the step's post-update guard). */
#include <math.h>
#include "../internal.h"

/* ---- AdamW (in place, no graph) -------------------------------------------------------------------------------------- */
int tide_adamw_step_checked_(tide_tensor *param, const tide_tensor *grad, tide_tensor *m, tide_tensor *v, double lr,
                             double beta1, double beta2, double eps, double weight_decay, int64_t step,
                             tide_tensor *nonfinite)
{
    const char *op = "adamw";
    if (tide_check_float(param, op, "param") || tide_check_float(grad, op, "grad") || tide_check_float(m, op, "m") ||
        tide_check_float(v, op, "v")) return -1;
    char a[128], b[128];
    const tide_tensor *others[3] = {grad, m, v};
    const char *names[3] = {"grad", "m", "v"};
    for (int i = 0; i < 3; i++) {
        if (!tide_same_shape(param, others[i]))
            return tide_set_error("adamw: %s is %s but param is %s", names[i], SHAPE_STR(others[i], a), SHAPE_STR(param, b));
        if (tide_check_same_device(param, others[i], op)) return -1;
    }
    if (!tide_is_contiguous(param) || !tide_is_contiguous(m) || !tide_is_contiguous(v))
        return tide_set_error("adamw: param, m and v must be contiguous");
    if (m->dtype != param->dtype || v->dtype != param->dtype)
        return tide_set_error("adamw: m and v must have the param's dtype %s", tide_dtype_name(param->dtype));
    if (nonfinite) {
        if (nonfinite->dtype != TIDE_I32 || nonfinite->numel < 1 || !tide_is_contiguous(nonfinite))
            return tide_set_error("adamw: nonfinite must be a contiguous i32 tensor of at least one element, got %s %s",
                                  tide_dtype_name(nonfinite->dtype), SHAPE_STR(nonfinite, a));
        if (tide_check_same_device(param, nonfinite, op)) return -1;
    }
    if (!(lr >= 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) || !(eps > 0) || !(weight_decay >= 0) || step < 0)
        return tide_set_error("adamw: invalid hyper-parameters lr=%g beta1=%g beta2=%g eps=%g weight_decay=%g step=%lld", lr, beta1,
                              beta2, eps, weight_decay, (long long)step);
    /* the update reads grad in place when it already has the param's layout; otherwise a converted copy */
    tide_tensor *g;
    int rc = 0;
    if (grad->dtype == param->dtype && tide_is_contiguous(grad)) {
        g = (tide_tensor *)grad;
        tide_tensor_retain(g);
    } else {
        g = tide_empty(param->dtype, param->ndim, param->shape, param->device);
        if (!g) return -1;
        rc = tide_copy_(g, grad);
    }
    double bc1 = 1.0 - pow(beta1, (double)(step + 1)), bc2 = 1.0 - pow(beta2, (double)(step + 1));
    if (!rc && param->numel > 0)
        rc = TIDE_DISPATCH(param->device, adamw, "adamw", param->dtype, tide_data(param), tide_data(g), tide_data(m),
                           tide_data(v), nonfinite ? (int *)tide_data(nonfinite) : NULL, param->numel, lr, beta1,
                           beta2, eps, weight_decay, bc1, bc2);
    tide_tensor_release(g);
    return rc;
}

int tide_adamw_step_(tide_tensor *param, const tide_tensor *grad, tide_tensor *m, tide_tensor *v, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step)
{
    return tide_adamw_step_checked_(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, NULL);
}
