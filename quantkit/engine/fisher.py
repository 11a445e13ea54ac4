"""Diagonal Fisher sensitivity (SqueezeLLM): F[W] = Σ over calibration windows of (∂loss/∂W)²,
the squared gradient of the LM loss of each window w.r.t. each linear weight, accumulated in fp32.

One window per backward pass; a post-accumulate-grad hook squares each weight's gradient into its
accumulator as soon as autograd produces it and frees the gradient, so besides the accumulators
(one fp32 copy of the selected weights) at most about one layer's gradients are alive at a time.
Only the selected weights require grad, so no other parameter gradient is ever materialised.
"""

import torch


def fisher_sensitivity(model, calib_ids, names=None, device=None):
    """{module name: fp32 Σ grad² [out, in]} for the nn.Linear modules `names` (default: all but
    lm_head) of `model`, over the windows calib_ids [n, T] (labels = the window itself)."""
    device = device or next(model.parameters()).device
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and (n in names if names is not None else n != "lm_head")}
    acc = {n: torch.zeros(m.weight.shape, dtype=torch.float32, device=m.weight.device) for n, m in linears.items()}
    saved = {p: p.requires_grad for p in model.parameters()}
    handles = []
    was_training = model.training
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for name, module in linears.items():
            weight = module.weight
            weight.requires_grad_(True)

            def hook(param, name=name):
                acc[name].add_(param.grad.detach().to(torch.float32).pow(2))
                param.grad = None

            handles.append(weight.register_post_accumulate_grad_hook(hook))
        model.eval()
        for row in calib_ids:
            ids = row.reshape(1, -1).to(device)
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p, flag in saved.items():
            p.requires_grad_(flag)
            p.grad = None
        model.train(was_training)
    return acc
