# %% [markdown]
# # 09 · Residual design: pre- versus post-activation, measured
#
# Where the ReLU sits in a residual block decides whether the skip connection is a clean identity
# path for the gradient. You will measure, on deep residual MLPs trained on digits, how much of the
# gradient the ReLU after the addition ([post-activation](GLOSSARY.md#pre-activation-and-post-activation), "ResNet v1") really cuts, what reaches the
# first block, whether the pre-activation [identity path](GLOSSARY.md#identity-path) ("ResNet v2") is exact, and what it buys.
#
# **You will learn**
# - what a ReLU after the addition (post-activation, ResNet v1) does to the skip path's gradient
# - whether the pre-activation identity path (ResNet v2) is exact, tested with zero-initialised
#   branches
# - how a half-converted block hides a non-identity skip
#
# **Prerequisites:**
# [08 · Gradient health: watching every layer's gradient while it trains](08_gradient_health.ipynb).
# You should know: Python functions and classes; PyTorch tensors, `nn.Module` and a training loop
# (`loss.backward()`, `optimizer.step()`); what a residual block is.
#
# **Time:** about 30 min to read and run, plus about 20 min for the 2 exercises. Run All takes about
# 50 s on 2 CPU cores.
#
# **Words** this notebook uses, explained in the [glossary](GLOSSARY.md):
# [identity path](GLOSSARY.md#identity-path),
# [pre-activation and post-activation](GLOSSARY.md#pre-activation-and-post-activation),
# [vanishing and exploding gradients](GLOSSARY.md#vanishing-and-exploding-gradients).
#
# **Predict before you run:** one cell below asks for your guess before a key measurement.

# %%
import sys, importlib.util as iu; "google.colab" in sys.modules and not iu.find_spec("labkit") and get_ipython().system("pip install 'gradient-lab-workbook[colab] @ git+https://github.com/gradient-lab/gradient-lab'"); import labkit.start  # no labkit here? README, Install

import statistics

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from labkit import claims, compare_grads, datasets, figures, grading, repro
from labkit.probes import fingerprint, format_fingerprint
from labkit.progress import track

# %% [markdown]
# ## Parameters
# `depths` are the numbers of residual blocks measured at initialisation, each over `seeds` seeds;
# `train_depths` are trained for `train_steps` SGD steps (momentum 0.9, learning rate `lr`) over
# `train_seeds` seeds. `width` is the residual stream's width. `bug=True` builds the
# "pre-activation" block of the last section with a ReLU left after the addition; `bug=False`
# builds it right.

# %% tags=["parameters"]
seed: int = 0  # seed of every random stream, from 0 to 2147483647
device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N" or "mps"
width: int = 32  # width of the residual stream, from 1 to 1024
depths: list[int] = [8, 16, 32]  # residual block counts measured at initialisation, each from 1 to 1000, at most 16 values
seeds: int = 3  # seeds each depth is measured over, from 1 to 100
train_depths: list[int] = [8, 32]  # residual block counts that are trained, each from 1 to 1000, at most 16 values
train_steps: int = 40  # SGD steps of each training run, from 1 to 100000
train_seeds: int = 2  # seeds each trained depth runs over, from 1 to 100
lr: float = 0.05  # SGD learning rate, above 0, at most 10
bug: bool = True  # True runs the planted bug, False the fix

# %%
repro.check_parameters(globals())
dev = repro.setup(seed=seed, device=device)

# %% [markdown]
# Everything runs on `dev` in float64 so that a CPU and a GPU print the same rounded numbers. The
# data are scikit-learn's handwritten digits (64 pixels, 10 classes); CIFAR-100, the article's data
# set, would need a download.

# %%
DTYPE = torch.float64
digits = datasets.digits().to(dev)
x_train, y_train = digits.x_train.to(DTYPE), digits.y_train
x_test, y_test = digits.x_test.to(DTYPE), digits.y_test
print(f"{len(y_train)} training and {len(y_test)} test digits")

# %% [markdown]
# ## Case M1: does post-activation cut the gradient, and does pre-activation keep an identity path?
# **The claim**, in the catalogue's words:

# %%
print(claims.case("M1").claim)


# %% [markdown]
# **Reproduce.** The two block designs of the ResNet papers, written for vectors (BatchNorm1d,
# Linear) so that they train in seconds on a CPU. A post-activation block ends with a ReLU *after*
# the addition, so its output, the next block's input, passes through it; a pre-activation block
# puts BatchNorm and ReLU *inside* the branch and adds the input back untouched. The network is
# `stem -> blocks -> head`; the pre-activation one adds the final BatchNorm + ReLU that design needs.

# %%
class PostActBlock(nn.Module):
    """ResNet v1 order: relu(x + BN(W2 relu(BN(W1 x))))."""

    def __init__(self, block_width):
        super().__init__()
        self.lin1, self.bn1 = nn.Linear(block_width, block_width), nn.BatchNorm1d(block_width)
        self.lin2, self.bn2 = nn.Linear(block_width, block_width), nn.BatchNorm1d(block_width)

    def branch(self, x):
        return self.bn2(self.lin2(F.relu(self.bn1(self.lin1(x)))))

    def forward(self, x):
        return F.relu(x + self.branch(x))


class PreActBlock(nn.Module):
    """ResNet v2 order: x + W2 relu(BN(W1 relu(BN(x)))). `relu_after_add` is the bug of the last section."""

    def __init__(self, block_width, relu_after_add=False):
        super().__init__()
        self.relu_after_add = relu_after_add
        self.bn1, self.lin1 = nn.BatchNorm1d(block_width), nn.Linear(block_width, block_width)
        self.bn2, self.lin2 = nn.BatchNorm1d(block_width), nn.Linear(block_width, block_width)

    def branch(self, x):
        return self.lin2(F.relu(self.bn2(self.lin1(F.relu(self.bn1(x))))))

    def forward(self, x):
        out = x + self.branch(x)
        return F.relu(out) if self.relu_after_add else out


class ResidualMLP(nn.Module):
    def __init__(self, make_block, depth):
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.blocks = nn.ModuleList(make_block(width) for _ in range(depth))
        pre_activation = isinstance(self.blocks[0], PreActBlock)
        self.final = nn.Sequential(nn.BatchNorm1d(width), nn.ReLU()) if pre_activation else nn.Identity()
        self.head = nn.Linear(width, 10)

    def forward(self, x, keep=None):
        """`keep`, a list, collects the stem output and every block's output (the block inputs)."""
        h = self.stem(x)
        for block in self.blocks:
            if keep is not None:
                keep.append(h)
            h = block(h)
        if keep is not None:
            keep.append(h)
        return self.head(self.final(h))


DESIGNS = {"post-activation": PostActBlock, "pre-activation": PreActBlock}


def build(design, depth, model_seed):
    torch.manual_seed(model_seed)
    return ResidualMLP(DESIGNS[design], depth).to(dev, DTYPE)


# %% [markdown]
# **Measure.** On one batch of 256 digits, at initialisation, for each design, depth and seed:
# - the **ReLU cut share**: in post-activation blocks, the share of entries where `x + branch(x) <= 0`.
#   There the ReLU after the addition passes no gradient, through the skip or the branch;
# - the **gradient survival rate** as the article defines it: the share of entries of `dL/dx` that
#   are not zero, at the first block's input;
# - the **norm ratio** `||dL/dx_first block input|| / ||dL/dx_last block output||`: above 1, the
#   gradient reaching the first block is larger than the one leaving the top.

# %%
batch_x, batch_y = x_train[:256], y_train[:256]


def block_input_grads(model):
    """dL/dh for the stem output (first block input) and every block output, on the fixed batch."""
    kept = []
    loss = F.cross_entropy(model(batch_x, keep=kept), batch_y)
    return torch.autograd.grad(loss, kept)


def relu_cut_share(model):
    """Mean over post-activation blocks of the share of entries the ReLU after the addition zeroes."""
    shares, h = [], model.stem(batch_x)
    with torch.no_grad():
        for block in model.blocks:
            shares.append((h + block.branch(h) <= 0).to(DTYPE).mean().item())
            h = block(h)
    return statistics.mean(shares)


def survival(model):
    grads = block_input_grads(model)
    first, last = grads[0], grads[-1]
    return {"nonzero": (first != 0).to(DTYPE).mean().item(), "norm_ratio": (first.norm() / last.norm()).item()}


at_init = {}
for design in DESIGNS:
    for depth in depths:
        runs = [build(design, depth, s) for s in range(seeds)]
        stats = [survival(model) for model in runs]
        at_init[design, depth] = {
            "nonzero": statistics.mean(s["nonzero"] for s in stats),
            "norm_ratio": statistics.mean(s["norm_ratio"] for s in stats),
            "cut": statistics.mean(relu_cut_share(model) for model in runs) if design == "post-activation" else None,
        }

# %%
print(f"{'design':<16} {'depth':>5}  {'ReLU cut share':>14}  {'survival (dL/dx != 0)':>21}  {'norm ratio in/out':>17}")
for (design, depth), row in at_init.items():
    cut = f"{row['cut']:.1%}" if row["cut"] is not None else "no ReLU on skip"
    print(f"{design:<16} {depth:>5}  {cut:>14}  {row['nonzero']:>21.1%}  {row['norm_ratio']:>17.3g}")

# %%
_, axis = plt.subplots(figsize=(6, 3.5), layout="constrained")
for design in DESIGNS:
    axis.plot(depths, [at_init[design, d]["norm_ratio"] for d in depths], marker="o", label=design)
axis.set_xscale("log", base=2)
axis.set_yscale("log")
axis.set_xlabel("residual blocks")
axis.set_ylabel("||dL/dx| first / last block")
axis.set_title(f"gradient norm reaching the first block, at initialisation ({seeds} seeds)")
axis.legend()
plt.show()
print("norm ratio > 1 at every depth, both designs:", all(row["norm_ratio"] > 1 for row in at_init.values()))

# %% [markdown]
# **Where along the depth does it grow?** The gradient norm at every block's input of the deepest
# networks, block 0 (the stem's output) to the top, averaged over the seeds:

# %%
deepest = max(depths)
norm_by_block = {design: [statistics.mean(values) for values in zip(*(
    [g.norm().item() for g in block_input_grads(build(design, deepest, s))] for s in range(seeds)))]
    for design in DESIGNS}
figure, axis = plt.subplots(figsize=(6.5, 3.5), layout="constrained")
for design, norms in norm_by_block.items():
    axis.plot(range(len(norms)), norms, marker=".", label=design)
axis.set(yscale="log", xlabel=f"block input (0 = first block, {deepest} = top output)",
         ylabel="||dL/dx|| (log scale)", title=f"gradient norm along depth, {deepest} blocks, at initialisation")
axis.legend()
per_block = {design: (norms[0] / norms[-1]) ** (1 / deepest) for design, norms in norm_by_block.items()}
figures.describe(figure, f"Gradient norm per block input on a log scale, {deepest} blocks: both designs rise toward "
                         f"the first block, most steeply over the first few blocks, post-activation by {per_block['post-activation']:.2f}x "
                         f"per block, pre-activation by {per_block['pre-activation']:.2f}x.")
plt.show()
for design, norms in norm_by_block.items():
    print(f"{design}: first block {norms[0] / norms[-1]:.0f}x the top's gradient norm, "
          f"{per_block[design]:.3f}x per block on average")


# %% [markdown]
# The ReLU after the addition zeroes well under half of the entries per block (the cut share
# column): its input is `x + branch(x)`, and `x`, the previous block's ReLU output, is never
# negative. The zeroed entries are refilled by the next block's branch, whose weight matrix mixes
# every entry into every other, so the gradient reaching the first block has no zero entries in
# either design. Nor is it weaker: it is *stronger*. A block's backward pass adds the branch's
# contribution to what the skip carries (`dL/dx = g + J_branch^T g` in a pre-activation block), so
# the norm grows toward the input. In the stored run, at 32 blocks, it grows by about 1.20x per block
# post-activation and 1.15x pre-activation, so the first block's gradient is about 300x
# (post-activation) and 100x (pre-activation) the top's. The norm along depth (the figure above)
# shows where: gently through the upper blocks, then steeply over the first few, the largest step at
# the first block itself. That is gradient growth at initialisation, the exploding side of
# [vanishing and exploding gradients](GLOSSARY.md#vanishing-and-exploding-gradients), and nothing here
# shows it to be harmless: BatchNorm bounds the forward values, not this growth; it compounds with the
# per-block factor, so a deeper stack grows further; and with one learning rate the blocks near the
# input see activation gradients two orders of magnitude above the last ones'. What this notebook
# does not measure is how much the growth costs in training: the short training below favours
# pre-activation, which also grows less, but it compares whole designs and does not single out the
# growth. Removing it is what zero-initialising each branch's last layer (next cell) and Fixup are for:
# then every block starts as its skip alone, and the ratio is exactly 1. The survival rate of the
# article cannot see any of this; the norm along depth does.
#
# **The identity path, isolated.** Set every branch's last layer to zero (the common "zero-init"
# of the final BatchNorm γ in v1, or of the last Linear in v2), so each block starts as its skip
# path alone. Then the gradient at the first block's input must equal the gradient at the top,
# exactly, if the skip is an identity.

# %%
def identity_only(design, depth, relu_after_add=False):
    """A model whose branches output zero at the start: only the skip paths carry anything."""
    torch.manual_seed(seed)
    make_block = (lambda w: PreActBlock(w, relu_after_add)) if design == "pre-activation" else PostActBlock
    model = ResidualMLP(make_block, depth).to(dev, DTYPE)
    with torch.no_grad():
        for block in model.blocks:
            last = block.bn2 if design == "post-activation" else block.lin2
            last.weight.zero_()
            last.bias.zero_()
    return model


identity_reports = {}
for design in DESIGNS:
    grads = block_input_grads(identity_only(design, max(depths)))
    identity_reports[design] = compare_grads({"dL/dx": grads[0]}, {"dL/dx": grads[-1]})
    nonzero = (grads[0] != 0).to(DTYPE).mean().item()
    print(f"{design}: first-block input gradient vs top gradient, {max(depths)} blocks "
          f"(non-zero share {nonzero:.0%}):\n{identity_reports[design]}")


# %% [markdown]
# **Does it matter for training?** Each design trained for `train_steps` steps at `train_depths`
# depths; test accuracy in [evaluation mode](GLOSSARY.md#train-and-eval-mode) (BatchNorm [running statistics](GLOSSARY.md#running-statistics)).

# %%
def train_and_test(design, depth, run_seed):
    model = build(design, depth, run_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    batches = torch.Generator().manual_seed(run_seed)
    for _ in range(train_steps):
        index = torch.randint(0, len(y_train), (128,), generator=batches).to(dev)
        optimizer.zero_grad()
        F.cross_entropy(model(x_train[index]), y_train[index]).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).to(DTYPE).mean().item()


accuracy = {}
for depth in track(train_depths, "training depths", updates=1):
    for design in DESIGNS:
        accuracy[design, depth] = [train_and_test(design, depth, s) for s in range(train_seeds)]
for (design, depth), values in accuracy.items():
    print(f"{design:<16} {depth:>3} blocks: test accuracy per seed {[round(v, 3) for v in values]}, "
          f"mean {statistics.mean(values):.3f}")

# %%
deepest = max(depths)
cut_shares = [row["cut"] for (design, _), row in at_init.items() if design == "post-activation"]
mean_cut = statistics.mean(cut_shares)
gaps = {d: statistics.mean(accuracy["pre-activation", d]) - statistics.mean(accuracy["post-activation", d])
        for d in train_depths}
identity_exact = identity_reports["pre-activation"].all_exact and not identity_reports["post-activation"].all_exact
half_cut = 0.4 <= mean_cut <= 0.6
survival = {design: [at_init[design, d]["nonzero"] for d in depths] for design in DESIGNS}
survival_equal = all(row["nonzero"] == 1.0 for row in at_init.values())
pre_exact, post_exact = identity_reports["pre-activation"].all_exact, identity_reports["post-activation"].all_exact
claims.check("M1", verdict="holds" if half_cut and identity_exact and not survival_equal else (
    "partly" if identity_exact else "does-not-hold"), measured={
    "exact gradient through the skip": {"pre": pre_exact, "post": post_exact},
    "share the post-activation ReLU zeroed": f"{mean_cut:.0%}",
    "lowest survival rate (dL/dx != 0)": {d.split("-")[0]: f"{min(r):.1%}" for d, r in survival.items()},
    "test accuracy, pre minus post": {f"depth {d}": f"{gaps[d]:+.3f}" for d in train_depths},
}, rule="only pre exact, ReLU zeroes 40-60% (the article's half), survival differs; partly: only the first")

# %% [markdown]
# What the claim gets right: only the pre-activation design has an exact identity path, and here it
# trained faster. What it gets wrong: the post-activation ReLU does not cut half the gradient, and
# "dL/dx != 0" does not tell the designs apart at all. The article's CIFAR-100 table cannot be
# checked here (no download); the digits numbers above are the evidence.

# %% [markdown]
# ## A pre-activation block that is not one
# Converting v1 blocks to v2, it is easy to move BatchNorm and ReLU into the branch and forget to
# delete the ReLU after the addition. The block still trains, but its skip is no longer an
# identity. The same zero-init measurement shows it, with the block as the parameters cell says:

# %% [markdown]
# **Predict before you run.** With `bug=True` the converted block keeps a ReLU after the addition.
# With zero-initialised branches, will the first block's input gradient still equal the top gradient
# exactly (`True` or `False`)?
# Write your guess into `guess` below, then run the next cells; the line after the measurement
# compares it with what was measured. (Left at `None`, it just prints the measurement.)

# %%
guess = None  # your prediction: replace None

# %%
converted = block_input_grads(identity_only("pre-activation", deepest, relu_after_add=bug))
converted_report = compare_grads({"dL/dx": converted[0]}, {"dL/dx": converted[-1]})
converted_nonzero = (converted[0] != 0).to(DTYPE).mean().item()
print(f"bug={bug}: first-block input gradient equals the top gradient exactly: {converted_report.all_exact}; "
      f"non-zero share {converted_nonzero:.0%}")
claims.metric("identity_exact", converted_report.all_exact)
claims.metric("identity_nonzero_share", round(converted_nonzero, 3))

# %%
from labkit.predict import compare_guess

print(compare_guess(guess, converted_report.all_exact, what='the skip stays an exact identity',
                    why=("with zero branches the block computes relu(x), not x: the ReLU after the addition zeroes the "
                         "gradient wherever the input is negative, so the skip passes the top gradient only in part"),
                    answer_words=("cuts from the skip",)))

# %% [markdown]
# **The fix, proven.** Delete the ReLU after the addition:

# %%
fixed = block_input_grads(identity_only("pre-activation", deepest, relu_after_add=False))
fixed_report = compare_grads({"dL/dx": fixed[0]}, {"dL/dx": fixed[-1]})
print(f"fixed block: exact identity path: {fixed_report.all_exact}; non-zero share {(fixed[0] != 0).to(DTYPE).mean().item():.0%}")

# %% [markdown]
# ## Summary
# - Only a pre-activation block's skip is an exact identity for the gradient (M1); a ReLU after the
#   addition, in v1 blocks or left behind in a converted v2 block, gates it.
# - That ReLU zeroed well under half of the entries per block here, because the skip carries
#   non-negative values; the next branch's weights refill the zeroed entries, so the share of
#   non-zero entries of dL/dx reaching the first block was 100% in both designs.
# - Nor is the gradient weaker there: at initialisation it grows toward the input in both designs
#   (the first block about 300x the top's post-activation, 100x pre-activation, at 32 blocks), a
#   growth zero-initialised branches remove; how much it costs in training is not measured here.
# - Measure survival with the norm ratio and an exact comparison on zero-init branches; "dL/dx != 0"
#   cannot tell the designs apart.
# - On digits the pre-activation design reached a higher test accuracy after a short training at
#   both depths tried; the article's CIFAR-100 numbers are not reproducible here without a download.

# %% [markdown]
# ## Claims checked

# %%
claims.table()


# %% [markdown]
# ## Exercises
# ### Exercise 09.1: the same lesson in a Transformer
# A Transformer layer is two residual sublayers (attention, then an MLP), each with a LayerNorm. The
# original Transformer normalised the sum, `norm(x + sublayer(x))` ("post-norm"); most models since
# put the LayerNorm inside the branch. `prenorm_sublayer(x, norm, sublayer)` should compute one
# residual sublayer such that, as for the pre-activation block above, the input reaches the output,
# and the output's gradient reaches the input, untouched: with the sublayer's last layer zeroed, the
# block must be an exact identity. Before you write it: where can the LayerNorm go? The version below
# is the post-norm original.

# %%
# planted bug for exercise 09.1
def prenorm_sublayer(x, norm, sublayer):
    """One residual sublayer whose skip path carries x untouched, with norm applied inside the branch."""
    return norm(x + sublayer(x))


# %%
# The symptom: with the sublayer's last layer zeroed, the block should be the identity; it is not.
torch.manual_seed(seed)
norm = nn.LayerNorm(4)
sublayer = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
nn.init.zeros_(sublayer[2].weight)
nn.init.zeros_(sublayer[2].bias)
x = 2.0 + torch.randn(8, 4)
print("block(x) == x:", torch.equal(prenorm_sublayer(x, norm, sublayer), x),
      "; mean of the output rows:", round(prenorm_sublayer(x, norm, sublayer).mean().item(), 3), "(x's is about 2)")


# %% nbgrader={"grade": false, "grade_id": "exercise_09_1", "locked": false, "schema_version": 3, "solution": true}
# exercise 09.1
def prenorm_sublayer(x, norm, sublayer):
    """One residual sublayer whose skip path carries x untouched, with norm applied inside the branch."""
    ### BEGIN SOLUTION
    return x + sublayer(norm(x))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_09_1", "locked": true, "points": 1, "schema_version": 3, "solution": false}
grading.check("09.1", prenorm_sublayer)


# %% [markdown]
# ### Exercise 09.2: the gradient survival rate
# `gradient_survival(stack, x, upstream)` should send `upstream` (shaped like `stack(x)`) backward
# through `stack` to its input and return two floats: the share of the input gradient's entries that
# are **not zero**, and the ratio of its norm to `upstream`'s norm. The version below counts only the
# positive entries, which makes an identity look as if it cut half the gradient.

# %%
# planted bug for exercise 09.2
def gradient_survival(stack, x, upstream):
    """(share of non-zero entries of the input gradient, ||input gradient|| / ||upstream||)."""
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(stack(leaf), leaf, upstream)
    share = (grad > 0).float().mean().item()
    return share, (grad.norm() / upstream.norm()).item()


# %%
# The symptom: an identity "stack" passes every entry, yet the rate reads about one half.
x, upstream = torch.randn(64, 8), torch.randn(64, 8)
print("survival through nn.Identity():", gradient_survival(nn.Identity(), x, upstream))


# %% nbgrader={"grade": false, "grade_id": "exercise_09_2", "locked": false, "schema_version": 3, "solution": true}
# exercise 09.2
def gradient_survival(stack, x, upstream):
    """(share of non-zero entries of the input gradient, ||input gradient|| / ||upstream||)."""
    ### BEGIN SOLUTION
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(stack(leaf), leaf, upstream)
    share = (grad != 0).float().mean().item()
    return share, (grad.norm() / upstream.norm()).item()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_09_2", "locked": true, "points": 1, "schema_version": 3, "solution": false}
grading.check("09.2", gradient_survival)

# %%
grading.score()

# %% [markdown]
# ## Debugging lab 09: a deep pre-activation network
# A new run: a 12-block pre-activation residual network (LayerNorm in each branch) learns four classes
# that a random teacher network drew over 16 features. One thing in how its blocks are built or
# initialised is wrong, drawn for you from this notebook's family of residual-design failures.
# `labs.start` prints what you would see, the causes you may choose from (decoys included) and the
# stages you may rewrite; investigate with the run's objects (`lab.model`, whose forward takes
# `keep=` as `ResidualMLP` above does, `lab.x`, `lab.y`, `lab.losses`), plain PyTorch and labkit's
# instruments, and `lab.rerun(stage=f)`. Then write `diagnose(lab)`: your diagnosis and the stage
# function you rewrote (lab 00 shows the format). The check reruns the training with your stage and
# compares it with the same training without the defect.

# %% tags=["nbval-ignore-output"]
from labkit import labs

lab = labs.start("09")


# %%
# lab 09: your answer
def diagnose(lab):
    """Your diagnosis (one of lab.causes) and your repair (the stage function you rewrote, named after its stage)."""
    # YOUR CODE HERE
    raise NotImplementedError("Lab 09: replace these two lines with your answer")


# %%
labs.check(lab, diagnose)

# %% [markdown]
# ## What comes next
# [10 · Mixed precision: fp16, bf16 and the loss scaler](10_mixed_precision.ipynb): gradients that
# survive the depth can still vanish in 16-bit numbers; 10 measures fp16 and bf16.

# %% [markdown]
# ## Further reading
# - [He et al. 2016, Deep Residual Learning for Image Recognition](https://arxiv.org/abs/1512.03385)
# - [He et al. 2016, Identity Mappings in Deep Residual Networks](https://arxiv.org/abs/1603.05027)
# - [Goyal et al. 2017, Accurate, Large Minibatch SGD (zero-initialised residual branches)](https://arxiv.org/abs/1706.02677)
# - [torchvision ResNet (zero_init_residual)](https://docs.pytorch.org/vision/stable/models/resnet.html)

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
