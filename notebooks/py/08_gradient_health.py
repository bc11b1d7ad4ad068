# %% [markdown]
# # 08 · Gradient health: watching every layer's gradient while it trains
#
# A loss curve tells you *that* training went wrong; per-layer gradient statistics can tell you
# *where*. This notebook teaches `labkit.GradTracer` on networks that go wrong (vanishing, saturated,
# dead, missing, exploding), then measures five claims about gradient monitoring: how early gradients
# warn, what a hook sees, why a bias gradient can be zero, what a broken skip connection looks like,
# and how small LayerNorm gradients really are.

# %%
import sys

try:  # labkit holds the workbook's instruments; without it, say how to install it (Colab: install it)
    import labkit  # noqa: F401
except ModuleNotFoundError as missing:
    LABKIT = "labkit[lab] @ git+https://github.com/gradient-lab/gradient-lab"
    if "google.colab" not in sys.modules:
        raise ModuleNotFoundError(f'{missing}. Install the workbook for this kernel: `make setup` in the '
                                  f'repository (README, Install), or "{sys.executable}" -m pip install "{LABKIT}"') from None
    import subprocess

    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", LABKIT], check=True)

import collections
import math
import statistics

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from labkit import (GradTracer, claims, compare_grads, datasets, grading, plot_grad_flow, plot_grad_histograms,
                    plot_grad_stat, repro)
from labkit.probes import fingerprint, format_fingerprint, measure_time
from labkit.progress import track

# %% [markdown]
# ## Parameters
# `steps` minibatch SGD steps train the MLP of case L1, whose learning rate warms up from `lr` by a
# factor `lr_growth` per step. With `bug=True` the warm-up never stops (the schedule forgets its
# cap); with `bug=False` it stops at `lr_cap`. `width` is the hidden width of the small MLPs;
# `micro_batches` is how many backward passes case L2 accumulates per step; `timing_seconds` is how
# long each variant of the cost comparison runs.

# %% tags=["parameters"]
seed = 0
device = "auto"
width = 64
steps = 200
lr = 0.02
lr_growth = 1.03
lr_cap = 0.3
micro_batches = 3
timing_seconds = 0.2
bug = True

# %%
dev = repro.setup(seed=seed, device=device)

# %%
# NBVAL_IGNORE_OUTPUT
print(format_fingerprint(fingerprint()))

# %% [markdown]
# Models run on `dev` in float64, so a CPU and a GPU print the same rounded numbers. The data are
# scikit-learn's handwritten digits (64 pixels in [0, 1], 10 classes).

# %%
DTYPE = torch.float64
digits = datasets.digits().to(dev)
x_train, y_train = digits.x_train.to(DTYPE), digits.y_train
print(f"{len(y_train)} training digits, {digits.classes} classes")


def on_device(module):
    """Move a freshly built module to the notebook's device and dtype."""
    return module.to(dev, DTYPE)


# %% [markdown]
# ## The instrument: `GradTracer` on a network that goes wrong
# `GradTracer(model, optimizer)` hooks every parameter with PyTorch's
# `register_post_accumulate_grad_hook` and closes a step when `optimizer.step()` runs. Each step it
# records, per parameter, the gradient's norm, mean, std and largest |g| (and every `full_every`
# steps a histogram). `activations=True` adds forward hooks that measure how many tanh/sigmoid
# outputs are saturated and how many ReLU units never fire; `update_ratio=True` records
# `||Δp|| / ||p||`, how far each step moved each parameter relative to its size.
#
# The patient: a digits classifier with four faults planted on purpose. Its first layer's weights
# are 8x too large (the tanh behind it saturates), six sigmoid layers sit in a row (each multiplies
# the gradient by at most 1/4), the ReLU gate has a negative bias (most units never fire), and an
# auxiliary head is built but never used.

# %%
class Patient(nn.Module):
    """A digits classifier; `healthy=False` plants four faults (see the text above)."""

    def __init__(self, healthy):
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.stem_act = nn.Tanh()
        depth, act = (2, nn.ReLU) if healthy else (6, nn.Sigmoid)
        self.deep = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), act())])
        self.gate = nn.Linear(width, width)
        self.gate_act = nn.ReLU()
        self.head = nn.Linear(width, 10)
        if not healthy:
            self.aux_head = nn.Linear(width, 10)
            with torch.no_grad():
                self.stem.weight.mul_(8.0)
                self.gate.bias.fill_(-0.3)

    def forward(self, x):
        return self.head(self.gate_act(self.gate(self.deep(self.stem_act(self.stem(x))))))


def examine(healthy, examine_steps=20):
    """Full-batch SGD under a tracer with every option on; returns the tracer."""
    torch.manual_seed(seed)
    model = on_device(Patient(healthy))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradTracer(model, optimizer, activations=True, update_ratio=True, full_every=5) as tracer:
        for _ in range(examine_steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[:512]), y_train[:512]).backward()
            optimizer.step()
    return tracer


patient = examine(healthy=False)
alert_kinds = collections.Counter(alert.kind for alert in patient.alerts())
print(f"alerts over {patient.steps} steps, by kind: {dict(alert_kinds)}")
for kind in alert_kinds:
    print(" first", kind, "->", patient.alerts(kind)[0])

# %% [markdown]
# **Per-layer gradient std, on a log scale.** The tracer's history is one record per parameter per
# step. Down the sigmoid stack the gradient shrinks layer by layer: the vanishing alerts above.

# %%
last_step = [r for r in patient.history() if r["step"] == patient.steps - 1]
for record in last_step:
    std = "no gradient" if record["missing"] else f"{record['std']:.1e}"
    print(f"{record['param']:<15} grad std {std}")
by_name = {r["param"]: r for r in last_step}
print(f"head.weight / stem.weight gradient std: {by_name['head.weight']['std'] / by_name['stem.weight']['std']:.1e}")
figure = plot_grad_flow(patient)
plt.show()

# %% [markdown]
# **Activations: saturation and dead units.** `activation_history()` gives, per module and step, the
# share of tanh/sigmoid outputs whose derivative is under 2 % of its peak (`saturated`) and the share
# of ReLU units that were zero for every sample of the step (`dead`).

# %%
for row in patient.activation_history():
    if row["step"] == patient.steps - 1 and (row["saturated"] or row["dead"]):
        measure = f"saturated {row['saturated']:.0%}" if row["kind"] != "ReLU" else f"dead {row['dead']:.0%}"
        print(f"{row['module']:<9} {row['kind']:<8} {measure}")

# %% [markdown]
# **Update:data ratio.** A common rule of thumb says a training step should move a weight matrix by
# about 1e-3 of its size. Here the layers below the sigmoid stack barely move at all:

# %%
figure = plot_grad_stat(patient, "update_ratio", params=["stem.weight", "deep.4.weight", "gate.weight", "head.weight"])
figure.axes[0].set_title("update:data ratio per step (log scale)")
plt.show()
first_layer_ratio = statistics.median(r["update_ratio"] for r in patient.history() if r["param"] == "stem.weight")
head_ratio = statistics.median(r["update_ratio"] for r in patient.history() if r["param"] == "head.weight")
print(f"median update:data ratio: stem.weight {first_layer_ratio:.1e}, head.weight {head_ratio:.1e}")

# %% [markdown]
# **Histograms** (recorded on full-statistics steps) show the shape of each gradient: a spike at
# zero, a long tail, or the NaNs a histogram leaves out.

# %%
figure = plot_grad_histograms(patient, params=["stem.weight", "deep.10.weight", "gate.weight", "head.weight"])
plt.show()

# %% [markdown]
# **The healthy twin** (default initialisation, ReLU instead of the sigmoid stack, no unused head)
# gives no alerts:

# %%
twin = examine(healthy=True)
twin_dead = max(row["dead"] for row in twin.activation_history() if row["dead"] is not None)
print(f"healthy twin: {len(twin.alerts())} alerts; largest dead-ReLU share {twin_dead:.0%}")

# %% [markdown]
# ## Case L2: a per-parameter `register_post_accumulate_grad_hook`
# **The claim**, in the catalogue's words:

# %%
print(claims.case("L2").claim)


# %% [markdown]
# **Reproduce.** A hook on each parameter of a small MLP that reads the norm, mean and std of
# `param.grad`, then one optimizer step made of `micro_batches` backward passes (gradient
# accumulation). We count the calls and compare the last reading with the final `.grad`.

# %%
def small_mlp():
    torch.manual_seed(seed)
    return on_device(nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10)))


hook_model = small_mlp()
calls, last_reading = collections.Counter(), {}


def reading_hook(name):
    def hook(param):
        calls[name] += 1
        grad = param.grad
        last_reading[name] = (grad.norm().item(), grad.mean().item(), grad.std().item())

    return hook


handles = [p.register_post_accumulate_grad_hook(reading_hook(n)) for n, p in hook_model.named_parameters()]
hook_model.zero_grad()
for micro in range(micro_batches):
    part = slice(64 * micro, 64 * (micro + 1))
    F.cross_entropy(hook_model(x_train[part]), y_train[part]).backward()
for handle in handles:
    handle.remove()
final_norms = {n: p.grad.norm().item() for n, p in hook_model.named_parameters()}
print("calls per parameter:", dict(calls))
print("last reading == final .grad norm:", all(last_reading[n][0] == final_norms[n] for n in final_norms))

# %% [markdown]
# The hook fires once per parameter per backward pass, after that pass has added into `.grad`, so
# its last call sees the gradient the optimizer will use. One way to misuse it is to print *every*
# parameter from *each* parameter's hook: that reads P² values per backward pass, and the
# parameters whose turn has not come yet show a gradient that is not this pass's.

# %%
stale_reads, total_reads = 0, 0


def read_everything_hook(param):
    global stale_reads, total_reads
    for other in hook_model.parameters():
        total_reads += 1
        stale_reads += other.grad is None


handles = [p.register_post_accumulate_grad_hook(read_everything_hook) for p in hook_model.parameters()]
hook_model.zero_grad()
F.cross_entropy(hook_model(x_train[:64]), y_train[:64]).backward()
for handle in handles:
    handle.remove()
print(f"one backward pass, every hook reading every parameter: {total_reads} reads, {stale_reads} found no gradient yet")

# %% [markdown]
# `GradTracer` is this hook done once per parameter: it reduces the gradient on the device and
# reads all statistics in one transfer per step. Its record says how many backward passes
# accumulated into the step:

# %%
tracer_model = small_mlp()
optimizer = torch.optim.SGD(tracer_model.parameters(), lr=0.1)
with GradTracer(tracer_model, optimizer) as tracer:
    optimizer.zero_grad()
    for micro in range(micro_batches):
        part = slice(64 * micro, 64 * (micro + 1))
        F.cross_entropy(tracer_model(x_train[part]), y_train[part]).backward()
    traced_norms = {n: p.grad.norm().item() for n, p in tracer_model.named_parameters()}
    optimizer.step()
records = tracer.history()
print("accumulations per parameter:", {r["param"]: r["accumulations"] for r in records})
print("tracer norm == .grad norm before the step:", all(math.isclose(r["norm"], traced_norms[r["param"]], rel_tol=1e-12) for r in records))

# %%
fires_once_per_pass = set(calls.values()) == {micro_batches}
sees_final_grad = all(last_reading[n][0] == final_norms[n] for n in final_norms)
claims.check(
    "L2",
    verdict="holds" if fires_once_per_pass and sees_final_grad else "does-not-hold",
    evidence=(
        f"with {micro_batches} backward passes per step the hook fired {micro_batches} times per parameter, and its "
        f"last reading equals the final .grad exactly; reading every parameter from every hook made {total_reads} "
        f"reads per pass, {stale_reads} of them before that parameter had its gradient"
    ),
)

# %% [markdown]
# ## Case L1: do gradient statistics warn 200–500 steps before the loss?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("L1").claim)


# %% [markdown]
# **The monitor the article describes**, written here from its description: after each backward,
# copy every gradient to NumPy, sample at most 100,000 values, record std, mean, min, max and
# sparsity, and alert when a parameter's std exceeds 3x the mean of its previous 5 readings.

# %%
class NumpyMonitor:
    """The article's gradient monitor, from its description (our code). Call observe(model, step)
    after backward; `alerts` holds (step, parameter, std)."""

    def __init__(self, sample=100_000, factor=3.0, window=5, rng_seed=0):
        self.sample, self.factor, self.window = sample, factor, window
        self.rng = np.random.default_rng(rng_seed)
        self.readings = collections.defaultdict(list)
        self.alerts = []

    def observe(self, model, step):
        for name, param in model.named_parameters():
            if param.grad is None:
                continue  # as described: only parameters that have a gradient are read
            values = self.values_of(param.grad)
            std = float(values.std())
            previous = [r["std"] for r in self.readings[name][-self.window:]]
            if len(previous) == self.window and std > self.factor * np.mean(previous):
                self.alerts.append((step, name, std))
            self.readings[name].append({"step": step, "std": std, "mean": float(values.mean()),
                                        "min": float(values.min()), "max": float(values.max()),
                                        "sparsity": float((np.abs(values) < 1e-8).mean())})

    def values_of(self, grad):
        # .copy(): on a GPU this is the device-to-host transfer; on a CPU .numpy() would share memory
        values = grad.detach().cpu().numpy().reshape(-1).copy()
        if values.size > self.sample:
            values = self.rng.choice(values, self.sample, replace=False)
        return values


# %% [markdown]
# **Reproduce: a run that goes wrong.** A tanh MLP trained with minibatch SGD and a learning-rate
# warm-up that multiplies the rate by `lr_growth` each step. With `bug=True` the warm-up forgets its
# cap, so the rate keeps growing until training blows up. The tracer and the monitor watch the same
# run. The loss "shows it" at the first step where its 10-step average is more than twice the lowest
# 10-step average so far.

# %%
def warmup_lr(step, capped):
    rate = lr * lr_growth**step
    return min(rate, lr_cap) if capped else rate


def run_with_monitors(capped, label):
    torch.manual_seed(seed)
    model = on_device(nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    monitor, batches, losses = NumpyMonitor(rng_seed=seed), torch.Generator().manual_seed(seed), []
    with GradTracer(model, optimizer, update_ratio=True, full_every=0) as tracer:
        for step in track(range(steps), label, updates=2):
            for group in optimizer.param_groups:
                group["lr"] = warmup_lr(step, capped)
            index = torch.randint(0, len(y_train), (128,), generator=batches).to(dev)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[index]), y_train[index])
            loss.backward()
            monitor.observe(model, step)
            optimizer.step()
            losses.append(loss.item())
    return losses, tracer, monitor


def loss_alarm(losses, factor=2.0, window=10):
    """The first step at which the mean of the last `window` losses exceeds `factor` x the lowest such
    mean so far (None if never): a minibatch loss is noisy, so single batches do not count."""
    lowest = math.inf
    for step in range(window - 1, len(losses)):
        recent = statistics.fmean(losses[step - window + 1: step + 1])
        if recent > factor * lowest:
            return step
        lowest = min(lowest, recent)
    return None


losses, run_tracer, monitor = run_with_monitors(capped=not bug, label=f"warm-up run (bug={bug})")
exploding = run_tracer.alerts("exploding")
tracer_step = exploding[0].step if exploding else None
monitor_step = monitor.alerts[0][0] if monitor.alerts else None
loss_step = loss_alarm(losses)
diverged = not statistics.fmean(losses[-10:]) < 10 * min(losses)  # written so that a NaN loss counts too
print(f"bug={bug}: loss {losses[0]:.3f} -> lowest {min(losses):.3f}; diverged (last 10 losses average over "
      f"10x the lowest): {diverged}")
print(f"loss alarm at step {loss_step}; first tracer 'exploding' alert at step {tracer_step}; "
      f"first monitor alert at step {monitor_step}")
claims.metric("diverged", diverged)
claims.metric("first_exploding_alert", "none" if tracer_step is None else tracer_step)

# %% [markdown]
# **Measure.** The gradient norm of every layer on a log scale, with the step where the loss alarm
# went off (red) and the tracer's first alert (black); below it, the update:data ratio, which grows
# with the learning rate from the first step on.

# %%
figure = plot_grad_stat(run_tracer, "norm")
axis = figure.axes[0]
for step, colour in ((loss_step, "red"), (tracer_step, "black")):
    if step is not None:
        axis.axvline(step, color=colour, linestyle="--")
axis.set_title(f"gradient norm per step (bug={bug}); red: loss alarm, black: first tracer alert")
plt.show()
figure = plot_grad_stat(run_tracer, "update_ratio", params=["0.weight", "4.weight"])
figure.axes[0].set_title("update:data ratio per step")
plt.show()
ratios = [r["update_ratio"] for r in run_tracer.history() if r["param"] == "0.weight"]
at_alarm = ratios[loss_step] if loss_step is not None else ratios[-1]
print(f"first layer update:data ratio: step 0 {ratios[0]:.1e}, at the loss alarm {at_alarm:.1e}")


# %% [markdown]
# **What the monitor misses.** Three gradient failures that a loss curve hides at first, fed to both
# instruments on a fixed model without an optimizer (so nothing changes but the batch): an unused
# layer (no gradient at all), a batch holding a NaN at step 6, and a batch of inputs 100x too large
# at step 9.

# %%
class WithUnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
        self.unused = nn.Linear(width, 10)  # built, never called in forward

    def forward(self, x):
        return self.body(x)


torch.manual_seed(seed)
blind_model = on_device(WithUnusedLayer())
blind_monitor = NumpyMonitor(rng_seed=seed)
with GradTracer(blind_model) as blind_tracer:
    for step in range(12):
        x = x_train[64 * step: 64 * (step + 1)].clone()
        if step == 6:
            x[0, 0] = math.nan
        if step == 9:
            x = x * 100.0
        blind_model.zero_grad()
        F.cross_entropy(blind_model(x), y_train[64 * step: 64 * (step + 1)]).backward()
        blind_monitor.observe(blind_model, step)
        blind_tracer.step()
tracer_kinds = {kind: sorted({a.step for a in blind_tracer.alerts(kind)}) for kind in ("missing", "nonfinite", "exploding")}
print("tracer alerts, steps by kind:", {k: (v[:3] + ["..."] if len(v) > 3 else v) for k, v in tracer_kinds.items()})
print("monitor alerts:", blind_monitor.alerts)
print("monitor's last 5 std readings of body.0.weight before step 9:",
      [round(r["std"], 5) for r in blind_monitor.readings["body.0.weight"][4:9]])

# %% [markdown]
# The NaN step raised nothing (`NaN > 3 x mean` is false), and once a NaN entered the monitor's
# history, the mean of its last 5 readings stayed NaN, so the 100x batch at step 9 went unseen too.
# The unused layer has no `.grad`, and the monitor skips it.
#
# **Sampling** hides a sparse spike. An embedding's gradient is mostly zero; if a handful of entries
# spike, a 100,000-value sample of a 400,000-value tensor often contains none of them.

# %%
rows, dim, spiked_entries = 12_500, 32, 4
embedding = on_device(nn.Embedding(rows, dim))
rng = torch.Generator().manual_seed(seed)


def embedding_backward(spike):
    """Backward a loss whose gradient touches 100 rows of the embedding; `spike` adds 4 entries of 5.0."""
    touched = torch.randperm(rows, generator=rng)[:100].to(dev)
    coefficients = 0.01 * torch.randn(100, dim, generator=rng, dtype=DTYPE).to(dev)
    if spike:
        coefficients[0, :spiked_entries] = 5.0
    embedding.zero_grad()
    (embedding(touched) * coefficients).sum().backward()


with GradTracer(embedding) as embedding_tracer:
    for step in range(6):
        embedding_backward(spike=step == 5)
        embedding_tracer.step()
    spike_grad = embedding.weight.grad.clone()
baseline_std = statistics.mean(r["std"] for r in embedding_tracer.history() if r["step"] < 5)
trials = 20
sampled_misses = sum(float(NumpyMonitor(rng_seed=trial).values_of(spike_grad).std()) <= 3 * baseline_std
                     for trial in range(trials))
sample_share = 100_000 / (rows * dim)
print(f"full std jumps {spike_grad.std().item() / baseline_std:.0f}x; tracer alerts: "
      f"{[a.kind for a in embedding_tracer.alerts()]}")
print(f"the sampled std missed the 3x jump in {sampled_misses} of {trials} samples "
      f"(chance that no spiked entry is sampled: {(1 - sample_share) ** spiked_entries:.0%})")

# %% [markdown]
# **Cost.** The monitor moves every gradient to the host and reduces it in NumPy; the tracer reduces
# on the device and makes one transfer per step. `benchmarks/tracer_overhead.py` measured this on a
# 4.8M-parameter MLP on the workbook's 2-core CPU machine (`benchmarks/results/tracer_overhead.md`):
# a step with the default `GradTracer` took 1.02–1.05x a plain step, and with the NumPy monitor
# 1.23–1.34x. On a GPU the monitor's copies also force a device-to-host synchronisation per tensor.
# Timings depend on the machine, so nbval ignores this cell, a smaller version of that comparison:

# %%
# NBVAL_IGNORE_OUTPUT
torch.manual_seed(seed)
cost_model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(dev)
cost_optimizer = torch.optim.SGD(cost_model.parameters(), lr=1e-3)
cost_x, cost_y = digits.x_train[:128], digits.y_train[:128]
cost_monitor = NumpyMonitor()


def plain_step(observe=None):
    cost_optimizer.zero_grad()
    F.cross_entropy(cost_model(cost_x), cost_y).backward()
    if observe is not None:
        observe(cost_model, 0)
    cost_optimizer.step()


plain = measure_time(plain_step, device=dev, min_run_time=timing_seconds)
with GradTracer(cost_model, cost_optimizer):
    traced = measure_time(plain_step, device=dev, min_run_time=timing_seconds)
monitored = measure_time(lambda: plain_step(cost_monitor.observe), device=dev, min_run_time=timing_seconds)
for label, timing in (("plain step", plain), ("with GradTracer", traced), ("with the NumPy monitor", monitored)):
    print(f"{label:<23} {timing.median_s * 1e3:7.2f} ms  ({timing.median_s / plain.median_s:.2f}x plain)")

# %%
lead_tracer = None if tracer_step is None or loss_step is None else loss_step - tracer_step
lead_monitor = None if monitor_step is None or loss_step is None else loss_step - monitor_step
leads = [lead for lead in (lead_tracer, lead_monitor) if lead is not None]
early_enough = bool(leads) and max(leads) >= 200
claims.check(
    "L1",
    verdict="holds" if early_enough else "does-not-hold",
    evidence=(
        f"on a warm-up run whose learning rate grows {lr_growth:g}x per step, the loss alarm went off at step "
        f"{loss_step}, the tracer's first exploding alert at {tracer_step} and the NumPy monitor's at {monitor_step} "
        f"(leads {lead_tracer} and {lead_monitor} steps, not 200-500); on a NaN batch followed by a 100x batch the "
        f"monitor raised {len(blind_monitor.alerts)} alerts where the tracer flagged steps {tracer_kinds['nonfinite']} "
        f"(non-finite) and {tracer_kinds['exploding']} (exploding), it skipped an unused layer, and its sampled std "
        f"missed a sparse {spiked_entries}-entry spike in {sampled_misses} of {trials} samples; its cost, from "
        f"benchmarks/results/tracer_overhead.md: 1.23-1.34x a plain CPU step, against 1.02-1.05x for GradTracer"
    ),
)

# %% [markdown]
# **The fix, proven.** Cap the warm-up (`bug=False` in the parameters cell). Rerun with it:

# %%
capped_losses, capped_tracer, capped_monitor = run_with_monitors(capped=True, label="capped warm-up")
print(f"capped warm-up: loss {capped_losses[0]:.3f} -> {capped_losses[-1]:.3f}; loss alarm: {loss_alarm(capped_losses)}; "
      f"{len(capped_tracer.alerts('exploding'))} tracer 'exploding' alerts, {len(capped_monitor.alerts)} monitor alerts")

# %% [markdown]
# ## Case L3: can Dropout zero the bias gradient behind it?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("L3").claim)


# %% [markdown]
# **Reproduce.** `Dropout(p)` in front of a Linear `fc`, on one batch, with p = 0.5 and p = 0. For
# `y = x W^T + b`, the bias gradient is the output gradient summed over the batch,
# `dL/db = Σ_n dL/dy_n`: the input `x`, and with it the dropout mask, does not appear in it.

# %%
def dropout_model(p):
    # On the CPU: dropout draws its mask from the device's generator, and a GPU's draws other masks.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Dropout(p), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(DTYPE)


bias_stats = {}
for p in (0.5, 0.0):
    model = dropout_model(p)
    with GradTracer(model, full_every=1) as tracer:
        hidden = model[1](model[0](x_train[:128].cpu()))
        hidden.retain_grad()
        F.cross_entropy(model[3](model[2](hidden)), y_train[:128].cpu()).backward()
        tracer.step()
    record = next(r for r in tracer.history() if r["param"] == "1.bias")
    bias_stats[p] = record
    summed = compare_grads({"fc.bias": model[1].bias.grad}, {"fc.bias": hidden.grad.sum(0)})
    print(f"Dropout(p={p}): fc.bias grad std {record['std']:.3g}, zero share {record['zero_frac']:.0%}; "
          f"equals the summed output gradient exactly: {summed.all_exact}")


# %% [markdown]
# **Measure what really makes a bias gradient's std zero.** Three suspects, each traced:
# a BatchNorm right after the Linear (it subtracts each unit's batch mean, so a constant shift, which
# is what a bias is, cannot change the loss), a ReLU whose units are all dead for the batch, and a
# bias with a single entry (a sample std needs two values).

# %%
def bias_record(model, layer_name):
    with GradTracer(model, full_every=1) as tracer:
        F.cross_entropy(model(x_train[:128]), y_train[:128]).backward()
        tracer.step()
    return next(r for r in tracer.history() if r["param"] == f"{layer_name}.bias")


torch.manual_seed(seed)
suspects = {
    "Linear -> BatchNorm1d": (on_device(nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))), "0"),
    "Linear -> all-dead ReLU": (on_device(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))), "0"),
    "single-entry bias": (on_device(nn.Sequential(nn.Linear(64, 1), nn.Linear(1, 10))), "0"),
}
with torch.no_grad():
    suspects["Linear -> all-dead ReLU"][0][0].bias.fill_(-100.0)
def size(value):
    """A gradient statistic as text; values under 1e-12 are float rounding noise, so only their bound is shown."""
    return "< 1e-12" if 0 < abs(value) < 1e-12 else f"{value:.2g}"


suspect_std = {}
for label, (model, layer_name) in suspects.items():
    record = bias_record(model, layer_name)
    suspect_std[label] = size(record["std"])
    print(f"{label:<24} bias grad std {size(record['std'])}, largest |g| {size(record['max_abs'])}")

# %%
dropout_std = bias_stats[0.5]["std"]
claims.check(
    "L3",
    verdict="does-not-hold" if dropout_std > 0 and bias_stats[0.5]["zero_frac"] == 0 else "holds",
    evidence=(
        f"with Dropout(0.5) in front, fc.bias's gradient std was {dropout_std:.2g} (no zero entries; "
        f"{bias_stats[0.0]['std']:.2g} without dropout), and it equals the batch sum of the output gradient "
        f"exactly, which no input mask enters; std 0 comes from a BatchNorm after the layer "
        f"({suspect_std['Linear -> BatchNorm1d']}) or all units dead ({suspect_std['Linear -> all-dead ReLU']}); "
        f"a one-entry bias gives {suspect_std['single-entry bias']}"
    ),
)

# %% [markdown]
# **The fix.** A zero bias-gradient std points *downstream*: a normalisation that makes the bias
# redundant (drop the bias: `nn.Linear(..., bias=False)` before BatchNorm) or dead units (check the
# tracer's `dead` share). Moving the Dropout changes nothing about it.

# %% [markdown]
# ## Case L4: does a broken skip connection push decoder gradients below 1e-6?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("L4").claim)

# %% [markdown]
# **Reproduce.** A small U-Net that denoises digit images: two encoder convolutions, a 2x
# downsampling, a decoder that concatenates the upsampled bottleneck with a *lateral* 1x1 convolution
# of the first encoder stage (the skip), and an output convolution. The broken wiring detaches the
# skip tensor, as happens when features kept for logging are reused.

# %%
images = datasets.digits(images=True).to(dev)


class SmallUNet(nn.Module):
    def __init__(self, detach_skip):
        super().__init__()
        self.detach_skip = detach_skip
        self.enc1 = nn.Conv2d(1, 8, 3, padding=1)
        self.enc2 = nn.Conv2d(8, 16, 3, padding=1)
        self.lateral = nn.Conv2d(8, 8, 1)
        self.dec1 = nn.Conv2d(16 + 8, 8, 3, padding=1)
        self.dec2 = nn.Conv2d(8, 8, 3, padding=1)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        early = F.relu(self.enc1(x))
        bottom = F.relu(self.enc2(F.avg_pool2d(early, 2)))
        skip = self.lateral(early)
        if self.detach_skip:
            skip = skip.detach()
        merged = torch.cat([F.interpolate(bottom, scale_factor=2), skip], dim=1)
        return self.out(F.relu(self.dec2(F.relu(self.dec1(merged)))))


def train_unet(detach_skip, unet_steps=30):
    torch.manual_seed(seed)
    model = on_device(SmallUNet(detach_skip))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    noise = torch.Generator().manual_seed(seed)
    with GradTracer(model, optimizer, full_every=10) as tracer:
        for _ in range(unet_steps):
            index = torch.randint(0, len(images.y_train), (64,), generator=noise).to(dev)
            clean = images.x_train[index].to(DTYPE)
            noisy = clean + 0.3 * torch.randn(clean.shape, generator=noise, dtype=DTYPE).to(dev)
            optimizer.zero_grad()
            loss = F.mse_loss(model(noisy), clean)
            loss.backward()
            optimizer.step()
    return tracer, loss.item()


DECODER = ("dec1.weight", "dec2.weight", "out.weight")
unet_flow = {}
for detach_skip in (True, False):
    tracer, final_loss = train_unet(detach_skip)
    last_full = [r for r in tracer.history() if r["step"] == 20]
    decoder_mean = min(r["mean_abs"] for r in last_full if r["param"] in DECODER)
    missing = sorted({a.name for a in tracer.alerts("missing")})
    unet_flow[detach_skip] = (tracer, decoder_mean, missing, final_loss)
    print(f"skip detached={detach_skip}: smallest decoder mean |grad| {decoder_mean:.1e}; "
          f"parameters with no gradient: {missing}; final loss {final_loss:.4f}")

# %% [markdown]
# **Measure.** `plot_grad_flow` of the broken model at step 20: bars of max and mean |grad| per
# parameter on a log scale, and "no grad" under the parameters that got none.

# %%
figure = plot_grad_flow(unet_flow[True][0], step=20)
plt.show()

# %%
broken_decoder, healthy_decoder = unet_flow[True][1], unet_flow[False][1]
exposed = "lateral.weight" in unet_flow[True][2] and not unet_flow[False][2]
below = broken_decoder < 1e-6
claims.check(
    "L4",
    verdict="holds" if below and exposed else ("partly" if exposed else "does-not-hold"),
    evidence=(
        f"detaching the skip of a small U-Net left the decoder's smallest mean |grad| at {broken_decoder:.1e} "
        f"({healthy_decoder:.1e} when wired correctly), nowhere near 1e-6; what the flow plot did show is "
        f"'no grad' on {', '.join(unet_flow[True][2])}, and the tracer raised 'missing' alerts for them"
    ),
)

# %% [markdown]
# **The fix, proven.** Concatenate the live skip tensor (no `detach()`): the correctly wired model
# above got a gradient in every parameter (`missing` list empty). Decoder gradients far below 1e-6
# would point elsewhere, for example at dead units feeding the decoder; the tour at the top showed how
# the tracer reports those.

# %% [markdown]
# ## Case L5: are LayerNorm gradients 100–1000x smaller than weight gradients?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("L5").claim)


# %% [markdown]
# **Reproduce.** A small transformer-style MLP on digits: an input projection, two pre-LayerNorm
# residual blocks (`x + W2 gelu(W1 LN(x))`, hidden 4x wider), a final LayerNorm and a head, trained
# with AdamW at three widths. Compare the LayerNorm γ/β gradients with the block weights' in two ways:
# the norm, which grows with the number of entries, and the per-entry RMS (`norm / sqrt(numel)`).

# %%
class Block(nn.Module):
    def __init__(self, block_width):
        super().__init__()
        self.norm = nn.LayerNorm(block_width)
        self.up = nn.Linear(block_width, 4 * block_width)
        self.down = nn.Linear(4 * block_width, block_width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def ln_ratios(block_width, at_steps=(0, 19)):
    """(norm ratio, RMS ratio) of block weights over LayerNorm parameters, medians, at each step in at_steps."""
    torch.manual_seed(seed)
    model = on_device(nn.Sequential(nn.Linear(64, block_width), Block(block_width), Block(block_width),
                                 nn.LayerNorm(block_width), nn.Linear(block_width, 10)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.Generator().manual_seed(seed)
    with GradTracer(model, optimizer, full_every=0) as tracer:
        for _ in range(max(at_steps) + 1):
            index = torch.randint(0, len(y_train), (128,), generator=batches).to(dev)
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[index]), y_train[index]).backward()
            optimizer.step()
    ratios = {}
    for step in at_steps:
        rows = [r for r in tracer.history() if r["step"] == step]
        norms = [r for r in rows if ".norm." in r["param"] or r["param"].startswith("3.")]
        weights = [r for r in rows if r["param"].endswith(("up.weight", "down.weight"))]
        ratios[step] = (statistics.median(r["norm"] for r in weights) / statistics.median(r["norm"] for r in norms),
                        statistics.median(rms(r) for r in weights) / statistics.median(rms(r) for r in norms))
    return ratios


def rms(record):
    return record["norm"] / math.sqrt(record["numel"])


ln_table = {w: ln_ratios(w) for w in track((32, 64, 128), "LayerNorm widths", updates=1)}
for block_width, by_step in ln_table.items():
    cells = "; ".join(f"step {s}: norm ratio {n:5.1f}, RMS ratio {r:.2f}" for s, (n, r) in by_step.items())
    print(f"width {block_width:>3} (weight has {4 * block_width * block_width:>6} entries, γ has {block_width}): {cells}")

# %% [markdown]
# The norm ratio grows with the width, about as `sqrt(numel(W) / numel(γ)) = sqrt(4·width)` does
# (11 at width 32, 23 at 128); per entry, the two gradients are the same size. A 100x norm ratio
# needs a width near 2,500 from the entry count alone.

# %%
norm_ratios = [n for by_step in ln_table.values() for n, _ in by_step.values()]
rms_ratios = [r for by_step in ln_table.values() for _, r in by_step.values()]
per_entry_holds = min(rms_ratios) >= 100
norm_holds = min(norm_ratios) >= 100
claims.check(
    "L5",
    verdict="holds" if per_entry_holds else ("partly" if norm_holds else "does-not-hold"),
    evidence=(
        f"in a pre-LN MLP block on digits at widths 32-128, block weight / LayerNorm gradient norm ratios were "
        f"{min(norm_ratios):.0f}-{max(norm_ratios):.0f} (growing like sqrt(numel), not 100-1000) and per-entry "
        f"RMS ratios {min(rms_ratios):.2f}-{max(rms_ratios):.2f}; the ResNet-50 conv1 range (0.01-0.3) is "
        f"untestable here: no ResNet-50 weights or ImageNet data, and a grad norm depends on loss scale, batch "
        f"and training stage"
    ),
)


# %% [markdown]
# **The fix.** Compare gradient sizes per entry (RMS, or the tracer's `std`), not by norm, when two
# parameters have different numbers of entries; and set alert thresholds from your own run's history
# rather than from another model's "normal range".

# %% [markdown]
# ## Exercises
# ### Exercise 08.1: read the accumulated gradient
# `record_grad_norms(model)` should register, on every parameter, a hook that stores the norm of that
# parameter's *accumulated* gradient (what `.grad` holds after the backward pass) in a dict under the
# parameter's name, and return the dict and the hook handles. The version below uses
# `Tensor.register_hook`, which sees only the gradient arriving from the current backward pass.

# %%
# planted bug for exercise 08.1
def record_grad_norms(model):
    """Hooks that keep, per parameter name, the norm of its accumulated .grad; returns (norms, handles)."""
    norms, handles = {}, []
    for name, param in model.named_parameters():
        def store(grad, name=name):
            norms[name] = grad.norm().item()
        handles.append(param.register_hook(store))
    return norms, handles


# %%
# The symptom: with three micro-batches the recorded norm is not the norm of .grad.
torch.manual_seed(seed)
demo = nn.Linear(4, 2)
norms, handles = record_grad_norms(demo)
for _ in range(3):
    demo(torch.randn(8, 4)).pow(2).mean().backward()
print(f"recorded {norms['weight']:.4f}, but weight.grad has norm {demo.weight.grad.norm():.4f}")
for handle in handles:
    handle.remove()


# %% nbgrader={"grade": false, "grade_id": "exercise_08_1", "locked": false, "schema_version": 3, "solution": true}
# exercise 08.1
def record_grad_norms(model):
    """Hooks that keep, per parameter name, the norm of its accumulated .grad; returns (norms, handles)."""
    ### BEGIN SOLUTION
    norms, handles = {}, []
    for name, param in model.named_parameters():
        def store(tensor, name=name):
            norms[name] = tensor.grad.norm().item()
        handles.append(param.register_post_accumulate_grad_hook(store))
    return norms, handles
    ### END SOLUTION


# %%
grading.check("08.1", record_grad_norms)


# %% [markdown]
# ### Exercise 08.2: a spike alert that sees NaN
# `spike_alert(history, current, factor=3.0, window=5)` should return `True` when `current` is not
# finite, or when it exceeds `factor` times the mean of the last `window` *finite* readings in
# `history`; with fewer than `window` finite readings a finite `current` gives `False`. It must not
# change `history`. The version below is the monitor's rule, which case L1 showed to be blind to NaN.

# %%
# planted bug for exercise 08.2
def spike_alert(history, current, factor=3.0, window=5):
    """True when `current` is non-finite or above factor x the mean of the last `window` finite readings."""
    if len(history) < window:
        return False
    return current > factor * np.mean(history[-window:])


# %%
# The symptom: a NaN reading raises nothing, and after it a 100x jump raises nothing either.
readings = [1.0, 1.1, 0.9, 1.0, 1.0]
print("NaN reading alerts:", spike_alert(readings, math.nan))
print("100x reading after a NaN entered the history alerts:", spike_alert(readings + [math.nan], 100.0))


# %% nbgrader={"grade": false, "grade_id": "exercise_08_2", "locked": false, "schema_version": 3, "solution": true}
# exercise 08.2
def spike_alert(history, current, factor=3.0, window=5):
    """True when `current` is non-finite or above factor x the mean of the last `window` finite readings."""
    ### BEGIN SOLUTION
    if not math.isfinite(current):
        return True
    finite = [value for value in history if math.isfinite(value)]
    if len(finite) < window:
        return False
    return current > factor * float(np.mean(finite[-window:]))
    ### END SOLUTION


# %%
grading.check("08.2", spike_alert)

# %%
grading.score()

# %% [markdown]
# ## Claims checked

# %%
claims.table()

# %% [markdown]
# ## Summary
# - `GradTracer` reads each gradient in `register_post_accumulate_grad_hook` (L2: once per backward
#   pass, after accumulation) and turns per-layer std, update:data ratios, saturation, dead units and
#   missing gradients into alerts; `plot_grad_flow`, `plot_grad_stat` and `plot_grad_histograms`
#   draw them.
# - Gradient alerts did not warn hundreds of steps ahead of the loss on a run that blew up (L1); the
#   update:data ratio showed the learning-rate fault from the first step. The NumPy-sampling monitor
#   is blind to NaN, to missing gradients and to sparse spikes, and costs a host copy per tensor.
# - A bias gradient does not see the Dropout mask in front of its layer (L3); std 0 means a
#   normalisation right after it or dead units.
# - A detached skip shows as "no grad" in the flow plot, not as decoder gradients below 1e-6 (L4).
# - Compare gradients of differently sized parameters per entry: LayerNorm's are not 100x smaller
#   per entry (L5).
