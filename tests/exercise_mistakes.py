"""The likely wrong answers to every exercise, each with the diagnosis its check must give.

For each exercise: what a learner who half-understood the lesson would write (the planted bug,
the student stub and the dodge in tests/exercise_variants.py are tested elsewhere), and ``says``,
a phrase the check's diagnosis must contain, because it names that answer's mistake rather than
another one. tests/test_exercises.py runs every entry. Adding a case is one `mistake(...)` call.
Each answer is one exercise cell: it may use only `grading.EXERCISE_NAMESPACE`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mistake:
    label: str  # what the learner did, in a few words (the test's ID)
    answer: str
    says: str


MISTAKES: dict[str, list[Mistake]] = {}


def mistake(exercise_id: str, label: str, *, says: str, answer: str) -> None:
    MISTAKES.setdefault(exercise_id, []).append(Mistake(label, answer.strip() + "\n", says))


# 00.1 one correct SGD step
mistake("00.1", "zero_grad between backward and step", says="but .grad was empty by then", answer="""
def one_training_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.zero_grad()
    optimizer.step()
    return loss.item()
""")
mistake("00.1", "forgets optimizer.step", says="optimizer.step() was never called", answer="""
def one_training_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item()
""")
mistake("00.1", "returns the loss tensor", says="returned a Tensor, not the loss as a Python float", answer="""
def one_training_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss
""")
mistake("00.1", "returns the loss after the step", says="but F.mse_loss(model(x), y) on that batch before the step", answer="""
def one_training_step(model, optimizer, x, y):
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    return F.mse_loss(model(x), y).item()
""")

# 00.2 one gradient per call
mistake("00.2", "zero_ after append, no copy", says="holds the same tensor more than once", answer="""
def grad_of_each_call(w, inputs):
    grads = []
    for x in inputs:
        torch.tanh(w * x).sum().backward()
        grads.append(w.grad)
        w.grad.zero_()
    return grads
""")
mistake("00.2", "copies but never clears", says="also holds the gradient left in w.grad before your call", answer="""
def grad_of_each_call(w, inputs):
    grads = []
    for x in inputs:
        torch.tanh(w * x).sum().backward()
        grads.append(w.grad.clone())
    return grads
""")
mistake("00.2", "derives tanh' by hand", says="from a formula written by hand", answer="""
def grad_of_each_call(w, inputs):
    return [(1 - torch.tanh(w * x) ** 2) * x for x in inputs]
""")
mistake("00.2", "derives tanh' by hand, detached", says="from a formula written by hand", answer="""
def grad_of_each_call(w, inputs):
    with torch.no_grad():
        return [(1 - torch.tanh(w * x) ** 2) * x for x in inputs]
""")
mistake("00.2", "appends autograd.grad's tuple", says="entry 0 of your list is a tuple, not a tensor", answer="""
def grad_of_each_call(w, inputs):
    return [torch.autograd.grad(torch.tanh(w * x).sum(), w) for x in inputs]
""")

# 01.1 an entropy term with a finite gradient
mistake("01.1", "masks the output with a product", says="the values are not finite at p = [0.0, 0.0]", answer="""
def entropy_term(p):
    return (p > 0) * p * torch.log(p)
""")
mistake("01.1", "clamps p inside the log only", says="the gradient at p == 0 is -27.6, not 0", answer="""
def entropy_term(p):
    return p * torch.log(p.clamp(min=1e-12))
""")
mistake("01.1", "adds eps inside the log", says="the values differ by up to 1e-08 from p * log(p)", answer="""
def entropy_term(p):
    return p * torch.log(p + 1e-8)
""")

# 01.2 find the parameters a loss cannot reach
mistake("01.2", "follows only the last input of each node", says="but the unreachable parameters are", answer="""
def unreachable_parameters(output, model):
    reached = set()
    node = output.grad_fn
    while node is not None:
        if hasattr(node, "variable"):
            reached.add(id(node.variable))
        node = node.next_functions[-1][0] if node.next_functions else None
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in reached]
""")
mistake("01.2", "reads .grad after backward", says="your function ran backward", answer="""
def unreachable_parameters(output, model):
    output.sum().backward(retain_graph=True)
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
""")
mistake("01.2", "forgets requires_grad", says="which do not require grad", answer="""
def unreachable_parameters(output, model):
    reached, seen, pending = set(), set(), [output.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            reached.add(id(node.variable))
        pending.extend(next_node for next_node, _ in node.next_functions)
    return [name for name, p in model.named_parameters() if id(p) not in reached]
""")

# 01.3 a copy you can safely edit
mistake("01.3", "copies with .data", says="they share storage", answer="""
def editable_copy(t):
    return t.data
""")
mistake("01.3", "detach, then contiguous", says="they share storage", answer="""
def editable_copy(t):
    return t.detach().contiguous()
""")
mistake("01.3", "clone alone", says="the copy is still part of the autograd graph", answer="""
def editable_copy(t):
    copy = t.clone()
    with torch.no_grad():
        return copy
""")

# 02.1 clip the gradient you are about to use
mistake("02.1", "returns the norm after clipping", says="which is max_norm itself", answer="""
def clipped_step(model, optimizer, loss, max_norm):
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    optimizer.step()
    return float(norm)
""")
mistake("02.1", "no zero_grad", says="plus an old one left in .grad", answer="""
def clipped_step(model, optimizer, loss, max_norm):
    loss.backward()
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return float(total_norm)
""")
mistake("02.1", "returns the tensor clip_grad_norm_ gives", says="returned a Tensor, not the norm as a Python float", answer="""
def clipped_step(model, optimizer, loss, max_norm):
    optimizer.zero_grad()
    loss.backward()
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return total_norm
""")
mistake("02.1", "clips each parameter on its own", says="from one SGD step on this batch's gradient clipped to max_norm", answer="""
def clipped_step(model, optimizer, loss, max_norm):
    optimizer.zero_grad()
    loss.backward()
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    for p in model.parameters():
        torch.nn.utils.clip_grad_norm_([p], max_norm)
    optimizer.step()
    return float(total_norm)
""")

# 02.2 accumulate micro-batches into the full-batch gradient
mistake("02.2", "mean loss per micro-batch, unscaled", says="the sum of the", answer="""
def accumulate_gradients(model, x, y, micro_batch):
    for x_piece, y_piece in zip(x.split(micro_batch), y.split(micro_batch)):
        F.cross_entropy(model(x_piece), y_piece).backward()
""")
mistake("02.2", "sum divided by micro_batch", says=".grad is 2.75 times the full-batch gradient", answer="""
def accumulate_gradients(model, x, y, micro_batch):
    for x_piece, y_piece in zip(x.split(micro_batch), y.split(micro_batch)):
        (F.cross_entropy(model(x_piece), y_piece, reduction="sum") / micro_batch).backward()
""")
mistake("02.2", "copies the notebook's weight_by_rows helper", says="you weighed each micro-batch by its rows", answer="""
def accumulate_gradients(model, x, y, micro_batch):
    for x_piece, y_piece in zip(x.split(micro_batch), y.split(micro_batch)):
        (F.cross_entropy(model(x_piece), y_piece) * len(y_piece) / len(y)).backward()
""")
mistake("02.2", "summed losses over len(y)", says="you divided the summed losses by len(y) = 30", answer="""
def accumulate_gradients(model, x, y, micro_batch):
    for x_piece, y_piece in zip(x.split(micro_batch), y.split(micro_batch)):
        (F.cross_entropy(model(x_piece), y_piece, reduction="sum") / len(y)).backward()
""")
mistake("02.2", "zero_grad inside the loop", says="only the last micro-batch's gradient is left in .grad", answer="""
def accumulate_gradients(model, x, y, micro_batch):
    for x_piece, y_piece in zip(x.split(micro_batch), y.split(micro_batch)):
        model.zero_grad()
        (F.cross_entropy(model(x_piece), y_piece, reduction="sum") / len(y)).backward()
""")

# 03.1 a LayerNorm that trains
mistake("03.1", "divides in place with /=", says="modified by an inplace operation", answer="""
def layer_norm_rows(x, eps=1e-5):
    centred = x - x.mean(-1, keepdim=True)
    centred /= torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return centred
""")
mistake("03.1", "forgets eps", says="it matches the normalisation without eps", answer="""
def layer_norm_rows(x, eps=1e-5):
    centred = x - x.mean(-1, keepdim=True)
    return centred / centred.pow(2).mean(-1, keepdim=True).sqrt()
""")
mistake("03.1", "unbiased variance", says="it divides by the unbiased variance", answer="""
def layer_norm_rows(x, eps=1e-5):
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + eps)
""")

# 03.2 a custom backward that gradcheck accepts
mistake("03.2", "forgets grad_output", says="dL/da is dd/da alone", answer="""
def distance_backward(grad_output, a, b):
    difference = a - b
    grad_a = difference / difference.norm(dim=1, keepdim=True)
    return grad_a, -grad_a
""")
mistake("03.2", "same sign for both inputs", says="dL/db differs from the true derivative", answer="""
def distance_backward(grad_output, a, b):
    difference = a - b
    grad_a = grad_output[:, None] * difference / difference.norm(dim=1, keepdim=True)
    return grad_a, grad_a
""")
mistake("03.2", "divides by the squared norm", says="dL/da divides by the squared distance", answer="""
def distance_backward(grad_output, a, b):
    difference = a - b
    grad_a = grad_output[:, None] * difference / difference.pow(2).sum(1, keepdim=True)
    return grad_a, -grad_a
""")

# 04.1 a latent sample that the encoder can learn from
mistake("04.1", "scales the noise by the variance", says="exp(log_var) is the variance, not the standard deviation", answer="""
def sample_latent(mu, log_var):
    return mu + torch.exp(log_var) * torch.randn_like(mu)
""")
mistake("04.1", "detaches mu", says="the gradient that reaches mu is zero", answer="""
def sample_latent(mu, log_var):
    return mu.detach() + torch.exp(0.5 * log_var) * torch.randn_like(mu)
""")
mistake("04.1", "samples under no_grad", says="z does not require grad", answer="""
def sample_latent(mu, log_var):
    with torch.no_grad():
        return mu + torch.exp(0.5 * log_var) * torch.randn_like(mu)
""")

# 04.2 the mean output of each padded sequence, through a bidirectional GRU
mistake("04.2", "the final hidden states instead of the mean", says="are each direction's final hidden state", answer="""
def mean_output(gru, padded, lengths):
    packed = nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
    _, hidden = gru(packed)
    return torch.cat([hidden[0], hidden[1]], dim=1)
""")
mistake("04.2", "mask after the GRU, padded mean", says="differ from what each sequence gives when run alone", answer="""
def mean_output(gru, padded, lengths):
    outputs, _ = gru(padded)
    real = (torch.arange(padded.shape[1])[None, :] < lengths[:, None]).to(outputs.dtype)
    return (outputs * real[:, :, None]).mean(1)
""")

# 05.1 fine-tune a pretrained backbone under a new head, with the backbone's BatchNorm frozen
mistake("05.1", "the whole backbone in eval mode", says="module 'backbone' (Sequential) is in eval mode", answer="""
def set_finetune_mode(model, pretrained):
    model.train()
    model.get_submodule(pretrained).eval()
""")
mistake("05.1", "BatchNorm in eval mode but not frozen", says="still trains its weight or bias", answer="""
def set_finetune_mode(model, pretrained):
    model.train()
    for module in model.get_submodule(pretrained).modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()
""")
mistake("05.1", "frozen, then model.train() after", says="is in training mode, so every forward pass", answer="""
def set_finetune_mode(model, pretrained):
    for module in model.get_submodule(pretrained).modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()
            module.requires_grad_(False)
    model.train()
""")

# 05.2 re-estimate BatchNorm statistics on new data
mistake("05.2", "copies update_bn from the notebook", says="Dropout was in train mode during your forward passes", answer="""
def recalibrate_batchnorm(model, x, batch_size):
    torch.optim.swa_utils.update_bn(list(x.split(batch_size)), model)
    model.eval()
""")
mistake("05.2", "reset and momentum=None, whole model in train mode", says="Dropout was in train mode", answer="""
def recalibrate_batchnorm(model, x, batch_size):
    layers = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    momenta = [layer.momentum for layer in layers]
    model.train()
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            model(x[start:start + batch_size])
    for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum
    model.eval()
""")
mistake("05.2", "momentum=None without a reset", says="were never reset", answer="""
def recalibrate_batchnorm(model, x, batch_size):
    layers = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.momentum = None
    model.train()
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            model(x[start:start + batch_size])
    for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum
    model.eval()
""")
mistake("05.2", "momentum not restored", says="the layers' momentum is [None, None] afterwards", answer="""
def recalibrate_batchnorm(model, x, batch_size):
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm1d):
            layer.reset_running_stats()
            layer.momentum = None
    model.train()
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            model(x[start:start + batch_size])
    model.eval()
""")
mistake("05.2", "a reset, but the default momentum", says="an exponential average over a few batches", answer="""
def recalibrate_batchnorm(model, x, batch_size):
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm1d):
            layer.reset_running_stats()
    model.train()
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            model(x[start:start + batch_size])
    model.eval()
""")

# 06.1 one AdamW step, by hand
mistake("06.1", "decays after the Adam update", says="the decay shrank the parameter after the Adam update", answer="""
def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    m_hat = exp_avg / (1 - beta1 ** step)
    v_hat = exp_avg_sq / (1 - beta2 ** step)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))
    param.mul_(1 - lr * weight_decay)
""")
mistake("06.1", "no bias correction", says="the update has no bias correction", answer="""
def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.sub_(lr * exp_avg / (exp_avg_sq.sqrt() + eps))
""")
mistake("06.1", "decay not scaled by lr", says="the decay was not multiplied by the learning rate", answer="""
def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    param.mul_(1 - weight_decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    m_hat = exp_avg / (1 - beta1 ** step)
    v_hat = exp_avg_sq / (1 - beta2 ** step)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))
""")

# 06.2 layer-wise weight decay with parameter groups
mistake("06.2", "leaves the 1-d parameters out", says="are in no group, so the optimizer would never update them", answer="""
def layerwise_param_groups(model, decay_by_module):
    return [{"params": [p for p in getattr(model, name).parameters() if p.ndim >= 2], "weight_decay": decay}
            for name, decay in decay_by_module.items()]
""")
mistake("06.2", "a misspelt option key", says="'embedding.weight' decays at 0.01, but its module's decay is 0.005", answer="""
def layerwise_param_groups(model, decay_by_module):
    groups = []
    for name, decay in decay_by_module.items():
        parameters = list(getattr(model, name).parameters())
        groups.append({"params": [p for p in parameters if p.ndim >= 2], "decay": decay})
        groups.append({"params": [p for p in parameters if p.ndim < 2], "decay": 0.0})
    return groups
""")

# 07.1 clip by the total norm
mistake("07.1", "scales copies, not the tensors given", says="the tensors were not changed in place", answer="""
def clip_total_norm_(grads, max_norm):
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [g * scale for g in grads]
    return total
""")
mistake("07.1", "always scales to max_norm", says="on three tensors whose joint norm is below max_norm", answer="""
def clip_total_norm_(grads, max_norm):
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    for g in grads:
        g.mul_(max_norm / (total + 1e-6))
    return total
""")
mistake("07.1", "returns the norm after clipping", says="the joint L2 norm of all the gradients before clipping", answer="""
def clip_total_norm_(grads, max_norm):
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return torch.sqrt(sum((g * g).sum() for g in grads))
""")

# 07.2 skip a step whose gradient is not finite
mistake("07.2", "steps first, checks after", says="with a NaN value in one gradient, your function changed the weights", answer="""
def guarded_step(model, optimizer, max_norm):
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return bool(torch.isfinite(total))
""")
mistake("07.2", "compares the norm with a large threshold", says="with a NaN value in one gradient, your function changed the weights", answer="""
def guarded_step(model, optimizer, max_norm):
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if total > 1e6:
        return False
    optimizer.step()
    return True
""")

# 08.1 read the accumulated gradient
mistake("08.1", "late-binding closure", says="every hook stored its norm under one key", answer="""
def record_grad_norms(model):
    norms, handles = {}, []
    for name, param in model.named_parameters():
        def store(p):
            norms[name] = p.grad.norm().item()
        handles.append(param.register_post_accumulate_grad_hook(store))
    return norms, handles
""")
mistake("08.1", "the parameter's norm, not its gradient's", says="the norm of the parameter itself", answer="""
def record_grad_norms(model):
    norms, handles = {}, []
    for name, param in model.named_parameters():
        def store(p, name=name):
            norms[name] = p.norm().item()
        handles.append(param.register_post_accumulate_grad_hook(store))
    return norms, handles
""")
mistake("08.1", "returns the norms alone", says="expected (norms, handles)", answer="""
def record_grad_norms(model):
    norms = {}
    for name, param in model.named_parameters():
        def store(p, name=name):
            norms[name] = p.grad.norm().item()
        param.register_post_accumulate_grad_hook(store)
    return norms
""")

# 08.2 a spike alert that sees NaN
mistake("08.2", "a NaN reading is not alerted", says="for a NaN reading, your function returned", answer="""
def spike_alert(history, current, factor=3.0, window=5):
    finite = [value for value in history if math.isfinite(value)]
    if len(finite) < window:
        return False
    return current > factor * float(np.mean(finite[-window:]))
""")
mistake("08.2", "the window taken before the NaN are filtered", says="for a 10x reading after a NaN entered the history, your function returned False", answer="""
def spike_alert(history, current, factor=3.0, window=5):
    if not math.isfinite(current):
        return True
    recent = [value for value in history[-window:] if math.isfinite(value)]
    if len(recent) < window:
        return False
    return current > factor * float(np.mean(recent))
""")
mistake("08.2", "drops NaN from the history it was given", says="changed the history list it was given", answer="""
def spike_alert(history, current, factor=3.0, window=5):
    if not math.isfinite(current):
        return True
    history[:] = [value for value in history if math.isfinite(value)]
    if len(history) < window:
        return False
    return current > factor * float(np.mean(history[-window:]))
""")

# 09.1 a pre-norm Transformer sublayer
mistake("09.1", "norm on the sublayer's output", says="the normalisation is applied to the sublayer's output", answer="""
def prenorm_sublayer(x, norm, sublayer):
    return x + norm(sublayer(x))
""")
mistake("09.1", "no skip path", says="there is no skip path", answer="""
def prenorm_sublayer(x, norm, sublayer):
    return sublayer(norm(x))
""")
mistake("09.1", "norm after the sum, as before, twice", says="the normalisation is applied twice", answer="""
def prenorm_sublayer(x, norm, sublayer):
    return norm(x + sublayer(norm(x)))
""")

# 09.2 the gradient survival rate
mistake("09.2", "ratio of sums instead of norms", says="for nn.ReLU(), the norm ratio is 0.560773, expected 0.763636", answer="""
def gradient_survival(stack, x, upstream):
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(stack(leaf), leaf, upstream)
    share = (grad != 0).float().mean().item()
    return share, (grad.abs().sum() / upstream.abs().sum()).item()
""")
mistake("09.2", "counts the zeros", says="the non-zero share is 0.0000, but 1.0000", answer="""
def gradient_survival(stack, x, upstream):
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(stack(leaf), leaf, upstream)
    share = (grad == 0).float().mean().item()
    return share, (grad.norm() / upstream.norm()).item()
""")
mistake("09.2", "backward from the sum, ignoring upstream", says="for nn.Identity(), the norm ratio is 0.936238, expected 1", answer="""
def gradient_survival(stack, x, upstream):
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(stack(leaf).sum(), leaf)
    share = (grad != 0).float().mean().item()
    return share, (grad.norm() / upstream.norm()).item()
""")

# 10.1 one fp16 step with a loss scaler
mistake("10.1", "no scaler.update()", says="the scaler had not finished its step", answer="""
def amp_step(model, optimizer, scaler, x, y):
    optimizer.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    return loss.item()
""")
mistake("10.1", "backward on the unscaled loss", says="times too little", answer="""
def amp_step(model, optimizer, scaler, x, y):
    optimizer.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.item()
""")
mistake("10.1", "unscale_ then optimizer.step()", says="an overflowing step must be skipped", answer="""
def amp_step(model, optimizer, scaler, x, y):
    optimizer.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    optimizer.step()
    scaler.update()
    return loss.item()
""")

# 10.2 a loss scale that cannot collapse
mistake("10.2", "lifts the scale before the update", says="the scale was left at 0.5 after a step, below the floor", answer="""
def step_and_update(scaler, optimizer, floor):
    if scaler.get_scale() < floor:
        scaler.update(float(floor))
    scaler.step(optimizer)
    scaler.update()
""")
mistake("10.2", "lifts the scale with update(max(...)) every step", says="the floor must only act below it", answer="""
def step_and_update(scaler, optimizer, floor):
    scaler.step(optimizer)
    scaler.update(max(scaler.get_scale(), float(floor)))
""")

# 11.1 compare gradients at the right tolerance
mistake("11.1", "allclose at float64's default tolerance", says="is a match, but grads_match returned False", answer="""
def grads_match(grads, reference):
    return all(torch.allclose(grads[name], reference[name].float()) for name in reference)
""")
mistake("11.1", "a relative tolerance alone", says="is a match, but grads_match returned False", answer="""
def grads_match(grads, reference):
    if grads.keys() != reference.keys():
        return False
    return all(grads[n].shape == reference[n].shape
               and torch.allclose(grads[n].double(), reference[n].double(), rtol=1e-4, atol=0) for n in reference)
""")
mistake("11.1", "returns a tensor", says="not True or False", answer="""
def grads_match(grads, reference):
    return torch.stack([torch.isclose(grads[n].double(), reference[n].double(), rtol=1e-4).all() for n in reference]).all()
""")

mistake("11.1", "a fixed absolute tolerance", says="with every gradient 1000x smaller is a mismatch, but grads_match returned True", answer="""
def grads_match(grads, reference):
    if grads.keys() != reference.keys():
        return False
    return all(grads[n].shape == reference[n].shape
               and torch.allclose(grads[n].double(), reference[n].double(), rtol=0, atol=1e-1) for n in reference)
""")

# 11.2 keep one layer of an nn.Sequential out of compilation
mistake("11.2", "compiles the excluded layer alone", says="torch.compile still captured the excluded layer 2", answer="""
def compile_around(model, index, compile):
    model[index] = compile(model[index])
    return model
""")
mistake("11.2", "drops the excluded layer", says="the returned module's output differs from the original model's", answer="""
def compile_around(model, index, compile):
    return nn.Sequential(compile(model[:index]), compile(model[index + 1:]))
""")

# 12.1 the gradient of a global batch
mistake("12.1", "one micro-batch per device, no accumulation", says="a forward took 8 rows", answer="""
def global_batch_gradient(model, x, y, devices, accumulation_steps):
    micro_rows = len(x) // devices
    for x_micro, y_micro in zip(x.split(micro_rows), y.split(micro_rows)):
        (F.cross_entropy(model(x_micro), y_micro) / devices).backward()
""")
mistake("12.1", "divides by devices only", says="the factor of its accumulation steps", answer="""
def global_batch_gradient(model, x, y, devices, accumulation_steps):
    micro_rows = len(x) // (devices * accumulation_steps)
    for x_micro, y_micro in zip(x.split(micro_rows), y.split(micro_rows)):
        (F.cross_entropy(model(x_micro), y_micro) / devices).backward()
""")

# 12.2 the batch size that reaches a noise target
mistake("12.2", "compares with the norm, not its square", says="that answers the target for the unsquared noise", answer="""
def batch_for_noise(per_sample_grads, ratio):
    n = len(per_sample_grads)
    full = per_sample_grads.mean(0)
    spread = (per_sample_grads - full).pow(2).sum(1).mean().item()
    for batch in range(1, n + 1):
        if spread * (n - batch) / (batch * (n - 1)) <= ratio * full.norm().item():
            return batch
""")
mistake("12.2", "the largest batch that misses, not the smallest that reaches", says="you answered 5, but B = 6 is the smallest batch", answer="""
def batch_for_noise(per_sample_grads, ratio):
    n = len(per_sample_grads)
    full = per_sample_grads.mean(0)
    spread = (per_sample_grads - full).pow(2).sum(1).mean().item()
    for batch in range(1, n + 1):
        if spread * (n - batch) / (batch * (n - 1)) <= ratio * full.pow(2).sum().item():
            return batch - 1
""")

# 13.1 a validation loss that frees its graphs
mistake("13.1", "mean over rows instead of batches", says="the mean over all rows, which weighs each batch", answer="""
def mean_validation_loss(model, batches):
    total, rows = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            total += F.cross_entropy(model(x), y, reduction="sum").item()
            rows += len(y)
    return total / rows
""")
mistake("13.1", "+= keeps a tensor", says="the autograd graph of batch 1 was still alive", answer="""
def mean_validation_loss(model, batches):
    total = 0.0
    for x, y in batches:
        total += F.cross_entropy(model(x), y)
    return total.item() / len(batches)
""")
mistake("13.1", "detaches only at the return", says="the autograd graph of batch 1 was still alive", answer="""
def mean_validation_loss(model, batches):
    losses = []
    for x, y in batches:
        losses.append(F.cross_entropy(model(x), y))
    return torch.stack(losses).detach().mean().item()
""")
# Saved-tensor hooks are per thread, so the check's own instrument sees none of these graphs: only the memory
# the kernel counted shows that every one of them was alive at the end (it passed before that count).
mistake("13.1", "batches in threads, tensors kept", says="the graphs of earlier batches were still alive", answer="""
from concurrent.futures import ThreadPoolExecutor

def mean_validation_loss(model, batches):
    with ThreadPoolExecutor(2) as pool:
        losses = list(pool.map(lambda batch: F.cross_entropy(model(batch[0]), batch[1]), batches))
    return (sum(losses) / len(batches)).item()
""")

# 13.2 count what autograd keeps, with its own hook
mistake("13.2", "counts the parameters too", says="your count includes the parameters (1,024 B)", answer="""
def activation_bytes(module, *inputs):
    kept = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs)
    return sum(kept.values())
""")
mistake("13.2", "dedupes by id(tensor)", says="your count includes the parameters (1,024 B)", answer="""
def activation_bytes(module, *inputs):
    left_out = {id(t) for t in [*module.parameters(), *module.buffers(), *inputs]}
    kept = {}

    def pack(tensor):
        if id(tensor) not in left_out:
            kept[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs)
    return sum(kept.values())
""")

# 14.1 a random stream per worker, for a dataset that owns a torch.Generator
mistake("14.1", "the same seed in every worker", says="drew the same numbers from dataset.generator", answer="""
def seed_dataset_generator(dataset, worker_seed):
    dataset.generator.manual_seed(0)
""")
mistake("14.1", "a new generator nobody reads", says="drew the same numbers from dataset.generator", answer="""
def seed_dataset_generator(dataset, worker_seed):
    generator = torch.Generator()
    generator.manual_seed(worker_seed)
""")

# 14.2 each item once, whatever the number of workers
mistake("14.2", "contiguous chunks that drop the remainder", says="no worker yielded items [9]", answer="""
def worker_items(start, end, worker_id, num_workers):
    per_worker = (end - start) // num_workers
    first = start + worker_id * per_worker
    return range(first, first + per_worker)
""")
mistake("14.2", "strides from 0, not from start", says="which are outside the range", answer="""
def worker_items(start, end, worker_id, num_workers):
    return range(worker_id, end, num_workers)
""")

# 15.1 average gradients the way DDP does
mistake("15.1", "sums without dividing", says="is the sum over the ranks, 3 times the average", answer="""
def average_gradients(model, all_reduce_sum, world_size):
    for parameter in model.parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        parameter.grad = all_reduce_sum(grad)
""")
mistake("15.1", "divides before reducing, twice", says="differs by 0.4 from the mean over the ranks", answer="""
def average_gradients(model, all_reduce_sum, world_size):
    for parameter in model.parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        parameter.grad = all_reduce_sum(grad / world_size) / world_size
""")

# 15.2 shard files per rank and per epoch, without a sampler
mistake("15.2", "contiguous blocks, no padding", says="the ones left over were dropped", answer="""
def rank_shards(num_shards, rank, world_size, epoch, seed):
    order = torch.randperm(num_shards, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    per_rank = num_shards // world_size
    return order[rank * per_rank:(rank + 1) * per_rank]
""")
mistake("15.2", "seeded from the global stream", says="the ranks did not slice one common order", answer="""
def rank_shards(num_shards, rank, world_size, epoch, seed):
    order = torch.randperm(num_shards).tolist()
    per_rank = -(-num_shards // world_size)
    order = (order * world_size)[:per_rank * world_size]
    return order[rank::world_size]
""")

# 16.1 checkpoint segments of blocks
mistake("16.1", "one checkpoint around everything", says="one checkpoint spans more than 2 blocks", answer="""
def checkpointed_forward(blocks, x, blocks_per_segment):
    def run_all(inputs):
        for block in blocks:
            inputs = block(inputs)
        return inputs
    return torch.utils.checkpoint.checkpoint(run_all, x, use_reentrant=False)
""")
mistake("16.1", "segments built but not checkpointed", says="the inside of each block is still saved", answer="""
def checkpointed_forward(blocks, x, blocks_per_segment):
    for start in range(0, len(blocks), blocks_per_segment):
        for block in blocks[start:start + blocks_per_segment]:
            x = block(x)
    return x
""")

# 16.2 checkpoint the blocks that keep the most
mistake("16.2", "the last blocks first", says="checkpointing the one that keeps the most (block 0) fits the budget too", answer="""
def blocks_to_checkpoint(blocks, x, budget, kept_bytes):
    excess = kept_bytes(blocks, x) - budget
    chosen = []
    for index in reversed(range(len(blocks))):
        if excess <= 0:
            break
        chosen.append(index)
        excess -= kept_bytes(blocks[index], x)
    return chosen
""")
mistake("16.2", "the lightest blocks first", says="you checkpoint", answer="""
def blocks_to_checkpoint(blocks, x, budget, kept_bytes):
    excess = kept_bytes(blocks, x) - budget
    frees, block_input = [], x
    with torch.no_grad():
        for block in blocks:
            frees.append(kept_bytes(block, block_input))
            block_input = block(block_input)
    chosen = []
    for index in sorted(range(len(blocks)), key=lambda i: frees[i]):
        if excess <= 0:
            break
        chosen.append(index)
        excess -= frees[index]
    return chosen
""")

# Third cases for the exercises above whose dodge (tests/exercise_variants.py) makes the third.
mistake("07.2", "tests for NaN only", says="with an infinite value in one gradient, your function changed the weights", answer="""
def guarded_step(model, optimizer, max_norm):
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if math.isnan(total.item()):
        return False
    optimizer.step()
    return True
""")
mistake("13.1", "no_grad, but returns a tensor", says="you returned a tensor: return the mean as a Python float", answer="""
def mean_validation_loss(model, batches):
    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            total += F.cross_entropy(model(x), y)
    return total / len(batches)
""")
mistake("15.1", "divides without reducing", says="is that rank's own gradient divided by world_size", answer="""
def average_gradients(model, all_reduce_sum, world_size):
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.div_(world_size)
""")
mistake("14.2", "each worker starts at its own block of num_workers", says="came more than once", answer="""
def worker_items(start, end, worker_id, num_workers):
    return range(start + worker_id * num_workers, end)
""")
mistake("04.2", "sums the unpacked outputs over the padding", says="include the outputs at the padding positions", answer="""
def mean_output(gru, padded, lengths):
    outputs, _ = gru(padded)
    return outputs.sum(1) / lengths[:, None].to(outputs.dtype)
""")
mistake("06.2", "decay on the 1-d parameters, none on the matrices", says="'embedding.weight' decays at 0, but its module's decay is 0.005", answer="""
def layerwise_param_groups(model, decay_by_module):
    groups = []
    for name, decay in decay_by_module.items():
        parameters = list(getattr(model, name).parameters())
        groups.append({"params": [p for p in parameters if p.ndim < 2], "weight_decay": decay})
        groups.append({"params": [p for p in parameters if p.ndim >= 2], "weight_decay": 0.0})
    return groups
""")
mistake("10.2", "chooses update(floor) or update() from the scale before the update", says="the scale was left at 0.5 after a step, below the floor", answer="""
def step_and_update(scaler, optimizer, floor):
    scaler.step(optimizer)
    if scaler.get_scale() < floor:
        scaler.update(float(floor))
    else:
        scaler.update()
""")
mistake("11.2", "the excluded layer also inside the second compiled part", says="torch.compile still captured the excluded layer 2", answer="""
def compile_around(model, index, compile):
    return nn.Sequential(compile(model[:index]), model[index], compile(model[index:]))
""")
mistake("12.1", "adds the micro-batch means without dividing", says="the gradient is 6× the batch gradient", answer="""
def global_batch_gradient(model, x, y, devices, accumulation_steps):
    micro_rows = len(x) // (devices * accumulation_steps)
    for x_micro, y_micro in zip(x.split(micro_rows), y.split(micro_rows)):
        F.cross_entropy(model(x_micro), y_micro).backward()
""")
mistake("12.2", "N where the correction has N - 1", says="gives (N - B) / (N - 1)", answer="""
def batch_for_noise(per_sample_grads, ratio):
    n = len(per_sample_grads)
    full = per_sample_grads.mean(0)
    spread = (per_sample_grads - full).pow(2).sum(1).mean().item()
    for batch in range(1, n + 1):
        if spread * (n - batch) / (batch * n) <= ratio * full.pow(2).sum().item():
            return batch
""")
mistake("13.2", "counts elements, not bytes", says="192 is a count of elements", answer="""
def activation_bytes(module, *inputs):
    left_out = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers(), *inputs]}
    kept = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in left_out:
            kept[tensor.untyped_storage().data_ptr()] = tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs)
    return sum(kept.values())
""")
mistake("14.1", "a fresh generator, never seeded", says="drew the same numbers from dataset.generator", answer="""
def seed_dataset_generator(dataset, worker_seed):
    dataset.generator = torch.Generator()
""")
mistake("16.1", "the reentrant checkpoint", says="the output does not require grad", answer="""
def checkpointed_forward(blocks, x, blocks_per_segment):
    def run_segment(segment_input, start):
        for block in blocks[start:start + blocks_per_segment]:
            segment_input = block(segment_input)
        return segment_input

    for start in range(0, len(blocks), blocks_per_segment):
        x = torch.utils.checkpoint.checkpoint(run_segment, x, start, use_reentrant=True)
    return x
""")
mistake("16.2", "heaviest first, but never stops", says="you checkpoint 4 blocks", answer="""
def blocks_to_checkpoint(blocks, x, budget, kept_bytes):
    frees, block_input = [], x
    with torch.no_grad():
        for block in blocks:
            frees.append(kept_bytes(block, block_input))
            block_input = block(block_input)
    return sorted(range(len(blocks)), key=lambda i: frees[i], reverse=True)
""")
mistake("15.2", "strided slices without padding", says="the ranks got [4, 3, 3] shards", answer="""
def rank_shards(num_shards, rank, world_size, epoch, seed):
    order = torch.randperm(num_shards, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return order[rank::world_size]
""")
