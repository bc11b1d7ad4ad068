"""Two more answers for every exercise, for tests/test_exercises.py's five ways.

``alternative``: a correct answer written differently from the notebook's solution; it must pass.
``dodge``: an answer that dodges the lesson (gets the check's numbers without the idea the exercise
teaches, or takes the tempting shortcut); it must fail, and ``dodge_says`` is a phrase its diagnosis
must contain. Each source is one exercise cell: it may use only `grading.EXERCISE_NAMESPACE`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variants:
    alternative: str
    dodge: str
    dodge_says: str


VARIANTS: dict[str, Variants] = {}


def variants(exercise_id: str, *, alternative: str, dodge: str, dodge_says: str) -> None:
    VARIANTS[exercise_id] = Variants(alternative.strip() + "\n", dodge.strip() + "\n", dodge_says)


variants(
    "00.1",
    alternative="""
def one_training_step(model, optimizer, x, y):
    for parameter in model.parameters():
        parameter.grad = None
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
""",
    # 02/B2's "zero_grad() after step()" order: right only when .grad starts empty, and here it does not.
    dodge="""
def one_training_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()
""",
    dodge_says="after step 1 the parameters moved as if .grad still held the gradients of earlier backward passes",
)

variants(
    "00.2",
    alternative="""
def grad_of_each_call(w, inputs):
    grads = []
    for x in inputs:
        w.grad = None
        torch.tanh(w * x).sum().backward()
        grads.append(w.grad.clone())
    w.grad = None
    return grads
""",
    # The closed form of the linear loss the exercise used to have: no autograd at all.
    dodge="""
def grad_of_each_call(w, inputs):
    return [x.clone() for x in inputs]
""",
    dodge_says="is inputs[0] itself, the gradient of the linear (w * x).sum()",
)

variants(
    "01.1",
    alternative="""
def entropy_term(p):
    safe = p.masked_fill(p == 0, 1.0)
    return p * torch.log(safe)
""",
    # Patch the NaN after the fact: the values come out right, the gradient stays NaN.
    dodge="""
def entropy_term(p):
    return (p * torch.log(p)).nan_to_num(0.0)
""",
    dodge_says="the gradient is not finite",
)

variants(
    "01.2",
    alternative="""
def unreachable_parameters(output, model):
    reached, seen = set(), set()

    def visit(node):
        if node is None or node in seen:
            return
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        for child, _ in node.next_functions:
            visit(child)

    visit(output.grad_fn)
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in reached]
""",
    # Ask autograd instead of walking the graph: it runs backward, which the exercise forbids.
    dodge="""
def unreachable_parameters(output, model):
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(output, [p for _, p in named], allow_unused=True, retain_graph=True)
    return [name for (name, _), grad in zip(named, grads) if grad is None]
""",
    dodge_says="your function ran backward",
)

variants(
    "01.3",
    alternative="""
def editable_copy(t):
    copy = torch.empty_like(t, requires_grad=False)
    with torch.no_grad():
        copy.copy_(t)
    return copy
""",
    dodge="""
def editable_copy(t):
    return t.clone()
""",
    dodge_says="the copy is still part of the autograd graph",
)

variants(
    "02.1",
    alternative="""
def clipped_step(model, optimizer, loss, max_norm):
    model.zero_grad(set_to_none=True)
    loss.backward()
    norm = nn.utils.clip_grad_norm_(list(model.parameters()), max_norm=max_norm)
    optimizer.step()
    return norm.item()
""",
    # Clip after the step: the reported norm is right, but the step used the unclipped gradient.
    dodge="""
def clipped_step(model, optimizer, loss, max_norm):
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
""",
    dodge_says="step 1 moved the weights by the unclipped gradient",
)

variants(
    "02.2",
    alternative="""
def accumulate_gradients(model, x, y, micro_batch):
    for start in range(0, len(x), micro_batch):
        x_piece, y_piece = x[start:start + micro_batch], y[start:start + micro_batch]
        labelled_here, labelled = (y_piece != -100).sum(), (y != -100).sum()
        (F.cross_entropy(model(x_piece), y_piece) * labelled_here / labelled).backward()
""",
    # The full batch in one forward: right gradient, but it ignores the memory limit the lesson is about.
    dodge="""
def accumulate_gradients(model, x, y, micro_batch):
    F.cross_entropy(model(x), y).backward()
""",
    dodge_says="your function ran the model on 30 rows at once",
)

variants(
    "03.1",
    alternative="""
def layer_norm_rows(x, eps=1e-5):
    mean = x.mean(dim=-1, keepdim=True)
    variance = x.var(dim=-1, unbiased=False, keepdim=True)
    return (x - mean) * torch.rsqrt(variance + eps)
""",
    dodge="""
def layer_norm_rows(x, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), eps=eps)
""",
    dodge_says="your function calls torch's own layer_norm",
)

variants(
    "03.2",
    alternative="""
def distance_backward(grad_output, a, b):
    direction = F.normalize(a - b, dim=1, eps=0.0)
    grad_a = direction * grad_output.unsqueeze(1)
    return grad_a, grad_a.neg()
""",
    # Let autograd differentiate inside the backward instead of deriving it.
    dodge="""
def distance_backward(grad_output, a, b):
    with torch.enable_grad():
        a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
        distance = (a_ - b_).norm(dim=1)
        return torch.autograd.grad(distance, (a_, b_), grad_output)
""",
    dodge_says="your backward builds an autograd graph of its own",
)

variants(
    "05.2",
    alternative="""
def recalibrate_batchnorm(model, x, batch_size):
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    batches = [x[i:i + batch_size] for i in range(0, len(x), batch_size)]
    saved = {}
    for layer in norms:
        saved[layer] = layer.momentum
        layer.reset_running_stats()
    model.eval()
    for layer in norms:
        layer.train()
    with torch.no_grad():
        for count, batch in enumerate(batches, start=1):
            for layer in norms:
                layer.momentum = 1.0 / count  # a running plain mean: the same as momentum=None
            model(batch)
    for layer in norms:
        layer.momentum = saved[layer]
    model.eval()
""",
    # The tempting shortcut: a momentum of 1.0 keeps only the last batch's statistics.
    dodge="""
def recalibrate_batchnorm(model, x, batch_size):
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    momenta = [layer.momentum for layer in norms]
    model.eval()
    for layer in norms:
        layer.momentum = 1.0
        layer.train()
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            model(x[start:start + batch_size])
    for layer, momentum in zip(norms, momenta):
        layer.momentum = momentum
    model.eval()
""",
    dodge_says="an exponential average over a few batches still remembers the old statistics",
)

variants(
    "06.1",
    alternative="""
def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-step_size)
""",
    # The moments rebound to new tensors, not updated in place: the optimizer's buffers never change.
    dodge="""
def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    m_hat = exp_avg / (1 - beta1 ** step)
    v_hat = exp_avg_sq / (1 - beta2 ** step)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))
""",
    dodge_says="the exp_avg tensor you were given still holds its old values",
)

variants(
    "06.2",
    alternative="""
def layerwise_param_groups(model, decay_by_module):
    groups = []
    for name, decay in decay_by_module.items():
        matrices, vectors = [], []
        for parameter in getattr(model, name).parameters():
            (vectors if parameter.dim() == 1 else matrices).append(parameter)
        groups += [{"params": matrices, "weight_decay": decay}, {"params": vectors, "weight_decay": 0.0}]
    return groups
""",
    # Sorting by name ("weight" gets decay): a LayerNorm's weight is a 1-d scale, not a matrix.
    dodge="""
def layerwise_param_groups(model, decay_by_module):
    groups = []
    for name, decay in decay_by_module.items():
        named = list(getattr(model, name).named_parameters())
        groups.append({"params": [p for n, p in named if "weight" in n], "weight_decay": decay})
        groups.append({"params": [p for n, p in named if "weight" not in n], "weight_decay": 0.0})
    return groups
""",
    dodge_says="(1-d) decays at 0.01: biases and normalisation parameters should get weight_decay 0.0",
)

variants(
    "07.1",
    alternative="""
def clip_total_norm_(grads, max_norm):
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total.item()
""",
    # Share the budget out evenly: each tensor clipped to max_norm / sqrt(k) keeps the joint norm under
    # max_norm, but scales each tensor by its own factor, turning the gradient.
    dodge="""
def clip_total_norm_(grads, max_norm):
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    share = max_norm / math.sqrt(len(grads))
    for g in grads:
        norm = g.norm()
        if norm > share:
            g.mul_(share / (norm + 1e-6))
    return total
""",
    dodge_says="each tensor was scaled by its own factor",
)

variants(
    "07.2",
    alternative="""
def guarded_step(model, optimizer, max_norm):
    total = float(nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if math.isnan(total) or math.isinf(total):
        return False
    optimizer.step()
    return True
""",
    # Test for the one value that overflow produces, and let NaN through.
    dodge="""
def guarded_step(model, optimizer, max_norm):
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if torch.isinf(total):
        return False
    optimizer.step()
    return True
""",
    dodge_says="with a NaN value in one gradient, your function changed the weights",
)

variants(
    "08.1",
    alternative="""
def record_grad_norms(model):
    norms = {}

    def make_hook(name):
        def hook(parameter):
            norms[name] = float(torch.linalg.vector_norm(parameter.grad))
        return hook

    handles = [p.register_post_accumulate_grad_hook(make_hook(n)) for n, p in model.named_parameters()]
    return norms, handles
""",
    # Read .grad from a tensor hook: it runs before this pass is added, so it sees the previous total.
    dodge="""
def record_grad_norms(model):
    norms, handles = {}, []
    for name, param in model.named_parameters():
        def store(grad, name=name, param=param):
            norms[name] = param.grad.norm().item() if param.grad is not None else 0.0
        handles.append(param.register_hook(store))
    return norms, handles
""",
    dodge_says="the hook ran before accumulation",
)

variants(
    "08.2",
    alternative="""
def spike_alert(history, current, factor=3.0, window=5):
    if current != current or current in (math.inf, -math.inf):
        return True
    finite = np.asarray([value for value in history if np.isfinite(value)], dtype=float)
    return len(finite) >= window and bool(current > factor * finite[-window:].mean())
""",
    # NaN handled for the current reading, but the history's NaN still poisons the baseline.
    dodge="""
def spike_alert(history, current, factor=3.0, window=5):
    if not math.isfinite(current):
        return True
    if len(history) < window:
        return False
    return current > factor * np.mean(history[-window:])
""",
    dodge_says="for a 10x reading after a NaN entered the history",
)

variants(
    "09.2",
    alternative="""
def gradient_survival(stack, x, upstream):
    x = x.detach().clone().requires_grad_(True)
    stack(x).backward(upstream)
    grad = x.grad
    return torch.count_nonzero(grad).item() / grad.numel(), float(torch.linalg.vector_norm(grad) / upstream.norm())
""",
    # Count by magnitude above a threshold: small but real entries are counted as lost.
    dodge="""
def gradient_survival(stack, x, upstream):
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(stack(leaf), leaf, upstream)
    share = (grad.abs() > 1e-3).float().mean().item()
    return share, (grad.norm() / upstream.norm()).item()
""",
    dodge_says="for nn.Identity() with an upstream gradient of size 1e-8, the non-zero share is 0.0000",
)

variants(
    "10.1",
    alternative="""
def amp_step(model, optimizer, scaler, x, y):
    for parameter in model.parameters():
        parameter.grad = None
    with torch.autocast(device_type=x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return float(loss.detach())
""",
    # Unscale by hand and step: right on clean steps, but an overflowing step is not skipped.
    dodge="""
def amp_step(model, optimizer, scaler, x, y):
    optimizer.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    for parameter in model.parameters():
        parameter.grad.div_(scaler.get_scale())
    optimizer.step()
    return loss.item()
""",
    dodge_says="an overflowing step must be skipped",
)

variants(
    "10.2",
    alternative="""
def step_and_update(scaler, optimizer, floor):
    scaler.step(optimizer)
    scaler.update()
    scale = scaler.get_scale()
    scaler.update(max(float(scale), float(floor)))
""",
    # Never let the scaler back off: a fixed scale cannot collapse, but overflowing steps never recover.
    dodge="""
def step_and_update(scaler, optimizer, floor):
    scaler.step(optimizer)
    scaler.update(float(max(floor, 2.0 ** 16)))
""",
    dodge_says="the floor must only act below it",
)

variants(
    "11.1",
    alternative="""
def grads_match(grads, reference):
    if set(grads) != set(reference):
        return False
    for name, expected in reference.items():
        got = grads[name]
        if got.shape != expected.shape or not torch.isfinite(got).all():
            return False
        tolerance = 1e-4 * expected.double().abs().max() + 1e-30
        if (got.double() - expected.double()).abs().max() > tolerance:
            return False
    return True
""",
    # torch.allclose's default tolerances: rtol 1e-5 alone fails the rounding near zero-crossing entries.
    dodge="""
def grads_match(grads, reference):
    return all(torch.allclose(grads[name].double(), reference[name].double()) for name in reference)
""",
    dodge_says="is a match, but grads_match returned False",
)

variants(
    "12.1",
    alternative="""
def global_batch_gradient(model, x, y, devices, accumulation_steps):
    pieces = devices * accumulation_steps
    rows = len(x) // pieces
    for index in range(pieces):
        x_micro, y_micro = x[index * rows:(index + 1) * rows], y[index * rows:(index + 1) * rows]
        (F.cross_entropy(model(x_micro), y_micro, reduction="sum") / (rows * pieces)).backward()
""",
    # One forward over the whole global batch: right numbers, but no micro-batches at all.
    dodge="""
def global_batch_gradient(model, x, y, devices, accumulation_steps):
    F.cross_entropy(model(x), y).backward()
""",
    dodge_says="a forward took 24 rows",
)

variants(
    "13.1",
    alternative="""
def mean_validation_loss(model, batches):
    total = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        total += F.cross_entropy(model(x), y).detach()
    return total.item() / len(batches)
""",
    # Keep the loss tensors and average at the end: every graph lives until the function returns.
    dodge="""
def mean_validation_loss(model, batches):
    losses = [F.cross_entropy(model(x), y) for x, y in batches]
    return torch.stack(losses).mean().item()
""",
    dodge_says="the autograd graph of batch 1 was still alive",
)

variants(
    "13.2",
    alternative="""
def activation_bytes(module, *inputs):
    state = [*module.parameters(), *module.buffers(), *inputs]
    held = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if not any(storage.data_ptr() == other.untyped_storage().data_ptr() for other in state + held):
            held.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs)
    return int(sum(t.untyped_storage().nbytes() for t in held))
""",
    # The rule of thumb instead of the hook: activation memory as the sum of every layer's output.
    dodge="""
def activation_bytes(module, *inputs):
    total = 0

    def add(layer, args, output):
        nonlocal total
        total += output.numel() * output.element_size()

    handles = [m.register_forward_hook(add) for m in module.modules() if not list(m.children())]
    module(*inputs)
    for handle in handles:
        handle.remove()
    return total
""",
    dodge_says="you counted what every layer outputs",
)

variants(
    "14.2",
    alternative="""
def worker_items(start, end, worker_id, num_workers):
    per_worker = math.ceil((end - start) / num_workers)
    first = start + worker_id * per_worker
    return list(range(first, min(first + per_worker, end)))
""",
    # Shard by a fixed count that assumes two workers.
    dodge="""
def worker_items(start, end, worker_id, num_workers):
    return range(start + worker_id, end, 2)
""",
    dodge_says="came more than once",
)

variants(
    "15.1",
    alternative="""
def average_gradients(model, all_reduce_sum, world_size):
    for parameter in model.parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        parameter.grad = all_reduce_sum(parameter.grad).div(world_size)
""",
    # Reduce only what this rank has, in a fixed order: the ranks' calls no longer pair up.
    dodge="""
def average_gradients(model, all_reduce_sum, world_size):
    grads = [p for p in model.parameters() if p.grad is not None]
    for parameter in grads:
        parameter.grad = all_reduce_sum(parameter.grad) / world_size
""",
    dodge_says="the ranks' all_reduce_sum calls did not pair up",
)

variants(
    "05.1",
    alternative="""
def set_finetune_mode(model, pretrained):
    model.train()
    for module in model.get_submodule(pretrained).modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
            module.requires_grad_(False)
""",
    # The notebook's remedy copied as it is: it freezes the head's new BatchNorm too.
    dodge="""
def set_finetune_mode(model, pretrained):
    model.train()
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            module.eval()
            module.weight.requires_grad_(False)
            module.bias.requires_grad_(False)
""",
    dodge_says="belongs to the new head, not to 'backbone', yet you froze it",
)

variants(
    "14.1",
    alternative="""
def seed_dataset_generator(dataset, worker_seed):
    generator = torch.Generator()
    generator.manual_seed(worker_seed)
    dataset.generator = generator
""",
    # Fresh OS entropy: the workers differ, but no run can be repeated.
    dodge="""
def seed_dataset_generator(dataset, worker_seed):
    dataset.generator.seed()
""",
    dodge_says="so a run cannot be reproduced",
)

variants(
    "09.1",
    alternative="""
def prenorm_sublayer(x, norm, sublayer):
    branch = sublayer(norm(x))
    return torch.add(x, branch)
""",
    # Normalise everything that enters the block: the skip path then carries norm(x), not x.
    dodge="""
def prenorm_sublayer(x, norm, sublayer):
    normalised = norm(x)
    return normalised + sublayer(normalised)
""",
    dodge_says="the skip path carries norm(x), not x",
)

variants(
    "16.1",
    alternative="""
def checkpointed_forward(blocks, x, blocks_per_segment):
    for start in range(0, len(blocks), blocks_per_segment):
        segment = nn.Sequential(*blocks[start:start + blocks_per_segment])
        x = torch.utils.checkpoint.checkpoint(segment, x, use_reentrant=False)
    return x
""",
    # The notebook's K4 fix copied as it is: every block checkpointed on its own.
    dodge="""
def checkpointed_forward(blocks, x, blocks_per_segment):
    for block in blocks:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return x
""",
    dodge_says="one input per block, but only the 3 segment inputs",
)

variants(
    "16.2",
    alternative="""
def blocks_to_checkpoint(blocks, x, budget, kept_bytes):
    plain = kept_bytes(blocks, x)
    # every block maps width to width, and the bytes kept do not depend on the values
    frees = {index: kept_bytes(block, x) for index, block in enumerate(blocks)}
    chosen = []
    while plain - sum(frees[i] for i in chosen) > budget:
        chosen.append(max((i for i in frees if i not in chosen), key=frees.get))
    return sorted(chosen)
""",
    # The notebook's K4 fix copied as it is: every block checkpointed, whatever the budget.
    dodge="""
def blocks_to_checkpoint(blocks, x, budget, kept_bytes):
    return list(range(len(blocks)))
""",
    dodge_says="the one that keeps the most (block 0) fits the budget too",
)

variants(
    "15.2",
    alternative="""
def rank_shards(num_shards, rank, world_size, epoch, seed):
    generator = torch.Generator()
    generator.manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_shards, generator=generator)
    per_rank = math.ceil(num_shards / world_size)
    padded = order.repeat(world_size)[:per_rank * world_size]
    return padded.view(per_rank, world_size)[:, rank].tolist()
""",
    # One common order, but seeded from `seed` alone: the set_epoch lesson, forgotten.
    dodge="""
def rank_shards(num_shards, rank, world_size, epoch, seed):
    order = torch.randperm(num_shards, generator=torch.Generator().manual_seed(seed)).tolist()
    per_rank = math.ceil(num_shards / world_size)
    order = (order * world_size)[:per_rank * world_size]
    return order[rank::world_size]
""",
    dodge_says="rank 0 got the same shards in the same order in epochs 0 and 1",
)

variants(
    "12.2",
    alternative="""
def batch_for_noise(per_sample_grads, ratio):
    n = per_sample_grads.shape[0]
    centred = per_sample_grads - per_sample_grads.mean(dim=0, keepdim=True)
    spread = float((centred * centred).sum() / n)
    target = ratio * float(per_sample_grads.mean(dim=0).square().sum())
    # E||g_B - g||^2 <= target  <=>  B >= spread * n / (target * (n - 1) + spread)
    return max(1, math.ceil(spread * n / (target * (n - 1) + spread) - 1e-12))
""",
    # Mixing up squared and unsquared noise: ||g_B - g|| <= ratio * ||g|| is a target of ratio**2.
    dodge="""
def batch_for_noise(per_sample_grads, ratio):
    n = len(per_sample_grads)
    full = per_sample_grads.mean(0)
    spread = (per_sample_grads - full).pow(2).sum(1).mean().item()
    for batch in range(1, n + 1):
        if math.sqrt(spread * (n - batch) / (batch * (n - 1))) <= ratio * full.norm().item():
            return batch
""",
    dodge_says="that answers the target for the unsquared noise",
)

variants(
    "04.1",
    alternative="""
def sample_latent(mu, log_var):
    return torch.distributions.Normal(mu, (log_var / 2).exp()).rsample()
""",
    # Reparameterise the mean only: the encoder learns where to put z, never how spread it is.
    dodge="""
def sample_latent(mu, log_var):
    std = torch.exp(0.5 * log_var).detach()
    return mu + std * torch.randn_like(mu)
""",
    dodge_says="log_var gets no gradient",
)

variants(
    "04.2",
    alternative="""
def mean_output(gru, padded, lengths):
    means = []
    for row, length in enumerate(lengths.tolist()):
        outputs, _ = gru(padded[row:row + 1, :length])
        means.append(outputs[0].mean(0))
    return torch.stack(means)
""",
    # Packing copied from case N4, but the mean taken over the padded length.
    dodge="""
def mean_output(gru, padded, lengths):
    packed = nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
    outputs, _ = nn.utils.rnn.pad_packed_sequence(gru(packed)[0], batch_first=True)
    return outputs.mean(1)
""",
    dodge_says="are divided by the padded length 5",
)

variants(
    "11.2",
    alternative="""
def compile_around(model, index, compile):
    return nn.Sequential(*[layer if position == index else compile(layer) for position, layer in enumerate(model)])
""",
    # The article's flag, which torch never reads: the whole container is compiled, the layer too.
    dodge="""
def compile_around(model, index, compile):
    model[index]._compiled = False
    return compile(model)
""",
    dodge_says="torch.compile still captured the excluded layer 2",
)
