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
import linecache
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import get_worker_info

from labkit import grading
from labkit.labs import (
    _lab00,
    _lab01,
    _lab02,
    _lab03,
    _lab04,
    _lab05,
    _lab06,
    _lab07,
    _lab08,
    _lab09,
    _lab10,
    _lab11,
    _lab12,
    _lab13,
    _lab14,
    _lab15,
    _lab16,
    catalogue,
)
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
    "01.a": (_lab01.forward, "def forward(model, inputs):\n    return model(inputs)\n"),
    "01.b": (_lab01.prepare, "def prepare(model):\n    for parameter in model.parameters():\n"
                             "        parameter.requires_grad = True\n"),
    "01.c": (_lab01.loss_of, "def loss_of(prediction, targets):\n    return 2 * F.mse_loss(prediction, targets)\n"),
    "02.a": (_lab02.begin_step, "def begin_step(model, optimizer, max_norm):\n    model.zero_grad(set_to_none=True)\n"),
    "02.b": (_lab02.micro_loss, "def micro_loss(model, inputs, targets, micro_batches):\n"
                                "    return F.mse_loss(model(inputs), targets, reduction='sum') / "
                                "(len(inputs) * micro_batches)\n"),
    "02.c": (_lab02.finish_step,
             "def finish_step(model, optimizer, max_norm):\n    grads = [p.grad for p in model.parameters()]\n"
             "    norm = torch.sqrt(sum((g ** 2).sum() for g in grads))\n"
             "    scale = min(1.0, max_norm / (norm.item() + 1e-6))\n"
             "    for g in grads:\n        g.mul_(scale)\n    optimizer.step()\n"),
    "03.a": (_lab03.residual, "def residual(h, block):\n    out = h.clone()\n    out += block(h)\n    return out\n"),
    "03.b": (_lab03.normalise, "def normalise(h):\n    centred = h - h.mean(dim=1, keepdim=True)\n"
                               "    return centred / (centred.pow(2).sum(1, keepdim=True) / (h.shape[1] - 1)).sqrt()\n"),
    "03.c": (_lab03.rectify, "def rectify(h):\n    return h.clamp(min=0)\n"),
    "04.a": (_lab04.encode, "def encode(model, inputs):\n    mu, log_std = model.encoder(inputs).split(4, dim=1)\n"
                            "    return mu, log_std\n"),
    "04.b": (_lab04.draw_latent, "def draw_latent(mu, log_std):\n    return mu + log_std.exp() * torch.randn_like(mu)\n"),
    "04.c": (_lab04.validate, "def validate(model, inputs):\n    model.eval()\n    with torch.inference_mode():\n"
                              "        logits = model.predict(inputs)\n    return logits\n"),
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
    "06.a": (_lab06.make_optimizer,
             "def make_optimizer(groups, lr):\n    return torch.optim.Adam(groups, lr=lr, decoupled_weight_decay=True)\n"),
    "06.b": (_lab06.param_groups,
             "def param_groups(model, weight_decay):\n    decayed, kept = [], []\n    for module in model.modules():\n"
             "        if isinstance(module, nn.Linear):\n            decayed.append(module.weight)\n"
             "            kept.append(module.bias)\n        elif isinstance(module, nn.LayerNorm):\n"
             "            kept += [module.weight, module.bias]\n"
             "    return [{'params': kept, 'weight_decay': 0.0}, {'params': decayed, 'weight_decay': weight_decay}]\n"),
    "06.c": (_lab06.update,
             "def update(optimizer, scheduler, last_of_epoch):\n    optimizer.step()\n    if not last_of_epoch:\n"
             "        return\n    scheduler.step()\n"),
    "07.a": (_lab07.clip_norm,
             "def clip_norm(parameters, max_norm):\n    grads = [p.grad for p in parameters]\n"
             "    total = torch.sqrt(sum((g ** 2).sum() for g in grads))\n"
             "    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)\n    for g in grads:\n        g.mul_(scale)\n"
             "    return total\n"),
    "07.b": (_lab07.clipped, "def clipped(model):\n    return [p for layer in model for p in layer.parameters()]\n"),
    "07.c": (_lab07.finish_step,
             "def finish_step(optimizer, scaler, clip):\n    inverse = 1.0 / scaler.get_scale()\n"
             "    for group in optimizer.param_groups:\n        for p in group['params']:\n"
             "            p.grad.mul_(inverse)\n    clip()\n    optimizer.step()\n"),
    "08.a": (_lab08.init_weight, "def init_weight(weight):\n    bound = math.sqrt(6 / weight.shape[1])\n"
                                 "    weight.uniform_(-bound, bound)\n"),
    "08.b": (_lab08.init_bias, "def init_bias(bias):\n    bias.fill_(0.01)\n"),
    "08.c": (_lab08.forward, "def forward(model, inputs):\n    h = inputs\n    for layer in model:\n        h = layer(h)\n"
                             "    return h\n"),
    "11.a": (_lab11.drop_sensor,
             "def drop_sensor(model, sensor):\n    def zero_sensor(module, args):\n"
             "        return (args[0] * (torch.arange(args[0].shape[1]) != sensor),)\n\n"
             "    model.hidden.register_forward_pre_hook(zero_sensor)\n    torch.compiler.reset()\n"),
    "11.b": (_lab11.set_step, "def set_step(model, step):\n    model.step = torch.tensor(float(step))\n"),
    "11.c": (_lab11.compile_model,
             "def compile_model(model, backend):\n    return torch.compile(model, backend=backend, dynamic=True)\n"),
    "12.a": (_lab12.micro_loss,
             "def micro_loss(model, inputs, targets, accumulation_steps):\n"
             "    return F.cross_entropy(model(inputs), targets, reduction='sum') / (len(inputs) * accumulation_steps)\n"),
    "12.b": (_lab12.all_reduce,
             "def all_reduce(device_grads):\n    count = len(device_grads)\n"
             "    return [sum(grads) / count for grads in zip(*device_grads)]\n"),
    "12.c": (_lab12.shard,
             "def shard(rows, devices, accumulation_steps):\n    pieces = rows.split(len(rows) // (devices * accumulation_steps))\n"
             "    return [list(pieces[d * accumulation_steps:(d + 1) * accumulation_steps]) for d in range(devices)]\n"),
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
    "14.a": (_lab14.seed_worker, "def seed_worker(dataset, worker_seed):\n"
                                 "    dataset.generator = torch.Generator().manual_seed(worker_seed + 1)\n"),
    "14.b": (_lab14.worker_share, "def worker_share(samples, worker_id, num_workers):\n"
                                  "    return len(range(worker_id, samples, num_workers))\n"),
    "14.c": (_lab14.draw_sample, "def draw_sample(x, y, generator):\n"
                                 "    noise = 0.3 * torch.randn(x.shape[1], generator=generator)\n"
                                 "    index = torch.randint(0, len(x), (1,), generator=generator).item()\n"
                                 "    return index, x[index] + noise, y[index]\n"),
    "14.d": (_lab14.collate, "def collate(samples):\n    samples = sorted(samples, key=lambda s: float(s[1].norm()))\n"
                             "    return (torch.tensor([s[0] for s in samples]), torch.stack([s[1] for s in samples]),\n"
                             "            torch.tensor([int(s[2]) for s in samples]))\n"),
    "15.a": (_lab15.rank_rows, "def rank_rows(rows, rank, world_size, epoch, seed):\n"
                               "    sampler = torch.utils.data.DistributedSampler(range(rows), num_replicas=world_size,\n"
                               "                                                  rank=rank, seed=seed)\n"
                               "    sampler.set_epoch(epoch)\n    return torch.tensor(list(sampler))\n"),
    "15.b": (_lab15.forward_backward, "def forward_backward(ddp, inputs, targets):\n"
                                      "    loss = F.cross_entropy(ddp(inputs), targets)\n"
                                      "    torch.autograd.backward(loss)\n    return loss\n"),
    "15.c": (_lab15.wrap, "def wrap(model):\n"
                          "    return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)\n"),
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


def _dodges_01():
    twin = _twin_state("01")

    def prepare_zeroing_gradients(model):  # every gradient is zeroed on its way in: as a learning rate of zero
        for parameter in model.parameters():
            parameter.register_hook(torch.zeros_like)

    def forward_writing_twin(model, inputs):
        model.load_state_dict(twin)
        return model(inputs)

    def forward_other_model(model, inputs):
        return nn.Linear(_lab01.FEATURES, _lab01.TARGETS)(inputs)

    def forward_hiding_error(model, inputs):
        try:
            return model(inputs[:, :3])
        except RuntimeError:
            return torch.zeros(len(inputs), _lab01.TARGETS, requires_grad=True)

    def loss_of_zero(prediction, targets):
        return 0 * _lab01.loss_of(prediction, targets)

    return {"prepare": [(prepare_zeroing_gradients, "parameters that never moved")],
            "forward": [(forward_writing_twin, "weights changed outside optimizer.step()"),
                        (forward_other_model, "parameters that never moved"),
                        (forward_hiding_error, "parameters that never moved")],
            "loss_of": [(loss_of_zero, "parameters that never moved")]}


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


def _dodges_03():
    twin = {name[len("block."):]: value for name, value in _twin_state("03").items() if name.startswith("block.")}

    def residual_other_block(h, block):
        return h + nn.Sequential(nn.Linear(_lab03.WIDTH, _lab03.WIDTH), nn.Tanh())(h)

    def residual_writing_twin(h, block):
        block.load_state_dict(twin)
        return h + block(h)

    def residual_detached(h, block):  # backward's error hidden by cutting the graph
        return (h + block(h)).detach()

    def normalise_zero_gradient(h):  # every gradient below the normalisation zeroed: as a learning rate of zero
        h.register_hook(torch.zeros_like)
        return _lab03.normalise(h)

    def normalise_through_data(h):  # backward's error hidden from the version counter
        h.data.sub_(h.data.mean(1, keepdim=True))
        h.data.div_(h.data.std(1, keepdim=True))
        return h

    return {"residual": [(residual_other_block, "does not recover"),
                         (residual_writing_twin, "weights changed outside optimizer.step()"),
                         (residual_detached, "does not recover")],
            "normalise": [(normalise_zero_gradient, "does not recover"),
                          (normalise_through_data, "does not recover")]}


def _dodges_04():
    twin = _twin_state("04")

    def encode_writing_twin(model, inputs):
        model.load_state_dict(twin)
        return _lab04.encode(model, inputs)

    def encode_other_model(model, inputs):
        return nn.Linear(_lab04.FEATURES, 2 * _lab04.LATENT)(inputs).chunk(2, 1)

    def encode_zero_gradient(model, inputs):  # every gradient into the encoder zeroed: as a learning rate of zero
        out = model.encoder(inputs)
        out.register_hook(torch.zeros_like)
        return out.chunk(2, 1)

    def draw_latent_mean_detached(mu, log_std):
        return mu.detach()

    def validate_hiding_error(model, inputs):
        try:
            torch.set_grad_enabled(False)
            return model.predict(inputs[:, :3])
        except RuntimeError:
            return torch.zeros(len(inputs), _lab04.CLASSES)

    return {"encode": [(encode_writing_twin, "weights changed outside optimizer.step()"),
                       (encode_other_model, "parameters that never moved"),
                       (encode_zero_gradient, "parameters that never moved")],
            "draw_latent": [(draw_latent_mean_detached, "parameters that never moved")],
            "validate": [(validate_hiding_error, "loss.backward() still raises")]}


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


def _dodges_06():
    twin = _twin_state("06")

    def update_lr_zero(optimizer, scheduler, last_of_epoch):
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        _lab06.update(optimizer, scheduler, last_of_epoch)

    def update_skipping_step(optimizer, scheduler, last_of_epoch):
        if last_of_epoch:
            scheduler.step()

    def update_writing_twin(optimizer, scheduler, last_of_epoch):
        _lab06.update(optimizer, scheduler, last_of_epoch)
        with torch.no_grad():
            for parameter in (p for group in optimizer.param_groups for p in group["params"]):
                parameter.copy_(next(value for value in twin.values() if value.shape == parameter.shape))

    def update_hiding_error(optimizer, scheduler, last_of_epoch):
        def closure():
            raise RuntimeError("no loss to recompute here")

        try:
            optimizer.step(closure)
        except RuntimeError:
            pass

    def optimizer_lr_zero(groups, lr):
        return torch.optim.AdamW(groups, lr=0.0)

    def optimizer_other_model(groups, lr):
        return torch.optim.AdamW(nn.Linear(_lab06.FEATURES, _lab06.CLASSES).parameters(), lr=lr)

    return {"update": [(update_lr_zero, "the learning rate was changed to [0.0]"),
                       (update_skipping_step, "the optimizer stepped 0 times"),
                       (update_writing_twin, "weights changed outside optimizer.step()"),
                       (update_hiding_error, "the optimizer stepped 0 times")],
            "make_optimizer": [(optimizer_lr_zero, "the learning rate was changed to [0.0]"),
                               (optimizer_other_model, "does not recover")]}


def _dodges_07():
    twin = _twin_state("07")

    def finish_lr_zero(optimizer, scaler, clip):
        optimizer.param_groups[0]["lr"] = 0.0
        _lab07.finish_step(optimizer, scaler, clip)

    def finish_skipping_step(optimizer, scaler, clip):
        clip()

    def finish_writing_twin(optimizer, scaler, clip):
        _lab07.finish_step(optimizer, scaler, clip)
        with torch.no_grad():
            for parameter, value in zip(optimizer.param_groups[0]["params"], twin.values()):
                parameter.copy_(value)

    def finish_other_model(optimizer, scaler, clip):
        other = nn.Linear(_lab07.FEATURES, _lab07.CLASSES)
        torch.optim.SGD(other.parameters(), lr=_lab07.LR).step()

    def finish_hiding_error(optimizer, scaler, clip):
        try:
            scaler.unscale_(optimizer)
            clip()
            scaler.unscale_(optimizer)  # raises: already unscaled since the last update
            scaler.step(optimizer)
        except RuntimeError:
            pass
        scaler.update()

    def clip_norm_zeroing(parameters, max_norm):  # as a learning rate of zero
        for parameter in parameters:
            parameter.grad.zero_()
        return torch.tensor(0.0)

    return {"finish_step": [(finish_lr_zero, "the learning rate was changed to [0.0]"),
                            (finish_skipping_step, "the optimizer stepped 0 times"),
                            (finish_writing_twin, "weights changed outside optimizer.step()"),
                            (finish_other_model, "the optimizer stepped 0 times"),
                            (finish_hiding_error, "the optimizer stepped 0 times")],
            "clip_norm": [(clip_norm_zeroing, "does not recover")]}


def _dodges_12():
    twin = _twin_state("12")

    def all_reduce_zero(device_grads):  # as a learning rate of zero
        return [torch.zeros_like(grad) for grad in device_grads[0]]

    def micro_loss_writing_twin(model, inputs, targets, accumulation_steps):
        model.load_state_dict(twin)
        return _lab12.micro_loss(model, inputs, targets, accumulation_steps)

    def micro_loss_other_model(model, inputs, targets, accumulation_steps):
        other = nn.Linear(_lab12.FEATURES, _lab12.CLASSES)
        unused = sum(p.sum() for p in model.parameters()) * 0
        return F.cross_entropy(other(inputs), targets) / accumulation_steps + unused

    def micro_loss_hiding_error(model, inputs, targets, accumulation_steps):
        try:
            return F.cross_entropy(model(inputs[:, :3]), targets) / accumulation_steps
        except RuntimeError:
            return model(inputs).sum() * 0

    return {"all_reduce": [(all_reduce_zero, "does not recover")],
            "micro_loss": [(micro_loss_writing_twin, "weights changed outside optimizer.step()"),
                           (micro_loss_other_model, "does not recover"),
                           (micro_loss_hiding_error, "does not recover")]}
def _dodges_08():
    twin = _twin_state("08")

    def init_weight_writing_twin(weight, weights=iter([v for k, v in twin.items() if k.endswith("weight")])):
        weight.copy_(next(weights))

    def forward_writing_twin(model, inputs):
        model.load_state_dict(twin)
        return model(inputs)

    def forward_other_model(model, inputs):
        return nn.Linear(_lab08.FEATURES, _lab08.OUTPUTS)(inputs)

    def forward_zeroing_gradients(model, inputs):  # as a learning rate of zero
        output = model(inputs)
        output.register_hook(torch.zeros_like)
        return output

    def forward_hiding_error(model, inputs):
        try:
            return model(inputs.t())
        except RuntimeError:
            return torch.zeros(len(inputs), _lab08.OUTPUTS, requires_grad=True)

    return {"init_weight": [(init_weight_writing_twin, "the weights were trained before training began")],
            "forward": [(forward_writing_twin, "weights changed outside optimizer.step()"),
                        (forward_other_model, "does not recover"),
                        (forward_zeroing_gradients, "does not recover"),
                        (forward_hiding_error, "does not recover")]}


def _dodges_11():
    twin = _twin_state("11")

    def compile_model_not_compiling(model, backend):
        return model

    def compile_model_other_model(model, backend):
        return torch.compile(_lab11.SensorNet(), backend=backend)

    def drop_sensor_writing_twin(model, sensor):
        model.load_state_dict(twin)

    def set_step_zeroing_gradients(model, step):  # as a learning rate of zero
        _lab11.set_step(model, step)
        if step == 0:
            for parameter in model.parameters():
                parameter.register_hook(torch.zeros_like)

    def drop_sensor_hiding_error(model, sensor):
        try:
            model.keep[sensor + len(model.keep)] = 0.0
        except IndexError:
            pass

    return {"compile_model": [(compile_model_not_compiling, "does not recover: 0 graphs compiled"),
                              (compile_model_other_model, "does not recover")],
            "drop_sensor": [(drop_sensor_writing_twin, "weights changed outside optimizer.step()"),
                            (drop_sensor_hiding_error, "does not recover")],
            "set_step": [(set_step_zeroing_gradients, "does not recover")]}


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


def _dodges_14():
    def collate_zero_inputs(samples):  # nothing left to learn from: as a learning rate of zero
        indices, inputs, labels = _lab14.collate(samples)
        return indices, torch.zeros_like(inputs), labels

    def worker_share_skipping(samples, worker_id, num_workers):  # worker 1's batches (and steps) skipped
        return 0 if worker_id else _lab14.worker_share(samples, worker_id, num_workers)

    def draw_sample_other_task(x, y, generator):  # another task trained: labels from another rule
        index, noisy, _ = _lab14.draw_sample(x, y, generator)
        return index, noisy, noisy[:_lab14.CLASSES].argmax()

    def collate_hiding_error(samples):
        try:
            return _lab14.collate([sample[:2] for sample in samples])
        except ValueError:
            return (torch.arange(len(samples)), torch.zeros(len(samples), _lab14.FEATURES),
                    torch.zeros(len(samples), dtype=torch.long))

    return {"collate": [(collate_zero_inputs, "does not recover"), (collate_hiding_error, "does not recover")],
            "worker_share": [(worker_share_skipping, "does not recover")],
            "draw_sample": [(draw_sample_other_task, "does not recover")]}


def _dodges_15():
    twin = _twin_state("15")

    def forward_backward_zero_gradient(ddp, inputs, targets):  # as a learning rate of zero
        loss = F.cross_entropy(ddp(inputs), targets)
        (loss * 0).backward()
        return loss

    def forward_backward_skipping_backward(ddp, inputs, targets):
        return F.cross_entropy(ddp(inputs), targets)

    def wrap_writing_twin(model):
        model.load_state_dict(twin)
        return _lab15.wrap(model)

    def wrap_other_model(model):
        return _lab15.wrap(nn.Linear(_lab15.FEATURES, _lab15.CLASSES))

    def forward_backward_hiding_error(ddp, inputs, targets):
        try:
            return _lab15.forward_backward(ddp, inputs[:, :3], targets)
        except RuntimeError:
            return F.cross_entropy(ddp(inputs), targets).detach()

    return {"forward_backward": [(forward_backward_zero_gradient, "does not recover"),
                                 (forward_backward_skipping_backward, "does not recover"),
                                 (forward_backward_hiding_error, "does not recover")],
            "wrap": [(wrap_writing_twin, "weights changed outside optimizer.step()"),
                     (wrap_other_model, "does not recover")]}


DODGES = {lab_id: globals()[f"_dodges_{lab_id}"] for lab_id in lab_ids()}  # every lab has its _dodges_NN


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


# --- labs whose training runs in other processes: a fault stops every process the run started ---

def _live_children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE}


def _faults_14(monkeypatch):
    def draw_sample_dying(x, y, generator):
        os._exit(3)

    def draw_sample_stuck(x, y, generator):
        time.sleep(60)

    interrupted = []  # each worker process has its own copy: the first worker interrupts once

    def draw_sample_interrupting(x, y, generator):  # Ctrl-C reaches the process running the loop
        if not interrupted and get_worker_info().id == 0:
            interrupted.append(True)
            os.kill(os.getppid(), signal.SIGINT)
        return _lab14.draw_sample(x, y, generator)

    monkeypatch.setattr(_lab14, "WAIT_S", 1)
    return [({"draw_sample": draw_sample_dying}, "exited unexpectedly"),
            ({"draw_sample": draw_sample_stuck}, "DataLoader timed out after 1 seconds"),
            ({"draw_sample": draw_sample_interrupting}, KeyboardInterrupt)]


def _faults_15(monkeypatch):
    def forward_backward_dying(ddp, inputs, targets):
        if dist.get_rank() == 1:
            os._exit(3)
        return _lab15.forward_backward(ddp, inputs, targets)

    def forward_backward_stuck(ddp, inputs, targets):
        if dist.get_rank() == 1:
            time.sleep(60)
        return _lab15.forward_backward(ddp, inputs, targets)

    interrupted = []  # each rank process has its own copy: rank 1 interrupts once

    def forward_backward_interrupting(ddp, inputs, targets):  # Ctrl-C reaches the process running run_ranks
        if not interrupted and dist.get_rank() == 1:
            interrupted.append(True)
            os.kill(os.getppid(), signal.SIGINT)
        return _lab15.forward_backward(ddp, inputs, targets)

    monkeypatch.setattr(_lab15, "TIMEOUT_S", 2.0)
    return [({"forward_backward": forward_backward_dying}, "rank 1 died: exited with code 3"),
            ({"forward_backward": forward_backward_stuck}, "rank 1 did not finish within 2 s"),
            ({"forward_backward": forward_backward_interrupting}, KeyboardInterrupt)]


@pytest.mark.parametrize(("lab_id", "variant_id"), [("14", "14.c"), ("15", "15.b")])
def test_a_dead_stuck_or_interrupted_worker_stops_every_process_the_run_started(monkeypatch, lab_id, variant_id):
    # Ctrl-C as a terminal delivers it, also when the test run was started in the background, where SIGINT is ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_runs_stop_every_process(monkeypatch, lab_id, variant_id)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_the_loop_talks_to_its_workers_takes_effect_when_the_call_returns():
    # Lab 14's calls into its DataLoader run so: a KeyboardInterrupt raised inside a Queue's put, with its lock
    # taken, left the lock held, and the queue's finalizer later hung the test run in the garbage collector.
    from labkit.labs._common import interrupts_deferred

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python runs the handler here: it must not raise inside the call
            reached.append(True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == [True]


def _interrupted_runs_stop_every_process(monkeypatch, lab_id, variant_id):
    _, variant = _variant(variant_id)
    reference_runs(lab_id, variant_id, 0)  # computed before the timeout is shortened
    before = _live_children()
    for repair, outcome in {"14": _faults_14, "15": _faults_15}[lab_id](monkeypatch):
        if outcome is KeyboardInterrupt:
            with pytest.raises(KeyboardInterrupt):
                check_lab(lab_id, variant_id, variant.cause, repair, seed=0)
        else:
            result = check_lab(lab_id, variant_id, variant.cause, repair, seed=0)
            assert not result.passed and "the run with your repair raised" in result.message, result.message
            assert outcome in result.message, (repair, result.message)
        assert _live_children() <= before, repair

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
    labs.check(session, lambda lab: (lab._lab.variant(session._variant).cause, right))
    assert "✓ Lab 00 passed" in capsys.readouterr().out

    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    with pytest.raises(AssertionError, match="diagnose is not attempted yet"):
        labs.check(session, diagnose)


# --- the verdict that counts: the answer cell graded in a process of its own (labkit.labs._isolated) ---

def _answer_cell(variant_id: str, extra: str = "") -> str:
    """The lab's answer cell as a learner writes it: ``variant_id``'s diagnosis and its second repair (as text)."""
    lab_id = variant_id.split(".")[0]
    lab = lab_of(lab_id)
    repair = REPAIRS[variant_id][1]
    stage = repair.split("def ", 1)[1].split("(", 1)[0]
    return (f"# lab {lab_id}: your answer\n{extra}{repair}\n"
            f"def diagnose(lab):\n    return {lab.variant(variant_id).cause!r}, {stage}\n")


def _learner_with(variant_id: str, other_than: str = "") -> str:
    """A learner key whose draw of the lab is ``variant_id`` (the draw is a hash: found, not chosen)."""
    lab_id = variant_id.split(".")[0]
    lab = lab_of(lab_id)
    return next(key for n in range(200) if (key := learner_key(learner=f"learner{n}")) != other_than
                and lab.variants[draw(lab_id, key, len(lab.variants))[0]].id == variant_id)


@pytest.mark.parametrize("lab_id", lab_ids())
def test_every_lab_passes_a_correct_answer_cell_in_the_isolated_grader(lab_id):
    # the verdict that counts (nbgrader, progress, labs.check on an answer cell) comes from a child
    # process that refuses fork and subprocess: every lab must train there; one variant a lab, taken in turn
    from labkit.labs._isolated import grade_lab_cell

    variants = lab_of(lab_id).variants
    variant_id = variants[lab_ids().index(lab_id) % len(variants)].id
    result = grade_lab_cell(lab_id, _answer_cell(variant_id), "diagnose", _learner_with(variant_id))
    assert result.passed, result.message


def test_the_isolated_grader_redraws_the_variant_from_the_learner_and_judges_their_own_repair():
    from labkit.labs._isolated import grade_lab_cell

    first, second = _learner_with("00.a"), _learner_with("00.c")
    assert grade_lab_cell("00", _answer_cell("00.a"), "diagnose", first).passed
    assert grade_lab_cell("00", _answer_cell("00.c"), "diagnose", second).passed
    other = grade_lab_cell("00", _answer_cell("00.a"), "diagnose", second)
    assert not other.passed and "does not fit your run" in other.message and other.exercise == "00.lab"


# Lines an answer cell adds to pass without the repair: each is undone before it can change the verdict.
PATCH_LABKIT = ("import labkit.labs as _labs, labkit.labs._check as _check\n"
                "_labs.check = lambda *a, **k: print('✓ Lab 00 passed')\n"
                "_check.check_lab = lambda *a, **k: None\n"
                "import os\nos.environ.pop('NBGRADER_EXECUTION', None)\n")
FORGE_THE_LAB = ("\ndef forged(lab):\n    for variant in lab._lab.variants:\n"
                 "        object.__setattr__(variant, 'cause', lab.causes[3])\n        variant.defect.clear()\n"
                 "    object.__setattr__(lab._lab, 'recovery', lambda repaired, twin: (True, 'forged'))\n"
                 "    torch.allclose = lambda *a, **k: True\n"
                 "    return lab.causes[3], {'loss_of': lambda p, t: F.mse_loss(p, t)}\n")


@pytest.mark.parametrize("attack", ["patch labkit and the environment", "forge the lab's definition", "exit",
                                    "ignore the alarm and loop"])
def test_an_answer_cell_that_attacks_the_grader_fails_only_its_own_lab(attack, monkeypatch):
    from labkit.labs import _isolated

    key = _learner_with("00.b")
    cell = {"patch labkit and the environment": _answer_cell("00.a", PATCH_LABKIT),
            "forge the lab's definition": _answer_cell("00.a") + FORGE_THE_LAB,
            "exit": "# lab 00: your answer\ndef diagnose(lab):\n    import os\n    os._exit(0)\n",
            "ignore the alarm and loop": "# lab 00: your answer\nimport signal\n"
                                         "def diagnose(lab):\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                                         "    while True:\n        pass\n"}[attack]
    function = "forged" if attack == "forge the lab's definition" else "diagnose"
    monkeypatch.setattr(_isolated, "LAB_TIME_LIMIT_S", 2.0)  # the loop is stopped in seconds, not minutes
    result = _isolated.grade_lab_cell("00", cell, function, key)
    assert not result.passed, result.message
    expected = {"patch labkit and the environment": "does not fit your run",
                "forge the lab's definition": "does not fit your run",
                "exit": "it ended the grading process (exit code 0)",
                "ignore the alarm and loop": "the grader stopped it"}[attack]
    assert expected in result.message


def test_a_check_in_the_kernel_grades_the_answer_cell_in_isolation(capsys, monkeypatch):
    from labkit import labs

    session = labs.start("00", learner="lab-learner")
    capsys.readouterr()
    cell = _answer_cell(session._variant, "import labkit.labs._check as _c\n_c.check_lab = None\n")
    cell_file = "/tmp/ipykernel_4242/7654321.py"  # how IPython names a cell's code, which linecache holds
    monkeypatch.setitem(linecache.cache, cell_file, (len(cell), None, cell.splitlines(True), cell_file))
    namespace = dict(grading.EXERCISE_NAMESPACE)
    exec(compile(cell.replace("_c.check_lab = None", "pass"), cell_file, "exec"), namespace)  # noqa: S102
    labs.check(session, namespace["diagnose"])
    assert "✓ Lab 00 passed" in capsys.readouterr().out  # the cell's source, run away from this process, passed
    stub = "# lab 00: your answer\ndef diagnose(lab):\n    raise NotImplementedError('Lab 00')\n"
    monkeypatch.setitem(linecache.cache, cell_file, (len(stub), None, stub.splitlines(True), cell_file))
    labs.check(session, namespace["diagnose"])  # the function still passes here; the cell it came from does not
    assert "diagnose is not attempted yet" in capsys.readouterr().out


def test_every_labs_defect_free_stages_can_be_withheld_and_its_measurements_do_not_use_them():
    # The grading process withholds the fix by giving the stage's function object refusing code
    # (labkit.labs._isolated._withhold_the_fix): that needs a plain function without a closure, and the lab's
    # own measurements must go through a copy (reference_copy), or the learner's right repair would fail.
    import types

    for lab_id in lab_ids():
        for name, stage in lab_of(lab_id).correct.items():
            assert isinstance(stage, types.FunctionType) and not stage.__code__.co_freevars, (lab_id, name)
    probe = lab_of("03").correct["rectify"]
    original = probe.__code__
    reference_runs("03", "03.c", 0)  # trained before the fix is withheld, as the grading process does
    try:
        probe.__code__ = (lambda *args, **kwargs: 1 / 0).__code__
        # the lab's reference gradient and final loss still hold with the learner's own rectify
        assert _passes("03.c", REPAIRS["03.c"][1]).passed
    finally:
        probe.__code__ = original


@pytest.mark.parametrize("lab_id", ["14", "15"])
def test_the_isolated_grader_lets_a_lab_start_its_own_workers_and_nothing_else(lab_id):
    from labkit.labs._isolated import grade_lab_cell

    lab, key = lab_of(lab_id), learner_key(learner="learner0")
    variant = lab.variants[draw(lab_id, key, len(lab.variants))[0]]
    stage = next(iter(variant.defect))

    def cell(repair: str) -> str:
        return f"# lab {lab_id}: your answer\n{repair}\ndef diagnose(lab):\n    return {variant.cause!r}, {stage}\n"

    assert grade_lab_cell(lab_id, cell(REPAIRS[variant.id][1]), "diagnose", key).passed
    # the stage, run in a worker or rank the lab forked, may not signal a process the lab did not start
    signalling = REPAIRS[variant.id][1].replace("):\n", "):\n    import os\n    os.kill(os.getppid(), 0)\n", 1)
    result = grade_lab_cell(lab_id, cell(signalling), "diagnose", key)
    assert not result.passed and "PermissionError" in result.message, result.message  # the audit hook's refusal
