// spes-ext: a grouped matmul over every expert of a layer that computes weight gradients for
// the trained experts alone.
//
// A node holds all E experts but trains T of them. ATen's _grouped_mm takes one [E, in, out]
// weight; if that tensor requires grad, its backward computes dW for all E experts, and the
// gradient of the frozen ones is thrown away (75 % of the expert dW FLOPs at 4 of 16 owned).
// Here the weights arrive as `all` [E, out, in] without grad, slots ordered trained first, and
// `trained` [T, out, in]: a tensor with the same values as all[:T] that autograd tracks. The
// backward returns dX over all E experts and dW for the first T groups only (the 2D x 2D form
// of _grouped_mm over the first T offsets; rows past them are not read).

#include <torch/csrc/autograd/custom_function.h>

#include "guard.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GroupedTrainedFirst : public torch::autograd::Function<GroupedTrainedFirst> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& all,
                            const at::Tensor& trained, const at::Tensor& offsets) {
    ctx->save_for_backward({x, all, offsets});
    ctx->saved_data["trained"] = trained.size(0);
    return at::_grouped_mm(x, all.transpose(1, 2), offsets);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& all = saved[1];
    const auto& offsets = saved[2];
    auto t = ctx->saved_data["trained"].toInt();
    // A gradient may arrive expanded (the backward of a sum); the kernel needs real strides.
    auto dy = grads[0].contiguous();
    at::Tensor dx, dtrained;
    if (ctx->needs_input_grad(0)) dx = at::_grouped_mm(dy, all, offsets);
    if (ctx->needs_input_grad(2) && t > 0) {
      dtrained = at::_grouped_mm(x.t(), dy, offsets.narrow(0, 0, t)).transpose(1, 2);
    }
    return {dx, at::Tensor(), dtrained, at::Tensor()};
  }
};

}  // namespace

extern "C" {

// *out = x @ all[g]^T for each row group g of `offsets` (end offsets, int32, one per slot of
// `all`), as autograd sees it: gradients to x and to `trained` (the first T slots) only.
char* spes_ext_grouped_mm_trained_first(const at::Tensor* x, const at::Tensor* all,
                                        const at::Tensor* trained, const at::Tensor* offsets,
                                        at::Tensor** out) {
  return spes_ext::guarded([&] {
    TORCH_CHECK(all->dim() == 3 && trained->dim() == 3, "weights must be [slots, out, in]");
    TORCH_CHECK(trained->size(0) <= all->size(0) && offsets->size(0) == all->size(0),
                "trained slots ", trained->size(0), ", all slots ", all->size(0), ", offsets ",
                offsets->size(0));
    *out = new at::Tensor(GroupedTrainedFirst::apply(*x, *all, *trained, *offsets));
  });
}

}  // extern "C"
