# %% [markdown]
# # 07 · Gradient clipping: which norm, which order, and what it cannot fix
#
# Clipping is the usual answer to a gradient spike and, in the source articles, to a NaN loss too.
# You will measure what `clip_grad_norm_` and `clip_grad_value_` do to a gradient (its size and its
# direction), compare L1 with L2 clipping on a small CNN hit by gradient spikes, watch a clipping
# call placed before `unscale_` freeze training, and see why no clipping call repairs a NaN.
#
# **You will learn**
# - what `clip_grad_norm_` and `clip_grad_value_` do to a gradient's size and direction
# - L1 against L2 norm clipping on a small CNN hit by gradient spikes
# - what clipping before `scaler.unscale_` does to training, although nothing raises
# - why no clipping call repairs a NaN
#
# **Prerequisites:**
# [02 · Gradients accumulate: `zero_grad`, loss reduction and gradient accumulation](02_gradients_accumulate.ipynb).
# You should know: Python functions and classes; PyTorch tensors, `nn.Module` and a training loop
# (`loss.backward()`, `optimizer.step()`); vector norms.
#
# **Time:** about 50 min to read and run, plus about 20 min for the 2 exercises. Run All takes about
# 40 s on 2 CPU cores.
#
# **Words** this notebook uses, explained in the [glossary](GLOSSARY.md):
# [gradient clipping](GLOSSARY.md#gradient-clipping), [loss scale](GLOSSARY.md#loss-scale),
# [update to data ratio](GLOSSARY.md#update-to-data-ratio).
#
# **Predict before you run:** one cell below asks for your guess before a key measurement.

# %%
import sys, importlib.util as iu; "google.colab" in sys.modules and not iu.find_spec("labkit") and get_ipython().system("pip install 'gradient-lab-workbook[colab] @ git+https://github.com/gradient-lab/gradient-lab'"); import labkit.start  # no labkit here? README, Install

import inspect
import math
import statistics
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

from labkit import GradTracer, claims, compare_grads, datasets, grading, plot_grad_stat, repro
from labkit.probes import fingerprint, format_fingerprint
from labkit.progress import track

# %% [markdown]
# ## Parameters
# `steps` minibatch SGD steps at learning rate `lr` train the digits MLPs of case F2 and of the
# clipping-order bug; `cnn_steps` train the CNNs of case F3, where every `spike_every`-th batch
# arrives un-normalised (pixels multiplied by `spike_scale`). `seeds` is how many seeds each
# comparison runs. `divergence_lr` is the learning rate of case F4's regression, high enough by
# default to make its loss overflow without clipping. `norm_per_tensor=True` makes case F2's norm
# clipping clip each parameter tensor by its own norm (a loop over the parameters) instead of the
# whole gradient by its norm; `clip_factor` sets case F3's thresholds as a multiple of the clean
# steps' median norm. `bug=True` clips the gradients *before* `GradScaler.unscale_`; `bug=False` after.

# %% tags=["parameters"]
seed: int = 0  # seed of every random stream, from 0 to 2147483647
device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N" or "mps"
steps: int = 150  # minibatch SGD steps of the digits MLPs, from 1 to 100000
lr: float = 0.5  # SGD learning rate of the digits MLPs, above 0, at most 10
cnn_steps: int = 100  # training steps of the CNNs (case F3), from 1 to 10000
seeds: int = 3  # seeds each comparison runs over, from 1 to 100
spike_every: int = 10  # every spike_every-th CNN batch arrives un-normalised, from 1 to cnn_steps
spike_scale: float = 16.0  # factor on the pixels of such a batch, above 0, at most 1000
max_norm: float = 1.0  # norm-clipping threshold, above 0, at most 1000
divergence_lr: float = 0.5  # learning rate of the diverging regression of case F4, above 0, at most 100
norm_per_tensor: bool = False  # True: case F2's norm clipping clips each tensor by its own norm
clip_factor: float = 2.0  # case F3's clipping thresholds, as a multiple of the clean median norm, above 0, at most 100
bug: bool = True  # True runs the planted bug, False the fix

# %%
repro.check_parameters(globals())
dev = repro.setup(seed=seed, device=device)

# %% [markdown]
# Everything runs on `dev` in float64, so that a CPU and a GPU print the same rounded numbers. The
# data are scikit-learn's handwritten digits (8x8 images, pixels scaled to [0, 1]).

# %%
DTYPE = torch.float64
BATCH = 64
digits = datasets.digits().to(dev)
images = datasets.digits(images=True).to(dev)
print(f"{len(digits.y_train)} training and {len(digits.y_test)} test digits, {digits.classes} classes")


def digits_mlp(model_seed, width=128):
    """The MLP of cases F1 and F2: 64 pixels -> two ReLU layers -> 10 logits."""
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    return model.to(dev, DTYPE)


def is_spike(step):
    return step % spike_every == spike_every - 1


def train(model, split, *, run_seed, steps, lr, momentum=0.0, after_backward=None, spikes=False):
    """Minibatch SGD on a digits split. With `spikes`, every `spike_every`-th batch arrives
    un-normalised. `after_backward(parameters)` (a clipping call, or a probe) runs between backward
    and step; what it returns is collected and returned, one entry per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    batches = torch.Generator().manual_seed(run_seed)
    records = []
    for step in range(steps):
        index = torch.randint(0, len(split.y_train), (BATCH,), generator=batches).to(dev)
        x = split.x_train[index].to(DTYPE)
        if spikes and is_spike(step):
            x = x * spike_scale
        optimizer.zero_grad()
        F.cross_entropy(model(x), split.y_train[index]).backward()
        if after_backward is not None:
            records.append(after_backward(list(model.parameters())))
        optimizer.step()
    return records


def test_accuracy(model, split):
    with torch.no_grad():
        return (model(split.x_test.to(DTYPE)).argmax(1) == split.y_test).to(DTYPE).mean().item()


def gradient_copy(grads):
    """Fresh leaf tensors holding copies of `grads`, so each clipping call starts from the same gradient."""
    holders = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for holder, grad in zip(holders, grads):
        holder.grad = grad.clone()
    return holders


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def cosine(a, b):
    return (a @ b / (a.norm() * b.norm())).item()


# %% [markdown]
# ## Case F1: what is `clip_grad_norm_`'s default `norm_type`?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("F1").claim)

# %% [markdown]
# **Reproduce.** Ask the installed function: its signature holds the default.

# %%
default_norm_type = inspect.signature(clip_grad_norm_).parameters["norm_type"].default
print(f"installed torch: clip_grad_norm_(..., norm_type={default_norm_type!r}, ...)")

# %% [markdown]
# **Measure.** A real gradient spike: one digits batch that arrives un-normalised (pixels 0–16
# instead of 0–1) on the untrained MLP. `clip_grad_norm_` returns the total norm it measured and
# scales every gradient by `min(1, max_norm / (total + 1e-6))`. Each row clips a fresh copy of the
# same gradient; the first passes no `norm_type` at all.

# %%
spike_model = digits_mlp(seed)
F.cross_entropy(spike_model(digits.x_train[:BATCH].to(DTYPE) * spike_scale), digits.y_train[:BATCH]).backward()
spike_grads = [p.grad.clone() for p in spike_model.parameters()]
spike_vector = flat(spike_grads)
print(f"{spike_vector.numel()} gradient values, largest |g| = {spike_vector.abs().max().item():.3g}")

norm_options = {"default (no norm_type)": {}, "norm_type=2": {"norm_type": 2.0},
                "norm_type=inf": {"norm_type": math.inf}, "norm_type=1": {"norm_type": 1.0}}
clipped_by = {}
totals = {}
for label, options in norm_options.items():
    holders = gradient_copy(spike_grads)
    totals[label] = clip_grad_norm_(holders, max_norm, **options).item()
    clipped_by[label] = [h.grad for h in holders]
    factor = min(1.0, max_norm / (totals[label] + 1e-6))
    print(f"{label:<23} total norm {totals[label]:8.4g}   scale factor {factor:.3g}   clipped: {factor < 1}")

# %%
names = [name for name, _ in spike_model.named_parameters()]
default_vs_l2 = compare_grads(dict(zip(names, clipped_by["default (no norm_type)"])),
                              dict(zip(names, clipped_by["norm_type=2"])))
print("clipped with the default vs with norm_type=2:\n" + str(default_vs_l2))


# %% [markdown]
# The inf-norm is the largest single |g|, never more than the L2 norm, and the L1 norm is never less:
# at one `max_norm`, inf-norm clipping fires least and L1 clipping most.

# %%
def clip_outcome(total):
    """A gradient's total norm, and what clip_grad_norm_ did to it at `max_norm`."""
    return f"{total:.3g} ({f'scaled by {max_norm / total:.2f}' if total > max_norm else 'not clipped'})"


l2_total, inf_total = totals["norm_type=2"], totals["norm_type=inf"]
default_is_l2 = default_norm_type == 2.0 and default_vs_l2.all_exact
claims.check("F1", verdict="does-not-hold" if default_is_l2 else "holds", measured={
    "default norm_type": default_norm_type, "no norm_type gives the norm_type=2 result exactly": default_vs_l2.all_exact,
    "max_norm": max_norm, "spike gradient's total norm": {"L2": clip_outcome(l2_total), "inf": clip_outcome(inf_total)}})

# %% [markdown]
# **The fix.** Nothing in the default needs fixing. When clipping seems to "do nothing", log the
# total norm `clip_grad_norm_` returns and compare it with `max_norm`: that number says how often and
# how hard the call clips. Writing `norm_type=2.0` out changes nothing but the reader's doubt.

# %% [markdown]
# ## Case F2: value clipping versus norm clipping
# **The claim**, in the catalogue's words:

# %%
print(claims.case("F2").claim)


# %% [markdown]
# **Measure the direction.** The same spike gradient, clipped by value at a few thresholds
# (`clip_grad_value_` clamps every entry to ±c) and by norm. The cosine between the clipped and the
# original gradient stays 1 when only the length changes.

# %%
def value_clipped(grads, clip_value):
    holders = gradient_copy(grads)
    clip_grad_value_(holders, clip_value)
    return flat(h.grad for h in holders)


value_cosines, clamped_shares = {}, {}
for clip_value in (0.1, 0.03, 0.01):
    clamped_shares[clip_value] = clamped_share = (spike_vector.abs() > clip_value).to(DTYPE).mean().item()
    value_cosines[clip_value] = cosine(value_clipped(spike_grads, clip_value), spike_vector)
    print(f"value clip at {clip_value:<5} clamps {clamped_share:6.1%} of the entries; cosine to the original {value_cosines[clip_value]:.3f}")
small_entries = spike_vector.abs() < 0.1
small_changed = int((value_clipped(spike_grads, 1.0) != spike_vector)[small_entries].sum())
print(f"value clip at 1.0 changed {small_changed} of the {int(small_entries.sum())} entries below 0.1")
def clip_norm(parameters, limit):
    """Norm clipping at `limit`: of the whole gradient, or with `norm_per_tensor` of each tensor on its own.
    Returns the whole gradient's norm before clipping."""
    if not norm_per_tensor:
        return clip_grad_norm_(parameters, limit).item()
    total = flat(p.grad for p in parameters).norm().item()
    for parameter in parameters:
        clip_grad_norm_([parameter], limit)
    return total


holders = gradient_copy(spike_grads)
clip_norm(holders, max_norm)
norm_clipped = flat(h.grad for h in holders)
norm_cosine = cosine(norm_clipped, spike_vector)
norm_kind = "each tensor's norm" if norm_per_tensor else "the total norm"
print(f"norm clip at {max_norm} of {norm_kind}: cosine to the original {norm_cosine:.6f}")

# %% [markdown]
# **The article's example: gradients inside ±0.05, clip value 1.0.** A normal batch on the same MLP
# gives such a gradient. Value clipping at 1.0 cannot touch an entry smaller than 0.05, and norm
# clipping rescales only when the *total* norm exceeds `max_norm`.

# %%
calm_model = digits_mlp(seed)
F.cross_entropy(calm_model(digits.x_train[:BATCH].to(DTYPE)), digits.y_train[:BATCH]).backward()
calm_grads = [p.grad.clone() for p in calm_model.parameters()]
calm_vector = flat(calm_grads)
inside = int((calm_vector.abs() <= 0.05).sum())
value_untouched = torch.equal(value_clipped(calm_grads, 1.0), calm_vector)
holders = gradient_copy(calm_grads)
calm_total = clip_grad_norm_(holders, max_norm).item()
norm_untouched = torch.equal(flat(h.grad for h in holders), calm_vector)
print(f"{inside} of the {calm_vector.numel()} entries lie within ±0.05 (largest |g| {calm_vector.abs().max().item():.3f})")
print(f"clip_grad_value_(1.0) leaves the gradient bit-for-bit unchanged: {value_untouched}")
print(f"clip_grad_norm_({max_norm}) measures a total norm of {calm_total:.3f}, so it leaves it unchanged too: {norm_untouched}")

# %% [markdown]
# So norm clipping "scales the gradients into ±0.03", as the article reports, only with a `max_norm`
# below the total norm (here below 0.26). Did either kind *help*? Three ways to train the MLP on the
# same batches, for several seeds: no clipping, value clipping at 1.0, and norm clipping at half this
# gradient's norm, below the norm of a typical step.

# %%
tight_norm = round(calm_total / 2, 2)


def clip_values_at_one(parameters):
    clip_grad_value_(parameters, 1.0)


tight_clipped = []  # per step: did norm clipping scale anything (with norm_per_tensor: any tensor)?


def clip_norm_tight(parameters):
    measured = [p.grad for p in parameters] if norm_per_tensor else [flat(p.grad for p in parameters)]
    tight_clipped.append(max(g.norm().item() for g in measured) > tight_norm)
    return clip_norm(parameters, tight_norm)


variants = {"no clipping": None, "value 1.0": clip_values_at_one, f"norm {tight_norm:g}": clip_norm_tight}
accuracy = {label: [] for label in variants}
value_same_as_none = []
for run_seed in track(range(seeds), "F2 training runs (3 per seed)", updates=1):
    final_params = {}
    for label, clip in variants.items():
        model = digits_mlp(run_seed)
        train(model, digits, run_seed=run_seed, steps=steps, lr=lr, after_backward=clip)
        accuracy[label].append(test_accuracy(model, digits))
        final_params[label] = list(model.parameters())
    value_same_as_none.append(all(torch.equal(a, b) for a, b in zip(final_params["no clipping"], final_params["value 1.0"])))

# %%
for label, accuracies in accuracy.items():
    print(f"{label:<12} test accuracy per seed {[round(a, 3) for a in accuracies]}, mean {statistics.mean(accuracies):.3f}")
print(f"norm clipping at {tight_norm:g} of {norm_kind} clipped {statistics.mean(tight_clipped):.0%} of the steps")
print("value clipping at 1.0 trained bit-identical models to no clipping on every seed:", all(value_same_as_none))

# %%
norm_effect = statistics.mean(accuracy[f"norm {tight_norm:g}"]) - statistics.mean(accuracy["no clipping"])
# Value clipping turns the gradient wherever it clamps some entries; norm clipping, by the claim, never.
value_rotates = all(value_cosines[c] < 0.999 for c, share in clamped_shares.items() if share > 0)
norm_keeps_direction = norm_cosine > 0.999999
direction_holds = value_rotates and norm_keeps_direction
norm_helped = norm_effect > 0.005
value_effect = statistics.mean(accuracy["value 1.0"]) - statistics.mean(accuracy["no clipping"])
value_cost_accuracy = value_effect < -0.005  # the article's 12% recall drop needs value clipping to change something
claims.check(
    "F2",
    verdict=("holds" if norm_helped and value_cost_accuracy and small_changed else "partly") if direction_holds
    else "does-not-hold",
    measured={"cosine to the spike gradient after norm clipping": f"{norm_cosine:.6f}",
              "after value clipping": {f"c={c:g}": cos for c, cos in value_cosines.items()},
              "entries below 0.1 that value clipping at 1.0 changed": small_changed,
              "mean test accuracy change": {"value 1.0": f"{value_effect:+.3f}", f"norm {tight_norm:g}": f"{norm_effect:+.3f}"}},
)

# %% [markdown]
# **The fix.** Choose the threshold from the norms you measure (the value `clip_grad_norm_` returns),
# and clip by norm when the gradient's direction must survive. A clip that never fires is no safety
# net, and a clip that always fires is just a smaller learning rate.

# %% [markdown]
# ## A clipping bug that hides: clipping before `unscale_`
# With a `GradScaler` (the subject of `10_mixed_precision`), `backward` leaves every gradient
# multiplied by the [loss scale](GLOSSARY.md#loss-scale) (65536 at first) until `scaler.unscale_(optimizer)` divides it back.
# Clip before that, and `clip_grad_norm_` measures a norm 65536 times too large and shrinks every
# step to `max_norm / 65536` of its size. Nothing fails; training just stops moving.
# `GradTracer(update_ratio=True)` records each step's `||Δp|| / ||p||` per parameter.

# %% [markdown]
# **Predict before you run.** With `bug=True` the gradients are clipped before `scaler.unscale_`, so
# the clipped norm is measured on gradients 65536 times too large. What median [update to data ratio](GLOSSARY.md#update-to-data-ratio)
# will the first layer get? (Around 1e-3 is the usual healthy value.)
# Write your guess into `guess` below, then run the next cells; the line after the measurement
# compares it with what was measured. (Left at `None`, it just prints the measurement.)

# %%
guess = None  # your prediction: replace None


# %%
def train_with_scaler(clip_before_unscale, label):
    """The MLP trained with a GradScaler and norm clipping (float64 gradients: nothing overflows)."""
    model = digits_mlp(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(dev.type)
    batches = torch.Generator().manual_seed(seed)
    with GradTracer(model, optimizer, update_ratio=True) as tracer:
        for _ in track(range(steps), label, updates=1):
            index = torch.randint(0, len(digits.y_train), (BATCH,), generator=batches).to(dev)
            optimizer.zero_grad()
            scaler.scale(F.cross_entropy(model(digits.x_train[index].to(DTYPE)), digits.y_train[index])).backward()
            if clip_before_unscale:
                clip_grad_norm_(model.parameters(), max_norm)
                scaler.unscale_(optimizer)
            else:
                scaler.unscale_(optimizer)
                clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()
    return model, tracer.history()


def median_update_ratio(history, param="0.weight"):
    return statistics.median(r["update_ratio"] for r in history if r["param"] == param)


scaled_model, scaled_history = train_with_scaler(clip_before_unscale=bug, label=f"GradScaler run (bug={bug})")
scaled_accuracy, scaled_ratio = test_accuracy(scaled_model, digits), median_update_ratio(scaled_history)
print(f"bug={bug}: test accuracy {scaled_accuracy:.3f}; median update:data ratio of the first layer {scaled_ratio:.2g}")
claims.metric("scaler_test_accuracy", round(scaled_accuracy, 3))
claims.metric("scaler_update_ratio", float(f"{scaled_ratio:.2g}"))

# %%
from labkit.predict import compare_guess

print(compare_guess(guess, float(f"{scaled_ratio:.2g}"), what="the first layer's median update to data ratio",
                    why=("clipping the still-scaled gradients measures a norm 65536 times too large, so the clip "
                         "factor shrinks the real gradients by about that much: updates far below 1e-3, and training "
                         "stands still without an error"),
                    answer_words=("freezes training",)))

# %%
figure = plot_grad_stat(scaled_history, "update_ratio")
figure.axes[0].set_title(f"update:data ratio per step (bug={bug})")
plt.show()
print(f"median update:data ratio of the first layer: {scaled_ratio:.2g}")

# %% [markdown]
# **The fix, proven.** `scaler.unscale_(optimizer)` first, then `clip_grad_norm_`, then
# `scaler.step(optimizer)`, which knows the gradients are already unscaled:

# %%
fixed_model, fixed_history = train_with_scaler(clip_before_unscale=False, label="unscale, then clip")
fixed_accuracy, fixed_ratio = test_accuracy(fixed_model, digits), median_update_ratio(fixed_history)
print(f"unscale, then clip: test accuracy {fixed_accuracy:.3f}; median update:data ratio {fixed_ratio:.2g}")
print(f"the fixed order trains: {fixed_accuracy > 0.8}; it moves the first layer {fixed_ratio / scaled_ratio:.2g}x "
      f"as far per step as the run above")

# %% [markdown]
# ## Case F3: is L1-norm clipping more robust for CNN backbones?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("F3").claim)


# %% [markdown]
# **Reproduce.** A small CNN (two 3x3 convolutions and a linear head) on the digit images, SGD with
# momentum 0.9, and every `spike_every`-th batch un-normalised. A fair test gives each norm its own
# threshold, because the L1 norm of a gradient with thousands of entries is far larger than its L2
# norm: both are calibrated alike, at `clip_factor` times (twice, by default) the median norm of the clean steps of a short
# unclipped run. First, how the two norms react to a spike:

# %%
def digits_cnn(model_seed):
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1, stride=2),
                          nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 10))
    return model.to(dev, DTYPE)


def l1_and_l2(parameters):
    """Measure the whole gradient's L1 and L2 norms; clip nothing."""
    grads = flat(p.grad for p in parameters)
    return grads.abs().sum().item(), grads.norm().item()


calibration_steps = 3 * spike_every
probe = train(digits_cnn(seeds), images, run_seed=seeds, steps=calibration_steps, lr=0.05, momentum=0.9,
              after_backward=l1_and_l2, spikes=True)
clean = [norms for step, norms in enumerate(probe) if not is_spike(step)]
spiked = [norms for step, norms in enumerate(probe) if is_spike(step)]
l1_limit = clip_factor * statistics.median(n[0] for n in clean)
l2_limit = clip_factor * statistics.median(n[1] for n in clean)
print(f"thresholds at {clip_factor:g}x the clean median: L1 {l1_limit:.3g}, L2 {l2_limit:.3g}")
print("spike steps, norm / clean median:  L1", [round(clip_factor * n[0] / l1_limit, 1) for n in spiked],
      " L2", [round(clip_factor * n[1] / l2_limit, 1) for n in spiked])
ratios = [n[0] / n[1] for n in probe]
print(f"L1/L2 ratio over the run: {min(ratios):.3g} to {max(ratios):.3g}")


# %% [markdown]
# If a spike moved one norm much more than the other, calibrated L1 and L2 clipping would treat
# spikes differently; compare the two rows above. Does the choice make training more robust? Each
# seed trains the CNN three ways on the same spiky batches.

# %%
def clip_l2(parameters):
    return clip_grad_norm_(parameters, l2_limit, norm_type=2.0).item()


def clip_l1(parameters):
    return clip_grad_norm_(parameters, l1_limit, norm_type=1.0).item()


cnn_variants = {"no clipping": None, "L2 clipping": clip_l2, "L1 clipping": clip_l1}
cnn_accuracy = {label: [] for label in cnn_variants}
clipped_share = {label: [] for label in cnn_variants}
for run_seed in track(range(seeds), "F3 training runs (3 per seed)", updates=1):
    for label, clip in cnn_variants.items():
        model = digits_cnn(run_seed)
        records = train(model, images, run_seed=run_seed, steps=cnn_steps, lr=0.05, momentum=0.9,
                        after_backward=clip, spikes=True)
        cnn_accuracy[label].append(test_accuracy(model, images))
        limit = l2_limit if label == "L2 clipping" else l1_limit
        clipped_share[label].append(statistics.mean(total > limit for total in records) if records else 0.0)

# %%
for label in cnn_variants:
    share = statistics.mean(clipped_share[label])
    print(f"{label:<12} test accuracy per seed {[round(a, 2) for a in cnn_accuracy[label]]}, "
          f"mean {statistics.mean(cnn_accuracy[label]):.3f}; steps clipped {share:.0%}")

# %% [markdown]
# **Uncalibrated thresholds.** With the same `max_norm` for both, the comparison says nothing about
# robustness: the L1 norm of this gradient is tens of times its L2 norm, so L1 clipping shrinks every
# step and acts as a smaller learning rate.

# %%
typical_l1, typical_l2 = l1_limit / clip_factor, l2_limit / clip_factor
print(f"at max_norm={max_norm} a typical clean step is scaled by {min(1, max_norm / typical_l2):.2f} with L2 "
      f"and by {min(1, max_norm / typical_l1):.3f} with L1")

# %%
per_seed_gain = [l1 - l2 for l1, l2 in zip(cnn_accuracy["L1 clipping"], cnn_accuracy["L2 clipping"])]
mean_gain = statistics.mean(per_seed_gain)
l1_clearly_better = mean_gain > 0.02 and all(g > 0 for g in per_seed_gain)
claims.check("F3", verdict="holds" if l1_clearly_better else "does-not-hold", measured={
    "L1 minus L2 clipping, test accuracy per seed": [f"{g:+.3f}" for g in per_seed_gain], "mean": f"{mean_gain:+.3f}",
    "threshold (x the clean median norm)": clip_factor}, rule="holds if L1 is ahead on every seed, by over 0.02 on average")

# %% [markdown]
# **The fix.** Clip, by the L2 norm unless you have measured a reason not to, at a threshold taken
# from the norms your run produces; compare clipping choices at matched thresholds and over seeds.

# %% [markdown]
# ## Case F4: does `clip_grad_norm_(..., 1.0)` cure a NaN loss?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("F4").claim)


# %% [markdown]
# **Reproduce.** A common way to get NaN: a signed square root ("power normalisation",
# `sign(h)·sqrt(|h|)`) written with `torch.where`. The forward pass picks the valid branch, so the
# loss is finite. But `where` evaluates both branches: the discarded one holds `sqrt(negative) = NaN`,
# backward still sends it a zero gradient, and sqrt's backward turns that zero into
# `0 / (2·sqrt(h)) = 0 / NaN = NaN`.

# %%
class SignedSqrt(nn.Module):
    """sign(h)·sqrt(|h|). `safe=False` is the torch.where version whose backward returns NaN."""

    def __init__(self, safe):
        super().__init__()
        self.safe = safe

    def forward(self, h):
        if self.safe:
            return h.sign() * h.abs().clamp_min(1e-12).sqrt()
        return torch.where(h >= 0, h.sqrt(), -(-h).sqrt())


def sqrt_model(safe):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), SignedSqrt(safe), nn.Linear(64, 10)).to(dev, DTYPE)


def nonfinite_counts(model):
    return {name: int((~torch.isfinite(p.grad)).sum()) for name, p in model.named_parameters()}


nan_model = sqrt_model(safe=False)
batch_x, batch_y = digits.x_train[:BATCH].to(DTYPE), digits.y_train[:BATCH]
nan_loss = F.cross_entropy(nan_model(batch_x), batch_y)
nan_loss.backward()
before_clip = nonfinite_counts(nan_model)
print(f"loss {nan_loss.item():.4f} (finite: {math.isfinite(nan_loss.item())})")
print("non-finite gradient values per parameter:", before_clip)

# %% [markdown]
# **Measure.** Clip at 1.0 and look again. The total norm of a gradient holding a NaN is NaN, the
# scale factor `1.0 / (NaN + 1e-6)` is NaN, and `clip_grad_norm_` multiplies *every* gradient by it.

# %%
nan_total = clip_grad_norm_(nan_model.parameters(), 1.0)
after_clip = nonfinite_counts(nan_model)
print(f"total norm returned: {nan_total.item()}")
print("non-finite gradient values per parameter after clipping:", after_clip)
poisoned_before = sum(count > 0 for count in before_clip.values())
poisoned_after = sum(count > 0 for count in after_clip.values())
print(f"parameters with a non-finite gradient: {poisoned_before} of {len(before_clip)} before clipping, "
      f"{poisoned_after} of {len(after_clip)} after")

# %%
try:
    clip_grad_norm_(nan_model.parameters(), 1.0, error_if_nonfinite=True)
    print("error_if_nonfinite=True: no error")
except RuntimeError as error:
    print("error_if_nonfinite=True raises RuntimeError:", str(error).split(". ")[0])


# %% [markdown]
# Ten training steps with clipping at 1.0 under a `GradTracer`: its `nonfinite` alerts say which
# parameters received NaN, and when.

# %%
def train_sqrt_model(safe, guard):
    """SGD with clip_grad_norm_(1.0); with `guard`, a step whose total norm is not finite is skipped."""
    model = sqrt_model(safe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, skipped = [], 0
    with GradTracer(model) as tracer:
        for _ in range(10):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(digits.x_train[:256].to(DTYPE)), digits.y_train[:256])
            loss.backward()
            total = clip_grad_norm_(model.parameters(), 1.0)
            if guard and not torch.isfinite(total):
                skipped += 1
            else:
                optimizer.step()
            tracer.step()
            losses.append(loss.item())
    params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return losses, skipped, params_finite, tracer.alerts("nonfinite")


nan_losses, _, nan_params_finite, nan_alerts = train_sqrt_model(safe=False, guard=False)
print("losses:", [round(v, 3) for v in nan_losses[:4]], "...")
print("parameters still finite:", nan_params_finite)
for alert in nan_alerts[:3]:
    print("alert:", alert)
print(f"{len(nan_alerts)} non-finite alerts in 10 steps")


# %% [markdown]
# **Where clipping does help.** A NaN can also be the *end* of a divergence: a learning rate too
# high for a regression MLP (`divergence_lr`) makes every step larger than the last until the loss
# overflows. Does clipping at 1.0 bound each step enough to keep that run finite? Both runs below
# use the same learning rate; the lines after them say.

# %%
def diverging_run(clip_at):
    """Full-batch SGD at `divergence_lr` on a regression MLP, clipped at `clip_at` (None: not at all); returns the losses."""
    x, y = (t.to(dev) for t in datasets.regression(256, 8, seed=seed, dtype=DTYPE))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(dev, DTYPE)
    optimizer = torch.optim.SGD(model.parameters(), lr=divergence_lr)
    losses = []
    for _ in range(DIVERGENCE_STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip_at is not None:
            clip_grad_norm_(model.parameters(), clip_at)
        optimizer.step()
        losses.append(loss.item())
    return losses


DIVERGENCE_STEPS = 40
unclipped_losses, clipped_losses = diverging_run(None), diverging_run(1.0)
first_nonfinite = next((k for k, v in enumerate(unclipped_losses) if not math.isfinite(v)), None)
clipped_finite = all(math.isfinite(v) for v in clipped_losses)
unclipped_end = (f"non-finite at step {first_nonfinite}" if first_nonfinite is not None
                 else f"{unclipped_losses[-1]:.3g} after {DIVERGENCE_STEPS} steps, all finite")
print(f"lr {divergence_lr:g}, no clipping: loss {unclipped_losses[0]:.3g} -> {unclipped_end}")
print(f"lr {divergence_lr:g}, clip at 1.0: loss {clipped_losses[0]:.3g} -> {clipped_losses[-1]:.3g} after "
      f"{DIVERGENCE_STEPS} steps, all finite: {clipped_finite}")
claims.metric("divergence_first_nonfinite_step", -1 if first_nonfinite is None else first_nonfinite)

# %%
clip_repairs_nan = poisoned_after == 0
clip_prevents_divergence = first_nonfinite is not None and clipped_finite
# The claim's two readings: clipping repairs a NaN gradient, and clipping prevents a NaN loss.
halves_shown = clip_repairs_nan + clip_prevents_divergence
claims.check("F4", verdict={2: "holds", 1: "partly", 0: "does-not-hold"}[halves_shown], measured={
    "clipping a NaN gradient": {"total norm": nan_total, "NaN gradients before": poisoned_before, "after": poisoned_after},
    "all losses finite at divergence_lr": {"unclipped": first_nonfinite is None, "clipped at 1.0": clipped_finite}})

# %% [markdown]
# **The fix, proven.** Three moves. (1) *Find the source.* Anomaly mode records the forward stack of
# every op and stops at the first backward function that returns NaN (it slows training, so use it
# for a few steps only):

# %%
probe_model = sqrt_model(safe=False)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # anomaly mode warns with the forward traceback; the error names the op
    try:
        with torch.autograd.detect_anomaly():
            F.cross_entropy(probe_model(batch_x), batch_y).backward()
        print("anomaly mode found nothing")
    except RuntimeError as error:
        print("anomaly mode:", error)

# %% [markdown]
# (2) *Guard the step.* Skipping a step whose total norm is not finite keeps the parameters finite,
# as `GradScaler` does. Here it skips every step, which is the guard's way of saying the NaN is
# systematic: fix the op. (3) *Fix the op*: `sign(h) * sqrt(clamp(|h|))` has a finite derivative
# everywhere.

# %%
_, guarded_skips, guarded_finite, _ = train_sqrt_model(safe=False, guard=True)
print(f"guarded: {guarded_skips} of 10 steps skipped; parameters still finite: {guarded_finite}")
safe_losses, safe_skips, safe_finite, safe_alerts = train_sqrt_model(safe=True, guard=True)
print(f"safe op: loss {safe_losses[0]:.3f} -> {safe_losses[-1]:.3f}; {safe_skips} steps skipped; "
      f"{len(safe_alerts)} non-finite alerts; parameters finite: {safe_finite}")

# %% [markdown]
# ## Summary
# - `clip_grad_norm_` clips by the L2 norm unless told otherwise (F1); at one `max_norm` the
#   inf-norm clips least and the L1 norm most, so compare norms only at calibrated thresholds.
# - Value clipping turns the gradient, norm clipping does not; a value clip far above every entry does
#   nothing at all, and neither does a norm clip above the total norm (F2). Log the total norm.
# - L1 clipping showed no robustness benefit over L2 on a spiky small CNN once both thresholds were
#   calibrated; clipping itself was what helped (F3).
# - With a `GradScaler`, call `unscale_` before clipping, or every step shrinks by the loss scale.
# - Clipping bounds a divergence, but multiplies a NaN gradient into every parameter (F4): find the
#   op with anomaly mode or the tracer's `nonfinite` alerts, skip non-finite steps, and fix the op.

# %% [markdown]
# ## Claims checked

# %%
claims.table()


# %% [markdown]
# ## Exercises
# ### Exercise 07.1: clip by the total norm
# `clip_total_norm_(grads, max_norm)` should do what `clip_grad_norm_` does on a list of gradient
# tensors: measure the L2 norm of *all* of them together, scale every tensor in place by
# `max_norm / (total + 1e-6)` when that is below 1, and return the total measured before clipping.
# The version below clips each tensor on its own, which changes the gradient's direction (case F2).

# %%
# planted bug for exercise 07.1
def clip_total_norm_(grads, max_norm):
    """Scale the tensors in `grads` in place so that their joint L2 norm is at most max_norm; return the norm before."""
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    for g in grads:
        norm = g.norm()
        if norm > max_norm:
            g.mul_(max_norm / (norm + 1e-6))
    return total


# %%
# The symptom: after "clipping" at 1.0, the joint norm is still above 1 and the direction has turned.
generator = torch.Generator().manual_seed(seed)
grads = [torch.randn(50, generator=generator, dtype=DTYPE) * scale for scale in (0.01, 0.5, 2.0)]
original = flat(grads).clone()
returned = clip_total_norm_(grads, 1.0)
print(f"returned total {returned:.3f}; joint norm after clipping {flat(grads).norm():.3f}; "
      f"cosine to the original {cosine(flat(grads), original):.3f}")


# %% nbgrader={"grade": false, "grade_id": "exercise_07_1", "locked": false, "schema_version": 3, "solution": true}
# exercise 07.1
def clip_total_norm_(grads, max_norm):
    """Scale the tensors in `grads` in place so that their joint L2 norm is at most max_norm; return the norm before."""
    ### BEGIN SOLUTION
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return total
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_07_1", "locked": true, "points": 1, "schema_version": 3, "solution": false}
grading.check("07.1", clip_total_norm_)


# %% [markdown]
# ### Exercise 07.2: skip a step whose gradient is not finite
# `guarded_step(model, optimizer, max_norm)` should clip the model's gradients with
# `clip_grad_norm_(model.parameters(), max_norm)` and call `optimizer.step()` only when the total
# norm is finite, returning `True` when it stepped and `False` when it skipped. The version below
# guards against an infinite norm only.

# %%
# planted bug for exercise 07.2
def guarded_step(model, optimizer, max_norm):
    """Clip to max_norm, then step only if the total gradient norm is finite; True when it stepped."""
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if total.item() == math.inf:
        return False
    optimizer.step()
    return True


# %%
# The symptom: a NaN gradient goes straight into the weights.
torch.manual_seed(seed)
layer = nn.Linear(3, 1)
layer.weight.grad = torch.tensor([[0.1, float("nan"), 0.2]])
layer.bias.grad = torch.tensor([0.3])
stepped = guarded_step(layer, torch.optim.SGD(layer.parameters(), lr=0.1), 1.0)
print(f"stepped: {stepped}; weights now {layer.weight.data.tolist()}")


# %% nbgrader={"grade": false, "grade_id": "exercise_07_2", "locked": false, "schema_version": 3, "solution": true}
# exercise 07.2
def guarded_step(model, optimizer, max_norm):
    """Clip to max_norm, then step only if the total gradient norm is finite; True when it stepped."""
    ### BEGIN SOLUTION
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if not torch.isfinite(total):
        return False
    optimizer.step()
    return True
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_07_2", "locked": true, "points": 1, "schema_version": 3, "solution": false}
grading.check("07.2", guarded_step)

# %%
grading.score()

# %% [markdown]
# ## Debugging lab 07: norm clipping with a GradScaler on spiking batches
# A new run: a small classifier of sensor readings, trained with a `GradScaler` and norm clipping,
# because every few batches come from a glitching sensor whose readings are multiplied. One thing in
# its clipped step is wrong, drawn for you from this notebook's family. `labs.start` prints what you
# would see, the causes you may choose from (decoys included) and the stages you may rewrite;
# investigate with the run's objects (`lab.model`, `lab.optimizer`, `lab.scaler`, `lab.x`, `lab.y`,
# `lab.losses`, `lab.grad_norms`: each step's unscaled gradient norm), plain PyTorch and labkit's
# instruments (`GradTracer`, `compare_grads`), and `lab.rerun(stage=f)`. Then write `diagnose(lab)`:
# your diagnosis and the stage function you rewrote (lab 00 shows the format). The check reruns the
# training with your stage and compares each step's gradient and the final loss with the same
# training without the defect.

# %% tags=["nbval-ignore-output"]
from labkit import labs

lab = labs.start("07")


# %%
# lab 07: your answer
def diagnose(lab):
    """Your diagnosis (one of lab.causes) and your repair (the stage function you rewrote, named after its stage)."""
    # YOUR CODE HERE
    raise NotImplementedError("Lab 07: replace these two lines with your answer")


# %%
labs.check(lab, diagnose)

# %% [markdown]
# ## What comes next
# [08 · Gradient health: watching every layer's gradient while it trains](08_gradient_health.ipynb):
# clipping treats a symptom; 08 watches every layer's gradient to find where it starts.

# %% [markdown]
# ## Further reading
# - [torch.nn.utils.clip_grad_norm_](https://docs.pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html)
# - [torch.nn.utils.clip_grad_value_](https://docs.pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_value_.html)
# - [Automatic mixed precision examples: gradient clipping](https://docs.pytorch.org/docs/stable/notes/amp_examples.html#gradient-clipping)
# - [Pascanu et al. 2013, On the difficulty of training recurrent neural networks](https://arxiv.org/abs/1211.5063)

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
