# %% [markdown]
# # 00 · Start here: how Gradient Lab works
#
# Gradient Lab is a workbook of PyTorch training failures. Two blog articles about debugging
# gradients gave us a list of cases and claims (`python -m labkit claims --catalogue` lists them).
# **A claim is not a fact**: several of them are wrong. Every notebook takes a family of cases,
# reproduces each one, measures what really happens, records the [verdict](GLOSSARY.md#verdict) the data supports, and
# proves the fix. Then you fix a planted bug yourself, and `labkit` grades your answer.
#
# This notebook shows the whole chain on one tiny claim, so that every later notebook reads the same way.
#
# | you are | start with |
# | --- | --- |
# | a learner working alone | run this notebook top to bottom, then do its two exercises |
# | an instructor | `make student` writes the edition without solutions; docs/COURSE.md has workshop tracks |
# | an engineer rerunning one failure | the parameters cell below, and "Run it your way" near the end |
#
# **You will learn**
# - how every notebook here runs: a claim from an article, a reproduction, a measurement, a verdict
#   and a proven fix
# - what `.grad` holds after two backward passes, and what a training loop that forgets
#   `zero_grad()` does
# - how the graded exercises work: a planted bug, your fix, and a check that tests what your code
#   does
#
# **Prerequisites:** no earlier notebook. You should know: Python functions and classes; PyTorch
# tensors, `nn.Module` and a training loop (`loss.backward()`, `optimizer.step()`).
#
# **Time:** about 20 min to read and run, plus about 20 min for the 2 exercises. Run All takes about
# 9 s on 2 CPU cores.
#
# **Words** this notebook uses, explained in the [glossary](GLOSSARY.md):
# [leaf tensor](GLOSSARY.md#leaf-tensor),
# [gradient accumulation](GLOSSARY.md#gradient-accumulation), [verdict](GLOSSARY.md#verdict).
#
# **Predict before you run:** one cell below asks for your guess before a key measurement.

# %%
import sys, importlib.util as iu; "google.colab" in sys.modules and not iu.find_spec("labkit") and get_ipython().system("pip install 'gradient-lab-workbook[colab] @ git+https://github.com/gradient-lab/gradient-lab'"); import labkit.start  # no labkit here? README, Install

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from labkit import GradTracer, claims, compare_grads, datasets, explorers, grading, plot_grad_stat, repro
from labkit.probes import fingerprint, format_fingerprint
from labkit.progress import track

# %% [markdown]
# ## Parameters
# Every notebook has one cell tagged `parameters` (papermill replaces it when you rerun with other
# values) and nothing else in it. `device="auto"` takes a CUDA GPU when there is one. `bug=True`
# runs the reproduction with the planted bug; `bug=False` runs it without.

# %% tags=["parameters"]
seed: int = 0  # seed of every random stream, from 0 to 2147483647
device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N" or "mps"
features: int = 8  # input features of the regression, from 1 to 1000
samples: int = 64  # regression samples, from 1 to 100000
steps: int = 30  # SGD steps, from 1 to 100000
lr: float = 0.05  # SGD learning rate, above 0, at most 10
bug: bool = True  # True runs the planted bug, False the fix
clear_between: bool = False  # set w.grad to None between case Z1's two backward passes (its sum is then gone)

# %%
repro.check_parameters(globals())
dev = repro.setup(seed=seed, device=device)

# %% [markdown]
# ## The skeleton every notebook follows
# 1. **Parameters**: seed, device, sizes, steps, and a `bug` switch where it fits.
# 2. For each case: **the claim** as the article makes it, with its ID; **a reproduction**;
#    **the measurement**, printed (and plotted where a picture helps); **the verdict**, recorded with
#    `claims.check(ID, verdict=..., measured={...})`, which shows the measured numbers it rests on;
#    **the fix, proven** by the same measurement.
# 3. **Summary** and **Claims checked**: what the notebook found, and the table of every verdict.
# 4. **Exercises**: a planted bug, your fix, and a `grading.check` that tests what your code does.
# 5. **What comes next** and **Further reading**, with links; at the very end, **About this run**.
#
# Verdicts are one of `holds`, `does-not-hold`, `partly`, `needs-gpu` (the case needs a GPU and
# this machine has none; the GPU code path runs on the GPU runner) or `untestable`.

# %% [markdown]
# ## Case Z1: does `.grad` add up across backward passes?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("Z1").claim)

# %% [markdown]
# **Reproduce.** One [leaf tensor](GLOSSARY.md#leaf-tensor) `w`, two different losses, two backward passes, and nothing in between
# (`clear_between=True` sets `w.grad` to None there, as `zero_grad()` would).

# %%
# drawn by the CPU's generator, then moved: a GPU's generator would draw other numbers
w = torch.randn(features).to(dev).requires_grad_()
x1, x2 = torch.randn(features).to(dev), torch.randn(features).to(dev)
(w * x1).sum().backward()
after_one = w.grad.clone()
if clear_between:  # a parameter: what zero_grad() would do here
    w.grad = None
(w * x2).sum().backward()
after_two = w.grad.clone()

# %% [markdown]
# **Measure.** The reference asks autograd for each gradient separately with `torch.autograd.grad`,
# which never touches `.grad`. `compare_grads` prints one line per tensor: exact equality, `allclose`,
# and the largest absolute and relative difference.

# %% [markdown]
# **Predict before you run.** After two backward passes with nothing in between, compare `w.grad`
# with `g1 + g2`, the two gradients autograd computes separately and you add yourself. Will they be
# equal *bit for bit* (write `True`), or not (write `False`: `w.grad` holds only `g2`, or a float sum
# that differs in the last digits)?
# Write your guess into `guess` below, then run the next cells; the line after the measurement
# compares it with what was measured. (Left at `None`, it just prints the measurement.)

# %%
guess = None  # your prediction: replace None

# %%
(g1,) = torch.autograd.grad((w * x1).sum(), w)
(g2,) = torch.autograd.grad((w * x2).sum(), w)
sum_report = compare_grads({"w.grad after two": after_two}, {"w.grad after two": g1 + g2})
last_only = compare_grads({"w.grad after two": after_two}, {"w.grad after two": g2})
print("against g1 + g2:\n" + str(sum_report))
print("against g2 alone:\n" + str(last_only))

# %%
from labkit.predict import compare_guess

reason = ("backward adds each new gradient into .grad, one float addition per element, the same addition "
          "as g1 + g2: so the two agree to the last bit, not only approximately") if sum_report.all_exact else (
          "w.grad was set to None between the passes (clear_between=True), so it holds only the second gradient")
print(compare_guess(guess, sum_report.all_exact, what='w.grad equals g1 + g2 bit for bit', why=reason,
                    answer_words=("adds up", "accumulates", "g1 + g2", "bit for bit")))

# %% [markdown]
# **Verdict**, from those numbers:

# %%
worst_sum_diff = sum_report.rows[0].max_abs_diff
worst_last_diff = last_only.rows[0].max_abs_diff
holds = sum_report.all_exact and not last_only.all_close
claims.check("Z1", verdict="holds" if holds else "does-not-hold", measured={
    "w.grad equals g1 + g2 exactly": sum_report.all_exact, "max |w.grad - (g1 + g2)|": worst_sum_diff,
    "max |w.grad - g2|": worst_last_diff, "values compared": features,
}, rule="holds when w.grad is g1 + g2 bit for bit and differs from g2 alone")


# %% [markdown]
# ## Why it matters: a training loop that never clears `.grad`
# If `.grad` adds up, a loop that forgets `optimizer.zero_grad()` steps with the sum of every
# gradient so far. `GradTracer` watches each parameter's gradient through PyTorch's
# `register_post_accumulate_grad_hook`; below it traces a linear regression trained with plain SGD,
# with the bug as the parameters cell says.

# %%
def train(forget_zero_grad, label):
    """Full-batch SGD; returns the loss per step and the tracer's gradient history."""
    torch.manual_seed(seed)
    model = nn.Linear(features, 1).to(dev, torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = (t.to(dev) for t in datasets.regression(samples, features, seed=seed, dtype=torch.float64))
    losses = []
    with GradTracer(model, optimizer) as tracer:
        for _ in track(range(steps), label, updates=2):
            if not forget_zero_grad:
                optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, tracer.history()


losses, history = train(forget_zero_grad=bug, label="reproduction" if bug else "reproduction (bug off)")
weight_norms = [r["norm"] for r in history if r["param"] == "weight"]
print(f"bug={bug}: loss {losses[0]:.3g} -> {losses[-1]:.3g}; weight.grad norm {weight_norms[0]:.3g} -> {weight_norms[-1]:.3g}")
claims.metric("final_loss", round(losses[-1], 4))

# %% [markdown]
# **Measure.** The gradient the optimizer applied, per parameter and step, on a log scale:

# %%
figure = plot_grad_stat(history, "norm")
figure.axes[0].set_title(f"gradient norm per step (bug={bug})")
plt.show()
print(f"largest weight.grad norm: {max(weight_norms):.3g} at step {weight_norms.index(max(weight_norms))}")

# %% [markdown]
# **The fix, proven.** The same loop with `optimizer.zero_grad()` at the top of each step, its
# weight gradient drawn beside the reproduction's:

# %%
fixed_losses, fixed_history = train(forget_zero_grad=False, label="fixed loop")
fixed_norms = [r["norm"] for r in fixed_history if r["param"] == "weight"]
print(f"fixed: loss {fixed_losses[0]:.3g} -> {fixed_losses[-1]:.3g}; weight.grad norm {fixed_norms[0]:.3g} -> {fixed_norms[-1]:.3g}")
print("the fixed loop ends with a lower loss:", fixed_losses[-1] < losses[-1] or not bug)
figure, axis = plt.subplots(figsize=(7, 3.5))
axis.plot(weight_norms, label=f"the reproduction (bug={bug})")
axis.plot(fixed_norms, linestyle="--", label="fixed loop (zero_grad every step)")
axis.set(yscale="log", xlabel="step", ylabel="weight.grad norm", title="the gradient the optimizer applied, side by side")
axis.legend()
plt.show()


# %% [markdown]
# ## Explore: does a smaller learning rate cure a forgotten `zero_grad`?
# Move the learning rate and the number of steps; each redraw trains both loops from the same start.
# The controls appear when you run the cell in JupyterLab; the stored output is the default view.

# %%
def sgd_losses(forget_zero_grad, lr, steps):
    """Loss per step of full-batch SGD on the regression task; on the CPU in float64, so the numbers match on every machine."""
    torch.manual_seed(seed)
    model = nn.Linear(features, 1).to(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = datasets.regression(samples, features, seed=seed, dtype=torch.float64)
    history = []
    for _ in range(steps):
        if not forget_zero_grad:
            optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        history.append(loss.item())
    return history


def zero_grad_view(lr, steps):
    figure, axis = plt.subplots(figsize=(7, 3.5))
    for forget, name in ((False, "with zero_grad"), (True, "without zero_grad")):
        history = sgd_losses(forget, lr, steps)
        lowest = min(history)
        axis.plot(range(1, steps + 1), history, label=name)
        print(f"{name:<17} loss {history[0]:.3g} -> {history[-1]:.3g} "
              f"(lowest {lowest:.3g}, at step {history.index(lowest) + 1})")
    axis.set(yscale="log", xlabel="step", ylabel="MSE loss", title=f"learning rate {lr}, {steps} steps")
    axis.legend()
    return figure


explorers.explore(zero_grad_view, lr=explorers.slider(0.05, 0.005, 0.2, 0.005, label="learning rate"),
                  steps=explorers.slider(30, 10, 120, 10))

# %% [markdown]
# Without `zero_grad` the loss dips, then swings back up and keeps swinging: each step adds the new
# gradient to every old one, which is SGD with momentum 1 and no damping. A smaller learning rate
# does not cure it, it only slows the swing, and in a short run the broken loop can even look like
# the faster learner (try learning rate 0.005 with 10 steps). Only clearing `.grad` makes it converge.

# %% [markdown]
# ## Run it your way
# Every notebook reruns with other parameters. The validated way checks names and types against the
# parameters cell before running, and writes the executed notebook and its results under
# `runs/00_start_here/<time>/`:
#
# ```
# make repro NB=00_start_here P="-p bug False -p steps 60"
# python -m labkit repro 00_start_here -p lr 0.01 --sweep seed=0,1,2
# ```
#
# Plain papermill works too: `papermill notebooks/00_start_here.ipynb out.ipynb -p bug False`.

# %% [markdown]
# ## Summary
# - `.grad` is an accumulator: every backward pass adds into it (Z1, measured above), so a training
#   step clears it (`optimizer.zero_grad()`) before its backward pass, or it steps with stale sums.
# - Every notebook follows this chain: parameters → claim → reproduce → measure → verdict → fix →
#   summary → claims checked → exercises. `python -m labkit claims` lists every verdict stored in
#   the workbook without running it.
# - Each notebook opens with what you will learn and ends with its verdicts, exercises, what comes
#   next and further reading; the [glossary](GLOSSARY.md) explains the words they use.

# %% [markdown]
# ## Claims checked

# %%
claims.table()


# %% [markdown]
# ## Exercises
# Each exercise shows a planted bug and its symptom; you rewrite the function in the cell marked
# `# exercise`, and the check after it tests what your function does on its own data.
#
# ### Exercise 00.1: one correct SGD step
# `one_training_step(model, optimizer, x, y)` should take one plain SGD step on
# `F.mse_loss(model(x), y)` and return that loss, measured before the step, as a Python float.
# The version below looks right and runs without complaint, but it trusts `.grad` to start empty
# on every step, and claim Z1 says it does not.
#
# The check leaves an old gradient in `.grad` before your first step, as after someone inspected the
# gradients. Before you write, decide: at which moment of a step must `.grad` be empty, and which of
# the places you could clear it (before `backward()`, between `backward()` and `step()`, after
# `step()`) makes every step right, the first included?

# %%
# planted bug for exercise 00.1
def one_training_step(model, optimizer, x, y):
    """One SGD step on F.mse_loss(model(x), y); returns the loss before the step as a float."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


# %%
# The symptom: on the same batch, the gradient the optimizer applies grows with every step.
torch.manual_seed(seed)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 4), torch.randn(16, 1)
for step in range(1, 4):
    one_training_step(model, optimizer, x, y)
    print(f"step {step}: weight.grad norm = {model.weight.grad.norm():.3f}")


# %% [markdown]
# Fix `one_training_step` below so that each step uses only its own batch's gradient, then run the
# check. It builds its own model, optimizer and batches, and leaves a stale gradient in `.grad`
# before the first step.

# %% nbgrader={"grade": false, "grade_id": "exercise_00_1", "locked": false, "schema_version": 3, "solution": true}
# exercise 00.1
def one_training_step(model, optimizer, x, y):
    """One SGD step on F.mse_loss(model(x), y); returns the loss before the step as a float."""
    ### BEGIN SOLUTION
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_00_1", "locked": true, "points": 1, "schema_version": 3, "solution": false}
grading.check("00.1", one_training_step)


# %% [markdown]
# ### Exercise 00.2: one gradient per call
# `grad_of_each_call(w, inputs)` should return, for each `x` in `inputs`, the gradient of
# `torch.tanh(w * x).sum()` with respect to the one leaf tensor `w`, as if that call were the only
# one. Let autograd do the calculus (`backward()`, `torch.autograd.grad` or `torch.func.grad`): the
# lesson is where its gradients go, and the check rejects a derivative written out by hand.

# %%
# planted bug for exercise 00.2
def grad_of_each_call(w, inputs):
    """The gradient of torch.tanh(w * x).sum() with respect to w, separately for each x in inputs."""
    grads = []
    for x in inputs:
        torch.tanh(w * x).sum().backward()
        grads.append(w.grad)
    return grads


# %%
# The symptom: two different inputs, yet both "gradients" are the same tensor holding their sum.
w = torch.ones(3, requires_grad=True)
inputs = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])]
grads = grad_of_each_call(w, inputs)
print(grads)
print("the same tensor twice:", grads[0] is grads[1])


# %% nbgrader={"grade": false, "grade_id": "exercise_00_2", "locked": false, "schema_version": 3, "solution": true}
# exercise 00.2
def grad_of_each_call(w, inputs):
    """The gradient of torch.tanh(w * x).sum() with respect to w, separately for each x in inputs."""
    ### BEGIN SOLUTION
    grads = []
    for x in inputs:
        (gradient,) = torch.autograd.grad(torch.tanh(w * x).sum(), w)
        grads.append(gradient)
    return grads
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_00_2", "locked": true, "points": 1, "schema_version": 3, "solution": false}
grading.check("00.2", grad_of_each_call)

# %%
grading.score()

# %% [markdown]
# ## Debugging lab 00: your first lab
# Every notebook ends with a debugging lab: a short training run on a model and data the notebook has
# not shown, with **one defect** drawn for you from the notebook's family of failures. You see what a
# practitioner would see (a loss curve, an accuracy, memory), never the code of the defect. Your job is
# the one this workbook teaches: measure, find the cause, repair it, and let the check prove the repair.
#
# 1. `labs.start("00")` trains the run and prints its symptoms, the **causes** you may choose from (some
#    are decoys that a measurement rules out) and the **stages** of its training you may rewrite, each
#    with its contract. Your variant is drawn from your login (from your student ID under nbgrader),
#    so it is yours every time; `labs.start("00", seed=7)` draws another, to practise on.
# 2. Investigate with the run's objects (`lab.model`, `lab.optimizer`, `lab.x`, `lab.y`, `lab.losses`),
#    plain PyTorch and labkit's instruments (`GradTracer`, `compare_grads`). `lab.rerun(loss_of=f)` reruns
#    the same training with a stage of yours and prints what it shows.
# 3. Write `diagnose(lab)`: return your diagnosis (one of `lab.causes`, as text) and your repair, the
#    stage function you rewrote, named after its stage. The check reruns the training with your stage,
#    makes sure it really trained (every step taken, at its learning rate, no weights written in), and
#    compares the result with the same training without the defect. A wrong diagnosis gets the
#    measurement that contradicts it; hints grow more explicit with each failed try.

# %% tags=["nbval-ignore-output"]
from labkit import labs

lab = labs.start("00")


# %%
# lab 00: your answer
def diagnose(lab):
    """Your diagnosis (one of lab.causes) and your repair (the stage function you rewrote, named after its stage)."""
    # YOUR CODE HERE
    raise NotImplementedError("Lab 00: replace these two lines with your answer")


# %%
labs.check(lab, diagnose)

# %% [markdown]
# ## What comes next
# [01 · The computation graph: what autograd records, and what it does not](01_computation_graph.ipynb):
# `.grad` is filled by a backward pass that walks a graph the forward pass recorded; 01 walks that
# graph node by node.

# %% [markdown]
# ## Further reading
# - [torch.autograd](https://docs.pytorch.org/docs/stable/autograd.html)
# - [Autograd mechanics](https://docs.pytorch.org/docs/stable/notes/autograd.html)
# - [torch.optim.Optimizer.zero_grad](https://docs.pytorch.org/docs/stable/generated/torch.optim.Optimizer.zero_grad.html)
# - [Zeroing out gradients in PyTorch (recipe)](https://docs.pytorch.org/tutorials/recipes/recipes/zeroing_out_gradients.html)

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
