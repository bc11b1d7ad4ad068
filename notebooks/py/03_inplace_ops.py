# %% [markdown]
# # 03 · In-place operations: when autograd raises, and when it cannot
#
# An [in-place op](GLOSSARY.md#in-place-operation) (`relu_`, `div_`, `fill_diagonal_`, ...) writes into the memory of an existing
# tensor. Autograd guards every tensor it saved for backward with a *[version counter](GLOSSARY.md#version-counter)*, so most
# mistakes end in a loud `RuntimeError`, not in wrong gradients. This notebook measures where that
# guard fires, the one common way around it, and what really caused the NaN, the collapse and the
# BatchNorm trouble that the articles blame on in-place ops.
#
# **You will learn**
# - how autograd's version counter guards the tensors it saved, and why `relu_` after `tanh` raises
#   while after a Linear it does not
# - the one common way around the guard (`.data`) and the silent wrong gradient it gives
# - what really caused a LayerNorm NaN, a failed embedding training and BatchNorm trouble that articles
#   blame on in-place ops
# - how far `gradcheck` can be trusted in float32
#
# **Prerequisites:**
# [01 · The computation graph: what autograd records, and what it does not](01_computation_graph.ipynb).
# You should know: Python functions and classes; PyTorch tensors, `nn.Module` and a training loop
# (`loss.backward()`, `optimizer.step()`); `torch.autograd.Function` helps for C4.
#
# **Time:** about 55 min to read and run, plus about 20 min for the 2 exercises. Run All takes about
# 28 s on 2 CPU cores.
#
# **Words** this notebook uses, explained in the [glossary](GLOSSARY.md):
# [in-place operation](GLOSSARY.md#in-place-operation),
# [version counter](GLOSSARY.md#version-counter), [saved tensor](GLOSSARY.md#saved-tensor),
# [running statistics](GLOSSARY.md#running-statistics).
#
# **Predict before you run:** one cell below asks for your guess before a key measurement.

# %%
import sys, importlib.util as iu; "google.colab" in sys.modules and not iu.find_spec("labkit") and get_ipython().system("pip install 'gradient-lab-workbook[colab] @ git+https://github.com/gradient-lab/gradient-lab'"); import labkit.start  # no labkit here? README, Install

import math
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from labkit import GradTracer, autograd_graph, claims, compare_grads, datasets, grading, repro
from labkit.progress import track

# %% [markdown]
# ## Parameters
# `bug=True` runs the two training reproductions with their fault: a LayerNorm without `eps` (case
# C2; the article gives no formula, so the missing `eps` is our candidate for its NaN) and a triplet
# loss that zeroes the diagonal of `torch.cdist` in place (case C3, as the article wrote it).
# `bug=False` runs both without the fault. `slight_error` is how far off (relative) the third
# backward of case C4 is.

# %% tags=["parameters"]
seed: int = 0  # seed of every random stream, from 0 to 2147483647
device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N" or "mps"
batch: int = 64  # digits per random batch (batch-all triplets grow as its cube), from 1 to 256
norm_width: int = 5  # ReLU units in front of the LayerNorm, from 1 to 4096
norm_steps: int = 80  # training steps of the LayerNorm model, from 1 to 100000
triplet_steps: int = 150  # training steps of each triplet-loss embedding, from 1 to 100000
triplet_lr: float = 0.05  # SGD learning rate of the embeddings, above 0, at most 10
margin: float = 0.2  # triplet-loss margin, from 0 to 100
slight_error: float = 0.001  # how far off (relative) the third backward is for gradcheck, above 0, at most 1
bug: bool = True  # True runs the planted bug, False the fix

# %%
repro.check_parameters(globals())
dev = repro.setup(seed=seed, device=device)
# float64 keeps gradient comparisons exact and makes the stored outputs the same on CPU and GPU.
DTYPE = torch.float64
digits = datasets.digits(seed=seed).to(dev)
x_train, y_train = digits.x_train.to(DTYPE), digits.y_train
x_test, y_test = digits.x_test.to(DTYPE), digits.y_test


def error_summary(error):
    """The exception's type and first clause: the part of torch's message that names no device."""
    return f"{type(error).__name__}: {str(error).split(':')[0].strip()}"


def agreement(report, bound=1e-12):
    """A compare_grads report between two implementations, in words that hold on every device."""
    worst = max(row.max_abs_diff for row in report.rows)
    return f"allclose (rtol={report.rtol:g}): {report.all_close}; max |diff| below {bound:g}: {worst < bound}"


def sample_batch(generator):
    """A seeded random batch of digits; the generator lives on the CPU so every device draws the same."""
    index = torch.randint(0, len(y_train), (batch,), generator=generator).to(dev)
    return x_train[index], y_train[index]


# %% [markdown]
# ## Case C1: does `x = x.relu_()` corrupt gradients through memory reuse?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("C1").claim)

# %% [markdown]
# The memory really is reused: `relu_` returns the very tensor it was called on. What protects the
# gradient is the version counter: every in-place write bumps it, every tensor saved for backward
# remembers the version it was saved at, and backward refuses a [saved tensor](GLOSSARY.md#saved-tensor) whose version moved.

# %%
h = torch.randn(3, dtype=DTYPE).to(dev)
version_before = h._version
print(f"relu_ returns the same tensor: {h.relu_() is h}; version counter {version_before} -> {h._version}")


# %% [markdown]
# **Reproduce.** Eight ways to rectify a tensor in place inside a small two-layer forward pass, each
# run against the same computation written out of place. `compare_grads` decides "same gradients"
# (bit-exact in float64) or "wrong"; a `RuntimeError` is recorded as "raises".
#
# The last four first let `z * z` save `z` for its backward, then rectify `z`: once with `relu_`,
# once under [`torch.no_grad()`](GLOSSARY.md#no_grad-and-inference_mode), once through `.detach()` and once through `.data`.

# %%
def after_linear(x, w1, w2, in_place):
    h = x @ w1
    h = h.relu_() if in_place else torch.relu(h)
    return (h @ w2).pow(2).sum()


def after_batch_norm(x, w1, w2, in_place):
    h = F.batch_norm(x @ w1, None, None, training=True)  # saves its input, not its output
    h = h.relu_() if in_place else torch.relu(h)
    return (h @ w2).pow(2).sum()


def after_tanh(x, w1, w2, in_place):
    h = torch.tanh(x @ w1)  # tanh's backward needs its own output
    h = h.relu_() if in_place else torch.relu(h)
    return (h @ w2).pow(2).sum()


def on_a_leaf(x, w1, w2, in_place):
    w = w1.relu_() if in_place else torch.relu(w1)
    return ((x @ w) @ w2).pow(2).sum()


def saved_then_rectified(how):
    """z * z saves z; then z is rectified in place `how`, or out of place when how is None."""
    def forward(x, w1, w2, in_place):
        z = x @ w1
        squared = z * z
        if not in_place:
            rectified = torch.relu(z)
        elif how == "relu_":
            rectified = z.relu_()
        elif how == "no_grad":
            with torch.no_grad():
                rectified = z.relu_()
        elif how == "detach":
            rectified = z.detach().relu_()
        else:  # ".data": the one handle on z's memory that shares no version counter with z
            rectified = z.data.relu_()
        return squared.sum() + (rectified @ w2).pow(2).sum()
    return forward


PATTERNS = {
    "relu_ after a Linear": after_linear,
    "relu_ after batch_norm": after_batch_norm,
    "relu_ after tanh": after_tanh,
    "relu_ on a leaf parameter": on_a_leaf,
    "relu_ on a tensor z*z saved": saved_then_rectified("relu_"),
    "relu_ under no_grad, z saved": saved_then_rectified("no_grad"),
    "relu_ via .detach(), z saved": saved_then_rectified("detach"),
    "relu_ via .data, z saved": saved_then_rectified(".data"),
}


def fresh_inputs():
    generator = torch.Generator().manual_seed(seed)
    shapes = ((16, 6), (6, 5), (5, 3))
    x, w1, w2 = (torch.randn(s, generator=generator, dtype=DTYPE).to(dev) for s in shapes)
    return x, w1.requires_grad_(), w2.requires_grad_()


def run_pattern(forward):
    """('same' | 'wrong' | 'raises', detail) for one in-place forward against its out-of-place twin."""
    x, w1, w2 = fresh_inputs()
    reference = torch.autograd.grad(forward(x, w1, w2, in_place=False), (w1, w2))
    x, w1, w2 = fresh_inputs()
    try:
        grads = torch.autograd.grad(forward(x, w1, w2, in_place=True), (w1, w2))
    except RuntimeError as error:
        return "raises", error_summary(error)
    report = compare_grads({"w1": grads[0], "w2": grads[1]}, {"w1": reference[0], "w2": reference[1]})
    worst = max(row.max_abs_diff for row in report.rows)
    return ("same", "bit-identical gradients") if report.all_exact else ("wrong", f"max |grad diff| {worst:.3g}")


outcomes = {name: run_pattern(forward) for name, forward in PATTERNS.items()}
for name, (kind, detail) in outcomes.items():
    print(f"{name:<30} {kind:<7} {detail}")

# %% [markdown]
# **Measure.** Why does `relu_` after `tanh` raise while `relu_` after a Linear does not? The
# [autograd graph](GLOSSARY.md#autograd-graph) says which tensors each backward node saved (`labkit.autograd_graph`):

# %%
x, w1, w2 = fresh_inputs()
for label, hidden in (("Linear", x @ w1), ("tanh", torch.tanh(x @ w1))):
    graph = autograd_graph(hidden, {"w1": w1})
    saved = [f"{node.name} saves {[s.name for s in node.saved]}" for node in graph.nodes if not node.leaf]
    print(f"after {label}: " + "; ".join(saved))

# %% [markdown]
# A matrix product saves its *inputs*, so rewriting its output is harmless; `tanh` saves its
# *output*, so rewriting that output bumps a saved tensor's version and backward refuses it.
#
# **[Verdict](GLOSSARY.md#verdict).** Only the edit through `.data` went unnoticed: `.data` hands out the same memory
# without the version counter, so the guard never sees the write.

# %%
relu_patterns = [name for name in PATTERNS if ".data" not in name]
kinds = [outcomes[name][0] for name in relu_patterns]
data_detail = outcomes["relu_ via .data, z saved"][1]
claims.check("C1", verdict="holds" if "wrong" in kinds else "does-not-hold", measured={
    "in-place relu_": {kind: kinds.count(kind) for kind in ("same", "raises", "wrong")}, "relu_ via .data": data_detail})

# %% [markdown]
# **The fix, proven.** Rectify out of place where a backward saved the tensor, and never write
# through `.data` (to change a parameter by hand, use `with torch.no_grad(): p.copy_(...)`, which the
# version counter sees). If a mutation of a saved tensor is really wanted,
# `torch.autograd.graph.allow_mutation_on_saved_tensors()` makes autograd keep a copy:

# %%
x, w1, w2 = fresh_inputs()
reference = torch.autograd.grad(saved_then_rectified("relu_")(x, w1, w2, in_place=False), (w1, w2))
with torch.autograd.graph.allow_mutation_on_saved_tensors():
    x, w1, w2 = fresh_inputs()
    mutated = torch.autograd.grad(saved_then_rectified("relu_")(x, w1, w2, in_place=True), (w1, w2))
print(compare_grads({"w1": mutated[0], "w2": mutated[1]}, {"w1": reference[0], "w2": reference[1]}))

# %% [markdown]
# ## Case C2: did an in-place `div_` make a LayerNorm go NaN?

# %%
print(claims.case("C2").claim)


# %% [markdown]
# **Reproduce.** The LayerNorm written three ways: with `div_` on the centred tensor that the
# variance was computed from (the way the article's code reads), with `div_` on a centred tensor
# nothing saved, and with the out-of-place `div`. Each is compared with `F.layer_norm`.

# %%
def layer_norm_div_on_saved(x, eps):
    centred = x - x.mean(-1, keepdim=True)
    std = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()  # pow saves `centred`
    return centred.div_(std)


def layer_norm(x, eps, in_place):
    std = (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    centred = x - x.mean(-1, keepdim=True)  # only div touches this tensor
    return centred.div_(std) if in_place else centred.div(std)


def norm_grad(norm, x, upstream):
    x = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad((norm(x) * upstream).sum(), x)
    return grad


generator = torch.Generator().manual_seed(seed)
rows = torch.randn(6, 8, generator=generator, dtype=DTYPE).to(dev)
upstream = torch.randn(6, 8, generator=generator, dtype=DTYPE).to(dev)
eps = 1e-5
reference = norm_grad(lambda t: F.layer_norm(t, (8,), eps=eps), rows, upstream)
try:
    norm_grad(lambda t: layer_norm_div_on_saved(t, eps), rows, upstream)
    saved_outcome = "backward ran"
except RuntimeError as error:
    saved_outcome = error_summary(error)
in_place_grad = norm_grad(lambda t: layer_norm(t, eps, in_place=True), rows, upstream)
out_of_place_grad = norm_grad(lambda t: layer_norm(t, eps, in_place=False), rows, upstream)
print("div_ on the saved tensor:", saved_outcome)
print("div_ vs div:\n" + str(compare_grads({"x": in_place_grad}, {"x": out_of_place_grad})))
print("div_ vs F.layer_norm:", agreement(compare_grads({"x": in_place_grad}, {"x": reference}, rtol=1e-10)))
gradcheck_passes = torch.autograd.gradcheck(
    lambda t: layer_norm(t, eps, in_place=True), (rows.clone().requires_grad_(),), raise_exception=False
)
print("gradcheck of the div_ version in float64:", gradcheck_passes)


# %% [markdown]
# So `div_` either raises at the very first backward, or computes exactly what `div` computes.
# Neither can turn into NaN after a thousand quiet steps. Where can a NaN come from? From the
# division itself: a row whose values are all equal has variance 0, and without `eps` the
# forward divides 0 by 0.
#
# **Measure.** A small digits classifier with the LayerNorm between a narrow ReLU layer and the
# head, trained with `div_` and with `div`. With `bug=True` the LayerNorm has no `eps`: the
# article gives no formula, so this is our candidate for the NaN it reports. When all `norm_width` ReLU units of a sample are off, that sample's row is all
# zeros; in a narrow layer that happens from the first batch on, in a wide one whenever a sample
# first lands there (after a thousand steps, say).

# %%
def train_with_layer_norm(in_place, eps, label):
    """Adam on digits; returns the losses, the first non-finite step (or None) and that batch's row counts."""
    torch.manual_seed(seed)
    hidden_layer = nn.Linear(64, norm_width).to(dev, DTYPE)
    head = nn.Linear(norm_width, 10).to(dev, DTYPE)
    optimizer = torch.optim.Adam([*hidden_layer.parameters(), *head.parameters()], lr=0.01)
    generator = torch.Generator().manual_seed(seed)
    losses, first_bad = [], None
    for step in track(range(norm_steps), label, updates=1):
        x, y = sample_batch(generator)
        hidden = torch.relu(hidden_layer(x))
        normed = layer_norm(hidden, eps, in_place)
        loss = F.cross_entropy(head(normed), y)
        if first_bad is None and not torch.isfinite(loss):
            zero_variance = int((hidden.var(-1) == 0).sum())
            nan_rows = int(normed.isnan().any(-1).sum())
            first_bad = (step, zero_variance, nan_rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, first_bad


def same_trajectory(a, b):
    """Equal loss lists, where a NaN matches a NaN."""
    return len(a) == len(b) and all(p == q or (math.isnan(p) and math.isnan(q)) for p, q in zip(a, b))


repro_eps = 0.0 if bug else 1e-5
in_place_run = train_with_layer_norm(True, repro_eps, f"div_, eps={repro_eps:g}")
out_of_place_run = train_with_layer_norm(False, repro_eps, f"div, eps={repro_eps:g}")
identical_runs = same_trajectory(in_place_run[0], out_of_place_run[0])
print(f"eps={repro_eps:g}: div_ and div give the same loss at every step: {identical_runs}")
for label, (losses, first_bad) in (("div_", in_place_run), ("div ", out_of_place_run)):
    if first_bad is None:
        print(f"{label}: finite for all {norm_steps} steps, final loss {losses[-1]:.3f}")
    else:
        step, zero_variance, nan_rows = first_bad
        print(f"{label}: first NaN loss at step {step}; that batch had {zero_variance} rows with variance 0 "
              f"and {nan_rows} NaN rows after the LayerNorm")
first_nan_step = -1 if in_place_run[1] is None else in_place_run[1][0]
claims.metric("layer_norm_first_nan_step", first_nan_step)

# %% [markdown]
# **The fix, proven.** `eps` under the square root, with `div_` or `div` alike:

# %%
fixed_in_place = train_with_layer_norm(True, 1e-5, "div_, eps=1e-05")
fixed_out_of_place = train_with_layer_norm(False, 1e-5, "div, eps=1e-05")
fixed_finite = all(math.isfinite(v) for v in fixed_in_place[0] + fixed_out_of_place[0])
print(f"eps=1e-05: finite at every step: {fixed_finite}; div_ and div identical: "
      f"{same_trajectory(fixed_in_place[0], fixed_out_of_place[0])}; "
      f"loss {fixed_in_place[0][0]:.3f} -> {fixed_in_place[0][-1]:.3f}")

# %%
without_eps = train_with_layer_norm(False, 0.0, "div, eps=0") if not bug else out_of_place_run
claims.check(
    "C2",
    verdict="does-not-hold" if saved_outcome != "backward ran" and identical_runs and fixed_finite else "partly",
    measured={"div_ and div: same loss every step": identical_runs, "div_ on a saved tensor": saved_outcome.split(":")[0],
              "finite with eps": fixed_finite, "first NaN step without eps": without_eps[1][0] if without_eps[1] else "none"},
    rule="does not hold if div_ raises on a saved tensor, trains as div does and stays finite with eps")

# %% [markdown]
# ## Case C3: does `fill_diagonal_` on a `cdist` output cut the gradient and collapse the embeddings?

# %%
print(claims.case("C3").claim)


# %% [markdown]
# **Reproduce.** Four ways to zero the diagonal of a 32 × 32 distance matrix (above 25 rows
# `cdist` computes through a matrix product, so the diagonal need not be exactly 0), each followed by a
# weighted sum and a backward pass. The `diag_embed` subtraction is the reference.

# %%
def distance_matrix(embeddings, diagonal):
    distances = torch.cdist(embeddings, embeddings)
    if diagonal == "fill_diagonal_":
        distances.fill_diagonal_(0)
    elif diagonal == "clone + fill_diagonal_":
        distances = distances.clone().fill_diagonal_(0)
    elif diagonal == "diag_embed":
        distances = distances - torch.diag_embed(torch.diag(distances))
    elif diagonal == "masked_fill":
        eye = torch.eye(len(embeddings), dtype=torch.bool, device=embeddings.device)
        distances = distances.masked_fill(eye, 0.0)
    return distances


generator = torch.Generator().manual_seed(seed)
points = torch.randn(32, 8, generator=generator, dtype=DTYPE).to(dev)
weights = torch.randn(32, 32, generator=generator, dtype=DTYPE).to(dev)
print(f"cdist diagonal within 1e-6 of 0 (not necessarily exactly 0): "
      f"{bool(torch.cdist(points, points).diag().abs().max() < 1e-6)}")


def distance_grad(diagonal):
    embeddings = points.clone().requires_grad_()
    (grad,) = torch.autograd.grad((distance_matrix(embeddings, diagonal) * weights).sum(), embeddings)
    return grad


try:
    distance_grad("fill_diagonal_")
    fill_outcome = "backward ran"
except RuntimeError as error:
    fill_outcome = error_summary(error)
print("fill_diagonal_ on the cdist output:", fill_outcome)
reference_grad = distance_grad("diag_embed")
legal = {name: distance_grad(name) for name in ("clone + fill_diagonal_", "masked_fill")}
diagonal_report = compare_grads(legal, {name: reference_grad for name in legal})
print(diagonal_report)


# %% [markdown]
# The in-place `fill_diagonal_` does not cut anything: `cdist` saved its output for backward, so
# the first backward raises. Zeroing in place on a *copy*, masking and the `diag_embed` subtraction
# all give the same gradient, because every one of them sends exactly 0 into the diagonal.
#
# The article's training code, one step, as the parameters cell says (`bug=True`: `fill_diagonal_`):

# %%
def batch_hard_triplet_loss(embeddings, labels, diagonal):
    """For each anchor: its farthest same-class sample against its nearest other-class sample."""
    distances = distance_matrix(embeddings, diagonal)
    same = labels[:, None] == labels[None, :]
    hardest_positive = distances.masked_fill(~same, 0.0).amax(1)  # the zeroed self-distance never wins
    hardest_negative = distances.masked_fill(same, math.inf).amin(1)
    return F.relu(hardest_positive - hardest_negative + margin).mean()


def batch_all_triplet_loss(embeddings, labels, diagonal):
    """Mean over every valid (anchor, positive, negative) triplet that still violates the margin."""
    distances = distance_matrix(embeddings, diagonal)
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    valid = (same & ~eye)[:, :, None] & ~same[:, None, :]
    violations = F.relu(distances[:, :, None] - distances[:, None, :] + margin)[valid]
    active = violations[violations > 0]
    return active.mean() if active.numel() else violations.sum()


def between_class_cosine(net):
    """Mean cosine similarity of test embeddings from different classes (1.0 = all collapsed)."""
    with torch.no_grad():
        unit = F.normalize(net(x_test), dim=1)
    different = y_test[:, None] != y_test[None, :]
    return (unit @ unit.T)[different].mean().item()


def train_embedding(loss_fn, diagonal, steps, label):
    """Unit-norm 8-d digit embeddings trained with SGD; returns losses, cosines and first-layer grad std."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).to(dev, DTYPE)
    optimizer = torch.optim.SGD(net.parameters(), lr=triplet_lr)
    generator = torch.Generator().manual_seed(seed)
    losses, cosines = [], [(0, between_class_cosine(net))]
    with GradTracer(net, optimizer) as tracer:
        for step in track(range(steps), label, updates=2):
            x, y = sample_batch(generator)
            loss = loss_fn(F.normalize(net(x), dim=1), y, diagonal)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if (step + 1) % 25 == 0 or step + 1 == steps:
                cosines.append((step + 1, between_class_cosine(net)))
    grad_std = [record["std"] for record in tracer.history() if record["param"] == "0.weight"]
    return losses, cosines, grad_std


article_diagonal = "fill_diagonal_" if bug else "diag_embed"
try:
    train_embedding(batch_hard_triplet_loss, article_diagonal, 1, f"one step with {article_diagonal}")
    article_outcome = "trained"
except RuntimeError as error:
    article_outcome = error_summary(error)
print(f"{article_diagonal}: {article_outcome}")
claims.metric("triplet_inplace_raised", article_outcome != "trained")

# %% [markdown]
# **Measure.** Does the collapse itself happen? The same batch-hard loss, trained with the two
# out-of-place diagonals, and, for comparison, the batch-all loss (every violating triplet, not
# only the hardest one per anchor). `GradTracer` records the first layer's gradient std per step.

# %% [markdown]
# **Predict before you run.** Batch-hard triplet training starts at a between-class cosine of 0.866
# (1 means every class's embeddings point the same way). Where will it end after training?
# Write your guess into `guess` below, then run the next cells; the line after the measurement
# compares it with what was measured. (Left at `None`, it just prints the measurement.)

# %%
guess = None  # your prediction: replace None

# %%
runs = {
    "batch-hard, diag_embed": train_embedding(batch_hard_triplet_loss, "diag_embed", triplet_steps, "batch-hard, diag_embed"),
    "batch-hard, masked_fill": train_embedding(batch_hard_triplet_loss, "masked_fill", triplet_steps, "batch-hard, masked_fill"),
    "batch-all, diag_embed": train_embedding(batch_all_triplet_loss, "diag_embed", triplet_steps, "batch-all, diag_embed"),
}
for name, (losses, cosines, grad_std) in runs.items():
    print(f"{name:<24} cosine {cosines[0][1]:.3f} -> {cosines[-1][1]:.3f}   grad std {grad_std[0]:.2g} -> "
          f"{grad_std[-1]:.2g}   loss {losses[0]:.3f} -> {losses[-1]:.3f} (margin {margin})")
same_hard_runs = runs["batch-hard, diag_embed"][0] == runs["batch-hard, masked_fill"][0]
print("diag_embed and masked_fill give identical losses at every step:", same_hard_runs)

# %%
from labkit.predict import compare_guess

print(compare_guess(guess, round(runs["batch-hard, diag_embed"][1][-1][1], 3), bounds=(-1, 1),
                    what='the final between-class cosine of batch-hard mining',
                    why=("all embeddings start close together, so each anchor's hardest negative is about as near as its "
                         "hardest positive: batch-hard mining then pulls every embedding toward the others until the "
                         "loss sits at the margin, and the classes collapse instead of separating"),
                    answer_words=("collapse",)))

# %%
fig, (cos_ax, std_ax) = plt.subplots(1, 2, figsize=(10, 3.5), layout="constrained")
for name in ("batch-hard, diag_embed", "batch-all, diag_embed"):
    losses, cosines, grad_std = runs[name]
    cos_ax.plot([s for s, _ in cosines], [c for _, c in cosines], marker="o", label=name)
    std_ax.plot(range(len(grad_std)), grad_std, label=name)
cos_ax.axhline(0.95, color="red", linestyle="--", label="0.95 (the article's collapse)")
cos_ax.set(xlabel="step", ylabel="between-class cosine", title="embedding collapse")
std_ax.set(xlabel="step", ylabel="first-layer grad std", yscale="log", title="gradient std (GradTracer)")
cos_ax.legend(fontsize="small")
std_ax.legend(fontsize="small")
plt.show()
hard_cos = runs["batch-hard, diag_embed"][1][-1][1]
all_cos = runs["batch-all, diag_embed"][1][-1][1]
print(f"final between-class cosine: batch-hard {hard_cos:.3f}, batch-all {all_cos:.3f}")

# %% [markdown]
# The collapse is real, and it has nothing to do with the diagonal. All embeddings start close
# together (cosine near 0.9: the ReLU features of digits point the same way), and for such points
# the hardest negative is about as near as the hardest positive. Batch-hard mining then pulls every
# embedding toward the others until the loss sits at the margin, and the gradient shrinks with it.
# Averaging over all violating triplets keeps pushing the classes apart.

# %%
collapsed = hard_cos > 0.95
# The claimed mechanism: fill_diagonal_ runs and silently changes the gradients the other variants agree on.
mechanism_seen = fill_outcome == "backward ran" or not (diagonal_report.all_exact and same_hard_runs)
c3_verdict = {(True, True): "holds", (False, False): "does-not-hold"}.get((collapsed, mechanism_seen), "partly")
claims.check("C3", verdict=c3_verdict, measured={"fill_diagonal_ on the cdist output": fill_outcome.split(":")[0],
    "the other diagonals agree exactly": diagonal_report.all_exact and same_hard_runs,
    "final between-class cosine (collapse: above 0.95)": {"batch-hard": hard_cos, "batch-all": all_cos}})

# %% [markdown]
# **The fix, proven.** Two fixes for two problems: zero the diagonal out of place (any of the three
# legal ways above, which the gradient comparison proved equal), and mine triplets so the loss does
# not collapse (batch-all above, or semi-hard mining, or a warm-up before hard mining):

# %%
print(f"batch-all, diag_embed: cosine {all_cos:.3f} (< 0.95: {all_cos < 0.95}), "
      f"grad std {runs['batch-all, diag_embed'][2][0]:.2g} -> {runs['batch-all, diag_embed'][2][-1]:.2g}")
claims.metric("batch_hard_final_cosine", round(hard_cos, 3))

# %% [markdown]
# ## Case C4: does `gradcheck` expose a wrong custom backward?

# %%
print(claims.case("C4").claim)


# %% [markdown]
# **Reproduce.** A custom `autograd.Function` for row-wise squared distances
# `d_i = Σ_j (a_ij − b_ij)²`, whose backward is written three ways: missing the factor 2, correct,
# and `slight_error` too large (0.1 % by default). `gradcheck` compares the backward with central
# finite differences. The article's recipe is float32 inputs with `eps=1e-3, atol=1e-3,
# rtol=1e-3` (the last row); the other rows are gradcheck's float64 defaults, a tighter float64
# `rtol`, and float32 with the defaults. This table runs on the CPU on every machine: gradcheck's
# float32 verdicts depend on rounding.

# %%
def squared_distance_function(backward_scale):
    """The custom Function; the true derivative is 2 (a - b), its backward uses backward_scale (a - b)."""
    class SquaredDistance(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return (a - b).pow(2).sum(-1)

        @staticmethod
        def backward(ctx, grad_output):
            a, b = ctx.saved_tensors
            grad_a = backward_scale * grad_output[:, None] * (a - b)
            return grad_a, -grad_a

    return SquaredDistance.apply


BACKWARDS = {"missing factor 2": 1.0, "correct": 2.0, f"{slight_error:.1%} too large": 2.0 * (1 + slight_error)}
ARTICLE_RECIPE = "float32, eps=atol=rtol=1e-3"
SETTINGS = {
    "float64, defaults": (torch.float64, {}),
    "float64, rtol=1e-7": (torch.float64, {"rtol": 1e-7}),
    "float32, defaults": (torch.float32, {}),
    ARTICLE_RECIPE: (torch.float32, {"eps": 1e-3, "atol": 1e-3, "rtol": 1e-3}),
}


GRADCHECK_DRAWS = 10


def gradcheck_passes_for(scale, dtype, options):
    """How many of GRADCHECK_DRAWS seeded input draws gradcheck passes, and how many warnings it gave."""
    passes, warned = 0, 0
    for draw in range(GRADCHECK_DRAWS):
        generator = torch.Generator().manual_seed(seed + draw)
        a, b = (torch.randn(5, 3, generator=generator, dtype=dtype).requires_grad_() for _ in range(2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            passes += torch.autograd.gradcheck(squared_distance_function(scale), (a, b), raise_exception=False,
                                               **options)
        warned += len(caught)
    return passes, warned


gradcheck_table = {}
print(f"passes out of {GRADCHECK_DRAWS} input draws")
print(f"{'gradcheck setting':<30}" + "".join(f"{name:<20}" for name in BACKWARDS) + "warnings")
for setting, (dtype, options) in SETTINGS.items():
    results = [gradcheck_passes_for(scale, dtype, options) for scale in BACKWARDS.values()]
    gradcheck_table[setting] = [passes for passes, _ in results]
    print(f"{setting:<30}" + "".join(f"{passes:<20}" for passes, _ in results) + f"{sum(n for _, n in results)}")

# %% [markdown]
# **Verdict.** The claim is about the article's recipe, so that row decides: it holds if, in every
# draw, the recipe fails both wrong backwards and passes the correct one; partly if it separates
# only the gross error from the correct backward every time; it does not hold otherwise. The
# float64 rows say what a better-configured gradcheck does.

# %%
recipe_wrong, recipe_correct, recipe_slight = gradcheck_table[ARTICLE_RECIPE]
catches_gross = recipe_wrong == 0 and recipe_correct == GRADCHECK_DRAWS
catches_slight = catches_gross and recipe_slight == 0
claims.check("C4", verdict="holds" if catches_slight else "partly" if catches_gross else "does-not-hold", measured={
    "draws the article's recipe passed": dict(zip(BACKWARDS, gradcheck_table[ARTICLE_RECIPE])), "input draws": GRADCHECK_DRAWS})
claims.metric("c4_recipe_catches_slight_error", catches_slight)

# %% [markdown]
# **The fix.** Run gradcheck in float64 (it warns when the inputs are not double); with the
# article's float32 recipe a gross error shows, but an error smaller than its tolerances passes,
# and float32 with the defaults rejects even a correct backward. Tighten `rtol` to catch small
# errors.

# %% [markdown]
# ## Case C5: does BatchNorm's running-statistics update clash with autograd in train mode?

# %%
print(claims.case("C5").claim)


# %% [markdown]
# **Reproduce.** In [train mode](GLOSSARY.md#train-and-eval-mode) `BatchNorm1d` updates `running_mean` and `running_var` in place on
# every forward. Two forwards through the same module (as in a siamese network) and one backward,
# under anomaly detection, then the gradients against a hand-written batch norm.

# %%
def hand_written_batch_norm(x, weight, bias, eps):
    mean, var = x.mean(0), x.var(0, unbiased=False)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


torch.manual_seed(seed)
norm = nn.BatchNorm1d(4).to(dev, DTYPE)
generator = torch.Generator().manual_seed(seed)
first, second, upstream = (torch.randn(16, 4, generator=generator, dtype=DTYPE).to(dev) for _ in range(3))
first.requires_grad_()
mean_before = norm.running_mean.clone()
# detect_anomaly announces itself with a UserWarning whose text names a file path, different on
# every machine; the warning says nothing about the model, so it is recorded and dropped.
with warnings.catch_warnings(record=True), torch.autograd.detect_anomaly(check_nan=True):
    total = (norm(first) * upstream).sum() + (norm(second) * upstream).sum()
    grads = torch.autograd.grad(total, [first, norm.weight, norm.bias])
print("running_mean changed by the two forwards:", not torch.equal(mean_before, norm.running_mean))
print("backward after two train-mode forwards, with anomaly detection: no error")
twin = {name: p.detach().clone().requires_grad_() for name, p in (("weight", norm.weight), ("bias", norm.bias))}
hand_total = sum((hand_written_batch_norm(t, twin["weight"], twin["bias"], norm.eps) * upstream).sum()
                 for t in (first, second))
hand = torch.autograd.grad(hand_total, [first, twin["weight"], twin["bias"]])
bn_report = compare_grads(dict(zip(("input", "weight", "bias"), grads)),
                          dict(zip(("input", "weight", "bias"), hand)), rtol=1e-10)
print("train-mode BatchNorm vs hand-written:", agreement(bn_report))

# %% [markdown]
# No clash: the update runs outside autograd, and train-mode backward reads the [batch statistics](GLOSSARY.md#batch-statistics)
# saved by the forward, not the running buffers. **Measure** what does make train-mode BatchNorm
# fail: a batch of one, a batch of identical samples, and one non-finite value in a batch.

# %%
single = nn.BatchNorm1d(4).to(dev, DTYPE)
try:
    single(torch.randn(1, 4, dtype=DTYPE).to(dev))
    single_outcome = "ran"
except ValueError as error:
    single_outcome = error_summary(error)
print("batch of one:", single_outcome)

identical = torch.randn(1, 4, generator=generator, dtype=DTYPE).to(dev).repeat(16, 1).requires_grad_()
same_norm = nn.BatchNorm1d(4).to(dev, DTYPE)
identical_out = same_norm(identical)
(identical_grad,) = torch.autograd.grad((identical_out * upstream).sum(), identical)
expected_grad = (upstream - upstream.mean(0)) / math.sqrt(same_norm.eps)
largest_identical_out = identical_out.abs().max().item()
print(f"16 identical samples: largest |output| below 1e-9: {largest_identical_out < 1e-9}; input gradient = "
      f"(upstream - its mean) x 1/sqrt(eps) = {1 / math.sqrt(same_norm.eps):.0f}x: "
      f"{torch.allclose(identical_grad, expected_grad)}")

poisoned = torch.randn(16, 4, generator=generator, dtype=DTYPE).to(dev)
poisoned[3, 0] = math.inf
train_norm, eval_norm = nn.BatchNorm1d(4).to(dev, DTYPE), nn.BatchNorm1d(4).to(dev, DTYPE).eval()
train_bad = int((~train_norm(poisoned).isfinite()).sum())
eval_bad = int((~eval_norm(poisoned).isfinite()).sum())
train_norm.eval()
after_bad = int((~train_norm(torch.randn(16, 4, generator=generator, dtype=DTYPE).to(dev)).isfinite()).sum())
print(f"one inf in a 16 x 4 batch: non-finite outputs in train mode {train_bad}, in eval mode {eval_bad}")
print(f"running_mean finite after that train step: {bool(train_norm.running_mean.isfinite().all())}; "
      f"clean batch in eval mode afterwards: {after_bad} of 64 outputs non-finite")

# %% [markdown]
# In train mode one bad value enters its channel's batch statistics, so that channel turns
# non-finite in every sample of the batch; an eval-mode module that never trained on it keeps the
# bad value in its own sample. Eval mode is not safe afterwards, though: the train step wrote the
# bad statistics into the running buffers, and every later eval output of that channel is
# non-finite too. So this is "NaN in train mode, then in eval mode as well", not "fine in eval mode".

# %%
claims.check("C5", verdict="does-not-hold" if bn_report.all_close else "partly", measured={
    "two train-mode forwards, one backward: gradients as hand-written (rtol=1e-10)": bn_report.all_close})


# %% [markdown]
# **The fix, proven.** Keep BatchNorm in train mode for training, drop batches of one
# (`drop_last=True`), and refuse non-finite batches before they reach the model:

# %%
def guarded_forward(module, x):
    """Run module on x only when every value is finite; None tells the loop to skip the batch."""
    if not torch.isfinite(x).all():
        return None
    return module(x)


guarded = nn.BatchNorm1d(4).to(dev, DTYPE)
skipped = guarded_forward(guarded, poisoned) is None
guarded_forward(guarded, torch.randn(16, 4, generator=generator, dtype=DTYPE).to(dev))
print(f"poisoned batch skipped: {skipped}; running statistics finite: "
      f"{bool(guarded.running_mean.isfinite().all() and guarded.running_var.isfinite().all())}")

# %% [markdown]
# ## Summary
# - Autograd's version counter turns most in-place mistakes into a `RuntimeError` at the first
#   backward: `relu_` after `tanh`, `div_` on a tensor the variance saved, `fill_diagonal_` on a
#   `cdist` output (C1, C2, C3). Where it did not raise here, the in-place result was bit-identical
#   to the out-of-place one. Writing through `.data` gave silently wrong gradients.
# - A LayerNorm goes NaN when a row has zero variance and `eps` is missing, with `div_` and `div`
#   alike (C2). Put `eps` under the square root.
# - Triplet embeddings can collapse (between-class cosine above 0.95, gradient std falling) under
#   batch-hard mining, whatever the diagonal handling; batch-all mining avoided it here (C3).
# - The article's float32 gradcheck recipe (`eps=atol=rtol=1e-3`) catches a missing factor but
#   passes a small error, and float32 with gradcheck's defaults rejects a correct backward; run it
#   in float64 and tighten `rtol` for small errors (C4).
# - BatchNorm's running-statistics update never clashes with autograd (C5). Train-mode NaN comes
#   from a non-finite value spreading through the batch statistics into the running buffers; a
#   batch of one is an error, not a NaN.

# %% [markdown]
# ## Claims checked

# %%
claims.table()


# %% [markdown]
# ## Exercises
#
# ### Exercise 03.1: a LayerNorm that trains
# `layer_norm_rows(x, eps)` should normalise each row of `x` to zero mean and unit variance,
# exactly like `F.layer_norm(x, (x.shape[-1],), eps=eps)` without weight and bias, with gradients
# that flow. The version below follows the article's shape, and breaks twice.

# %%
# planted bug for exercise 03.1
def layer_norm_rows(x, eps=1e-5):
    """Each row of x normalised to zero mean and unit variance, like F.layer_norm without affine."""
    centred = x - x.mean(-1, keepdim=True)
    variance = centred.pow(2).mean(-1, keepdim=True)
    return centred.div_(variance.sqrt())


# %%
# The symptoms: backward refuses the graph, and a constant row turns into NaN.
sample = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
try:
    layer_norm_rows(sample).sum().backward()
    print("backward ran")
except RuntimeError as error:
    print("backward:", error_summary(error))
constant_row = torch.full((1, 5), 2.0, dtype=torch.float64)
print("NaN values for a constant row:", int(layer_norm_rows(constant_row).isnan().sum()))


# %% nbgrader={"grade": false, "grade_id": "exercise_03_1", "locked": false, "schema_version": 3, "solution": true}
# exercise 03.1
def layer_norm_rows(x, eps=1e-5):
    """Each row of x normalised to zero mean and unit variance, like F.layer_norm without affine."""
    ### BEGIN SOLUTION
    centred = x - x.mean(-1, keepdim=True)
    variance = centred.pow(2).mean(-1, keepdim=True)
    return centred / torch.sqrt(variance + eps)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_03_1", "locked": true, "points": 1, "schema_version": 3, "solution": false}
grading.check("03.1", layer_norm_rows)


# %% [markdown]
# ### Exercise 03.2: a custom backward that gradcheck accepts
# `distance_backward(grad_output, a, b)` is the backward of the row-wise Euclidean distance
# `d_i = ‖a_i − b_i‖` (not squared this time) for a custom `autograd.Function`: given
# `grad_output = dL/dd` (shape `[n]`) it returns `(dL/da, dL/db)`, each shaped like `a`. The
# version below reuses the derivative of the *squared* distance from case C4. The check wraps your
# function in an `autograd.Function` and runs `gradcheck` in float64.

# %%
# planted bug for exercise 03.2
def distance_backward(grad_output, a, b):
    """(dL/da, dL/db) for d_i = ||a_i - b_i|| (Euclidean, per row), given grad_output = dL/dd of shape [n]."""
    grad_a = 2 * grad_output[:, None] * (a - b)
    return grad_a, -grad_a


# %%
# The symptom: gradcheck in float64 rejects this backward.
class PlantedDistance(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return (a - b).norm(dim=1)

    @staticmethod
    def backward(ctx, grad_output):
        return distance_backward(grad_output, *ctx.saved_tensors)


pair = [torch.randn(4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
print("gradcheck passes:", torch.autograd.gradcheck(PlantedDistance.apply, pair, raise_exception=False))


# %% nbgrader={"grade": false, "grade_id": "exercise_03_2", "locked": false, "schema_version": 3, "solution": true}
# exercise 03.2
def distance_backward(grad_output, a, b):
    """(dL/da, dL/db) for d_i = ||a_i - b_i|| (Euclidean, per row), given grad_output = dL/dd of shape [n]."""
    ### BEGIN SOLUTION
    difference = a - b
    grad_a = grad_output[:, None] * difference / difference.norm(dim=1, keepdim=True)
    return grad_a, -grad_a
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_03_2", "locked": true, "points": 1, "schema_version": 3, "solution": false}
grading.check("03.2", distance_backward)

# %%
grading.score()

# %% [markdown]
# ## Debugging lab 03: a residual network with in-place writes
# A new run: a small regression network with a residual tanh block, a row normalisation and a
# rectifier. One thing in its forward pass is wrong, drawn for you from this notebook's family of
# in-place writes. `labs.start` prints what you would see, the causes you may choose from (decoys
# included) and the stages you may rewrite; investigate with the run's objects (`lab.model`,
# `lab.optimizer`, `lab.x`, `lab.y`, `lab.losses`), plain PyTorch (`tensor._version`,
# `torch.autograd.grad`) and labkit's instruments (`autograd_graph`, `compare_grads`), and
# `lab.rerun(stage=f)`. Then write `diagnose(lab)`: your diagnosis and the stage function you rewrote
# (lab 00 shows the format). The check reruns the training with your stage and compares each step's
# gradient with the same forward written out of place, and the final error with the same training
# without the defect.

# %% tags=["nbval-ignore-output"]
from labkit import labs

lab = labs.start("03")


# %%
# lab 03: your answer
def diagnose(lab):
    """Your diagnosis (one of lab.causes) and your repair (the stage function you rewrote, named after its stage)."""
    # YOUR CODE HERE
    raise NotImplementedError("Lab 03: replace these two lines with your answer")


# %%
labs.check(lab, diagnose)

# %% [markdown]
# ## What comes next
# [04 · Autograd modes: no_grad, inference_mode, sampling and packed sequences](04_autograd_modes.ipynb):
# in-place ops are one way to break a gradient; 04 measures the switches that stop one on purpose.

# %% [markdown]
# ## Further reading
# - [Autograd mechanics: in-place operations](https://docs.pytorch.org/docs/stable/notes/autograd.html#in-place-operations-with-autograd)
# - [torch.autograd.gradcheck.gradcheck](https://docs.pytorch.org/docs/stable/generated/torch.autograd.gradcheck.gradcheck.html)
# - [torch.nn.LayerNorm](https://docs.pytorch.org/docs/stable/generated/torch.nn.LayerNorm.html)
# - [Hermans et al. 2017, In Defense of the Triplet Loss for Person Re-Identification](https://arxiv.org/abs/1703.07737)
# - [Ba et al. 2016, Layer Normalization](https://arxiv.org/abs/1607.06450)

# %% [markdown]
# ## About this run
# The stored outputs were made on a CPU with the default parameters. A cell whose output depends on
# the machine or the clock (timings, device names, addresses) carries the cell tag
# `nbval-ignore-output` (JupyterLab shows a cell's tags in its property inspector):
# the workbook's tests rerun every notebook and compare all other outputs with the stored ones. The
# cell below says which machine, Python and torch produced this run.

# %% tags=["nbval-ignore-output"]
from labkit.probes import fingerprint, format_fingerprint

print(format_fingerprint(fingerprint()))
