"""The debugging labs (labkit.labs): each variant's right diagnosis and repair passes, everything else fails
with the message that teaches.

Per lab and variant: the right diagnosis with a correct repair passes, at two seeds, and so does a second
correct repair written differently (given as source text, as a grading runner passes it); each decoy
diagnosis is rejected with the measurement that contradicts it; the repair of every other variant fails
as not recovering; repairs that dodge training (no learning rate, a skipped step, weights written in,
another model trained, an error caught and hidden) fail. All in-process: no kernel is started.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import grading
from labkit.labs import _lab00, _lab02, _lab05, _lab09, _lab10, _lab13, _lab16, catalogue
from labkit.labs._check import check_lab, reference_runs
from labkit.labs._draw import draw, learner_key, nbgrader_student
from labkit.labs._registry import lab_ids, lab_of

SEEDS = (0, 3)


# --- correct repairs: one callable per variant (the stage it repairs), and one written differently as source ---

def _update_none_grads(model, optimizer, loss):
    for parameter in model.parameters():
        parameter.grad = None
    loss.backward()
    optimizer.step()


REPAIRS = {
    "00.a": (_lab00.loss_of, "def loss_of(prediction, target):\n    return (prediction - target).pow(2).mean()\n"),
    "00.b": ({"update": _update_none_grads}, "def update(model, optimizer, loss):\n    model.zero_grad()\n    loss.backward()\n"
                                 "    optimizer.step()\n"),
    "00.c": (_lab00.make_batches,
             "def make_batches(x, y, batch_size, generator):\n    order = torch.randperm(len(x), generator=generator)\n"
             "    return list(zip(x[order].split(batch_size), y[order].split(batch_size)))\n"),
    "02.a": (_lab02.begin_step, "def begin_step(model, optimizer, max_norm):\n    model.zero_grad(set_to_none=True)\n"),
    "02.b": (_lab02.micro_loss, "def micro_loss(model, inputs, targets, micro_batches):\n"
                                "    return F.mse_loss(model(inputs), targets, reduction='sum') / "
                                "(len(inputs) * micro_batches)\n"),
    "02.c": (_lab02.finish_step,
             "def finish_step(model, optimizer, max_norm):\n    grads = [p.grad for p in model.parameters()]\n"
             "    norm = torch.sqrt(sum((g ** 2).sum() for g in grads))\n"
             "    scale = min(1.0, max_norm / (norm.item() + 1e-6))\n"
             "    for g in grads:\n        g.mul_(scale)\n    optimizer.step()\n"),
    "05.a": (_lab05.set_modes,
             "def set_modes(model):\n    for layer in model.backbone.modules():\n"
             "        if isinstance(layer, nn.BatchNorm1d):\n            layer.eval()\n"),
    "05.b": (_lab05.recalibrate,
             "def recalibrate(backbone, inputs):\n    backbone.train()\n    for layer in backbone.modules():\n"
             "        if isinstance(layer, nn.BatchNorm1d):\n            layer.reset_running_stats()\n"
             "    with torch.no_grad():\n        backbone(inputs)\n    backbone.eval()\n"),
    "05.c": (_lab05.prepare,
             "def prepare(model):\n    model.backbone.requires_grad_(False)\n    for layer in model.backbone:\n"
             "        if isinstance(layer, nn.BatchNorm1d):\n            layer.momentum = None\n"),
    "09.a": (_lab09.skip, "def skip(block, x):\n    return x.clone()\n"),
    "09.b": (_lab09.merge, "def merge(skipped, branched):\n    return torch.add(branched, skipped)\n"),
    "09.c": (_lab09.init_branches,
             "def init_branches(model):\n    for block in model.blocks:\n"
             "        nn.init.normal_(block.lin2.weight, std=1e-4)\n        nn.init.zeros_(block.lin2.bias)\n"),
    "10.a": (_lab10.clip, "def clip(scaler, optimizer, params, max_norm):\n    scaler.unscale_(optimizer)\n"
                          "    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))\n"
                          "    for p in params:\n        p.grad.mul_(min(1.0, max_norm / (norm.item() + 1e-6)))\n"),
    "10.b": (_lab10.backward, "def backward(loss, scaled_loss):\n    torch.autograd.backward(scaled_loss)\n"),
    "10.c": (_lab10.step, "def step(scaler, optimizer):\n"
                          "    grads = [p.grad for group in optimizer.param_groups for p in group['params']]\n"
                          "    if all(torch.isfinite(g).all() for g in grads):\n        optimizer.step()\n"
                          "    scaler.update()\n"),
    "16.a": (_lab16.block_forward, "def block_forward(block, h):\n"
                                   "    return torch.utils.checkpoint.checkpoint(block.forward, h, use_reentrant=False)\n"),
    "16.b": (_lab16.evaluate, "def evaluate(model, inputs, targets):\n    with torch.inference_mode():\n"
                              "        return (model(inputs) - targets).pow(2).mean().item()\n"),
    "16.c": (_lab16.log_error, "def log_error(history, model, inputs, targets):\n"
                               "    history.append(F.l1_loss(model(inputs), targets).detach())\n"),
    "13.a": (_lab13.log_error, "def log_error(history, model, inputs, targets):\n"
                               "    history.append(F.l1_loss(model(inputs), targets).detach())\n"),
    "13.b": (_lab13.forward, "def forward(model, inputs):\n    h = inputs\n    for layer in model:\n"
                             "        h = F.silu(h) if isinstance(layer, nn.SiLU) else layer(h)\n    return h\n"),
    "13.c": (_lab13.backward, "def backward(loss):\n    torch.autograd.backward(loss)\n"),
}

VARIANTS = [(lab_id, variant.id) for lab_id in lab_ids() for variant in lab_of(lab_id).variants]


def _variant(variant_id):
    lab = lab_of(variant_id[:2])
    return lab, lab.variant(variant_id)


def _passes(variant_id, repair, seed=0):
    lab, variant = _variant(variant_id)
    return check_lab(lab.id, variant_id, variant.cause, repair, seed=seed)


@pytest.mark.parametrize(("lab_id", "variant_id"), VARIANTS)
def test_the_right_diagnosis_with_a_correct_repair_passes_at_every_seed(lab_id, variant_id):
    first, second = REPAIRS[variant_id]
    for seed in SEEDS:
        for repair in (first, second):
            result = _passes(variant_id, repair, seed)
            assert result.passed, (seed, result.message)
            assert result.message.startswith(f"✓ Lab {lab_id} passed")
            assert result.exercise == f"{lab_id}.lab" and result.notebook == lab_of(lab_id).notebook


@pytest.mark.parametrize(("lab_id", "variant_id"), VARIANTS)
def test_every_other_diagnosis_is_rejected_with_the_measurement_that_contradicts_it(lab_id, variant_id):
    lab, variant = _variant(variant_id)
    defective, twin = reference_runs(lab_id, variant_id, 0)
    for cause in lab.causes:
        if cause.name == variant.cause:
            continue
        result = check_lab(lab_id, variant_id, cause.name, REPAIRS[variant_id][0], seed=0)
        assert not result.passed
        assert f"the diagnosis {cause.name!r} does not fit your run: {cause.measure(defective, twin)}" in result.message


@pytest.mark.parametrize(("lab_id", "variant_id"), VARIANTS)
def test_the_repair_of_another_variant_does_not_recover(lab_id, variant_id):
    lab, _ = _variant(variant_id)
    for other in lab.variants:
        if other.id == variant_id:
            continue
        result = _passes(variant_id, REPAIRS[other.id][0])
        assert not result.passed
        assert "does not recover:" in result.message, result.message


# --- repairs that dodge the training: each lab's stages give different ways in ---

def _twin_state(lab_id):
    return {k: v.clone() for k, v in reference_runs(lab_id, lab_of(lab_id).variants[0].id, 0)[1]
            .objects["model"].state_dict().items()}


def _dodges_00():
    twin = _twin_state("00")

    def update_lr_zero(model, optimizer, loss):
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        _lab00.update(model, optimizer, loss)

    def update_skipping_step(model, optimizer, loss):
        optimizer.zero_grad()
        loss.backward()

    def update_writing_twin(model, optimizer, loss):
        _lab00.update(model, optimizer, loss)
        model.load_state_dict(twin)

    def update_other_model(model, optimizer, loss):
        other = nn.Linear(6, 1)
        F.mse_loss(other(torch.randn(4, 6)), torch.zeros(4, 1)).backward()
        torch.optim.SGD(other.parameters(), lr=0.05).step()

    def update_hiding_error(model, optimizer, loss):
        try:
            optimizer.zero_grad()
            loss.backward()
            loss.backward()
            optimizer.step()
        except RuntimeError:
            pass

    return {"update": [(update_lr_zero, "the learning rate was changed to [0.0]"),
                       (update_skipping_step, "the optimizer stepped 0 times"),
                       (update_writing_twin, "weights changed outside optimizer.step()"),
                       (update_other_model, "the optimizer stepped 0 times"),
                       (update_hiding_error, "the optimizer stepped 0 times")]}


def _dodges_02():
    twin = _twin_state("02")

    def finish_lr_zero(model, optimizer, max_norm):
        optimizer.param_groups[0]["lr"] = 0.0
        _lab02.finish_step(model, optimizer, max_norm)

    def finish_skipping_step(model, optimizer, max_norm):
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def finish_writing_twin(model, optimizer, max_norm):
        _lab02.finish_step(model, optimizer, max_norm)
        model.load_state_dict(twin)

    def finish_other_model(model, optimizer, max_norm):
        other = nn.Linear(16, 1)
        torch.optim.SGD(other.parameters(), lr=0.2).step()

    def finish_hiding_error(model, optimizer, max_norm):
        try:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=True)
            raise RuntimeError("stop before the update")
        except RuntimeError:
            pass

    return {"finish_step": [(finish_lr_zero, "the learning rate was changed to [0.0]"),
                            (finish_skipping_step, "the optimizer stepped 0 times"),
                            (finish_writing_twin, "weights changed outside optimizer.step()"),
                            (finish_other_model, "the optimizer stepped 0 times"),
                            (finish_hiding_error, "the optimizer stepped 0 times")]}


def _dodges_05():
    twin = _twin_state("05")

    def modes_head_frozen(model):  # every gradient reaching the head is zeroed: as a learning rate of zero
        model.backbone.eval()
        for parameter in model.head.parameters():
            parameter.register_hook(torch.zeros_like)

    def modes_writing_twin(model):
        model.backbone.eval()
        model.load_state_dict(twin)

    def modes_other_head(model):
        model.backbone.eval()
        model.head = nn.Linear(_lab05.WIDTH, _lab05.CLASSES)

    def recalibrate_hiding_error(backbone, inputs):
        try:
            _lab05.recalibrate(backbone, inputs[:, :3])
        except RuntimeError:
            backbone.eval()

    return {"set_modes": [(modes_head_frozen, "does not recover"),
                          (modes_writing_twin, "weights changed outside optimizer.step()"),
                          (modes_other_head, "does not recover")],
            "recalibrate": [(recalibrate_hiding_error, "does not recover")]}


def _dodges_09():
    twin = _twin_state("09")

    def init_gradients_zeroed(model):  # every gradient zeroed: as a learning rate of zero
        _lab09.init_branches(model)
        for parameter in model.parameters():
            parameter.register_hook(torch.zeros_like)

    def init_writing_twin(model):
        model.load_state_dict(twin)

    def init_other_blocks(model):
        model.blocks = nn.ModuleList(_lab09.Block() for _ in model.blocks)
        _lab09.init_branches(model)

    def merge_hiding_error(skipped, branched):
        try:
            return skipped + branched.t()
        except RuntimeError:
            return skipped

    return {"init_branches": [(init_gradients_zeroed, "does not recover"),
                              (init_writing_twin, "init_branches changed stem.weight"),
                              (init_other_blocks, "init_branches changed blocks.0.lin1.weight")],
            "merge": [(merge_hiding_error, "does not recover")]}


def _dodges_10():
    twin = _twin_state("10")

    def step_lr_zero(scaler, optimizer):
        optimizer.param_groups[0]["lr"] = 0.0
        _lab10.step(scaler, optimizer)

    def step_skipped(scaler, optimizer):
        scaler.update()

    def step_writing_twin(scaler, optimizer):
        _lab10.step(scaler, optimizer)
        optimizer.param_groups[0]["params"][0].data.copy_(twin["0.weight"])

    def backward_other_model(loss, scaled_loss):
        other = nn.Linear(_lab10.FEATURES, _lab10.OUTPUTS)
        F.mse_loss(other(torch.randn(4, _lab10.FEATURES)), torch.zeros(4, _lab10.OUTPUTS)).backward()

    def step_hiding_error(scaler, optimizer):
        try:
            scaler.unscale_(optimizer)
            _lab10.step(scaler, optimizer)
        except RuntimeError:
            pass

    return {"step": [(step_lr_zero, "the learning rate was changed to [0.0]"),
                     (step_skipped, "the optimizer stepped 0 times"),
                     (step_writing_twin, "weights changed outside optimizer.step()"),
                     (step_hiding_error, "the run with your repair raised RuntimeError")],
            "backward": [(backward_other_model, "raised AssertionError: No inf checks were recorded")]}


def _dodges_13():
    twin = _twin_state("13")

    def backward_zero_gradient(loss):  # as a learning rate of zero
        (loss * 0).backward()

    def backward_skipped(loss):
        pass

    def forward_writing_twin(model, inputs):
        model.load_state_dict(twin)
        return model(inputs)

    def forward_other_model(model, inputs):
        return nn.Linear(_lab13.FEATURES, 1)(inputs)

    def backward_hiding_error(loss):
        try:
            loss.backward(inputs=[])
        except RuntimeError:
            pass

    return {"backward": [(backward_zero_gradient, "does not recover"), (backward_skipped, "does not recover"),
                         (backward_hiding_error, "does not recover")],
            "forward": [(forward_writing_twin, "weights changed outside optimizer.step()"),
                        (forward_other_model, "does not recover")]}


def _dodges_16():
    twin = _twin_state("16")

    def log_gradients_zeroed(history, model, inputs, targets):  # every later gradient zeroed: as a learning rate of zero
        _lab16.log_error(history, model, inputs, targets)
        for parameter in model.parameters():
            parameter.register_hook(torch.zeros_like)

    def evaluate_writing_twin(model, inputs, targets):
        model.load_state_dict(twin)
        return _lab16.evaluate(model, inputs, targets)

    def block_skipped(block, h):  # another, smaller model: the blocks never run
        return h

    def block_hiding_error(block, h):
        try:
            return _lab16.block_forward(block, h.t())
        except RuntimeError:
            return h

    return {"log_error": [(log_gradients_zeroed, "does not recover")],
            "evaluate": [(evaluate_writing_twin, "weights changed outside optimizer.step()")],
            "block_forward": [(block_skipped, "does not recover"), (block_hiding_error, "does not recover")]}


DODGES = {"00": _dodges_00, "02": _dodges_02, "05": _dodges_05, "09": _dodges_09, "10": _dodges_10,
          "13": _dodges_13, "16": _dodges_16}


@pytest.mark.parametrize(("lab_id", "variant_id"), VARIANTS)
def test_repairs_that_dodge_the_training_fail(lab_id, variant_id):
    lab, variant = _variant(variant_id)
    right = REPAIRS[variant_id][0]
    right = right if isinstance(right, dict) else {right.__name__: right}
    for stage, dodges in DODGES[lab_id]().items():
        for dodge, message in dodges:
            repair = {**right, stage: dodge}
            result = check_lab(lab_id, variant_id, variant.cause, repair, seed=0)
            assert not result.passed, dodge.__name__
            assert message in result.message, (dodge.__name__, result.message)


# --- the submission's form, and the hints ---

def test_a_diagnosis_outside_the_list_names_the_causes():
    result = check_lab("00", "00.a", "cosmic rays", _lab00.loss_of, seed=0)
    assert not result.passed
    assert "'cosmic rays' is not one of this lab's causes; choose one of: 'the loss is summed" in result.message


def test_a_repair_that_names_no_stage_lists_the_stages():
    def fix(prediction, target):
        return F.mse_loss(prediction, target)

    result = check_lab("00", "00.a", _lab00.CAUSES[0].name, fix, seed=0)
    assert "fix is not one of this lab's stages; the stages are make_batches:" in result.message
    result = check_lab("00", "00.a", _lab00.CAUSES[0].name, "x = 1", seed=0)
    assert "the repair must be a function named after the stage it replaces" in result.message


def test_a_repair_that_raises_is_reported_not_raised():
    def loss_of(prediction, target):
        raise ValueError("unfinished")

    result = check_lab("00", "00.a", _lab00.CAUSES[0].name, loss_of, seed=0)
    assert "the run with your repair raised ValueError: unfinished" in result.message


def test_hints_escalate_and_the_last_points_to_the_notebook_section():
    lab = lab_of("05")
    messages = [check_lab("05", "05.b", lab.causes[0].name, _lab05.recalibrate, seed=0, try_number=n).message
                for n in (1, 2, 3, 4, 5)]
    assert lab.hints[0] in messages[0] and "its hint says more" in messages[0]
    # The last hint waits for try grading.RECIPE_TRY, as an exercise's recipe does; the one before it
    # repeats until then, without promising more on the try that gives nothing new.
    assert grading.RECIPE_TRY == 4
    assert lab.hints[1] in messages[1] and "its hint says more" not in messages[1]
    assert lab.hints[1] in messages[2] and "its hint says more" in messages[2]
    assert lab.hints[2] in messages[3] and "cases D2 and D4" in lab.hints[2] and messages[4] == messages[3]


# --- the draw ---

def test_the_draw_is_the_same_for_the_same_learner_and_spreads_over_learners():
    assert draw("05", learner_key(learner="alice"), 3) == draw("05", learner_key(learner="alice"), 3)
    drawn = {draw("05", learner_key(learner=f"learner{n}"), 3)[0] for n in range(30)}
    assert drawn == {0, 1, 2}
    assert learner_key(seed=7) != learner_key(learner="7")


def test_under_nbgrader_the_draw_follows_the_student_id(monkeypatch, tmp_path):
    folder = tmp_path / "autograded" / "alice" / "ps1"
    folder.mkdir(parents=True)
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    monkeypatch.setenv("LABKIT_LEARNER", "someone else")
    assert nbgrader_student(folder) == "alice"
    monkeypatch.chdir(folder)
    assert learner_key() == "learner:alice"
    monkeypatch.delenv("NBGRADER_EXECUTION")
    assert learner_key() == "learner:someone else"


# --- the listing ---

def test_the_listing_names_causes_and_variants_without_code():
    listed = catalogue()
    assert [lab["id"] for lab in listed] == lab_ids()
    for lab in listed:
        assert len(lab["variants"]) >= 3
        assert all(variant["cause"] in lab["causes"] for variant in lab["variants"])
        assert len(lab["causes"]) > len({variant["cause"] for variant in lab["variants"]})  # decoys
        symptoms = [variant["symptom"] for variant in lab["variants"]]
        assert len(set(symptoms)) < len(symptoms)  # two variants look alike
    assert "def " not in json.dumps(listed) and "backward(" not in json.dumps(listed)


def test_python_m_labkit_labs_json():
    out = subprocess.run([sys.executable, "-m", "labkit", "labs", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == catalogue()


# --- the notebook's cells: start, the learner's diagnose(lab), check ---

def test_the_notebook_check_runs_diagnose_and_raises_only_under_nbgrader(capsys, monkeypatch):
    from labkit import labs

    session = labs.start("00", seed=1)
    shown = capsys.readouterr().out
    assert "training loss by step" in shown and "Causes you may diagnose:" in shown
    assert session._variant not in shown and "def " not in shown

    def diagnose(lab):
        raise NotImplementedError("Lab 00: replace these two lines with your answer")

    labs.check(session, diagnose)
    assert "✗ Lab 00 not yet: diagnose is not attempted yet" in capsys.readouterr().out
    labs.check(session, lambda lab: lab.causes[0])
    assert "must return two things, your diagnosis and your repair" in capsys.readouterr().out

    right = REPAIRS[session._variant][0]
    labs.check(session, lambda lab: (lab.lab.variant(session._variant).cause, right))
    assert "✓ Lab 00 passed" in capsys.readouterr().out

    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    with pytest.raises(AssertionError, match="diagnose is not attempted yet"):
        labs.check(session, diagnose)
