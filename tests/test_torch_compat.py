"""Every entry of labkit._torch_compat still does what labkit needs from the installed torch.

A failure here names the entry and the torch version: that is where an upgrade broke labkit."""

import ast
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch_names import missing_torch_attributes

from labkit import _torch_compat as compat


def test_a_missing_private_api_is_a_clear_error_naming_the_torch_version():
    with pytest.raises(compat.TorchCompatError, match=re.escape(f"torch {torch.__version__} has no torch._no_such_api")):
        compat.private("torch", "_no_such_api")


def test_foreach_kernels_copy_subtract_and_norm_lists_of_tensors():
    before = [torch.zeros(3), torch.zeros(2, 2)]
    now = [torch.tensor([3.0, 4.0, 0.0]), torch.ones(2, 2)]
    compat.foreach_copy_(before, [t * 2 for t in now])
    assert torch.equal(before[0], torch.tensor([6.0, 8.0, 0.0]))
    deltas = compat.foreach_sub(before, now)
    assert [n.item() for n in compat.foreach_norm(deltas)] == pytest.approx([5.0, 2.0])


def test_foreach_sub_in_place_subtracts_into_its_first_list():
    before, now = [torch.tensor([3.0, 4.0]), torch.tensor([2.0])], [torch.ones(2), torch.ones(1)]
    compat.foreach_sub_(before, now)
    assert [t.tolist() for t in before] == [[2.0, 3.0], [1.0]]


def test_backward_callbacks_run_only_for_a_backward_that_finishes_and_task_ids_tell_backwards_apart():
    weight = torch.ones(2, requires_grad=True)
    seen, finished = [], []

    def hook(param):
        seen.append(compat.graph_task_id())
        compat.queue_backward_callback(lambda: finished.append(seen[-1]))

    class RaisesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("backward failed")

    weight.register_post_accumulate_grad_hook(hook)
    (weight * 2).sum().backward()
    # The engine runs later-made nodes first: weight gets its gradient, then the branch made
    # before it raises, so that backward never finishes.
    failing_branch = RaisesInBackward.apply(torch.ones(1, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="backward failed"):
        (failing_branch + (weight * 2).sum()).backward()
    (weight * 3).sum().backward()
    assert compat.graph_task_id() == -1
    assert len(seen) == len(set(seen)) == 3
    assert finished == [seen[0], seen[2]]


def test_a_swap_changes_the_tensor_identity_and_rearming_makes_the_hooks_run_again():
    model = torch.nn.Linear(2, 1)
    calls = []
    model.weight.register_post_accumulate_grad_hook(lambda param: calls.append(param.dtype))
    identity = compat.tensor_identity(model.weight)
    torch.utils.swap_tensors(model.weight, torch.nn.Parameter(model.weight.detach().double()))
    assert compat.tensor_identity(model.weight) != identity
    model.bias.data = model.bias.data.double()
    compat.rearm_post_accumulate_grad_hooks(model.weight)
    model(torch.ones(1, 2, dtype=torch.double)).sum().backward()
    assert calls == [torch.float64]


def _broke(entry: str) -> str:
    return f"labkit._torch_compat.{entry} no longer does what labkit needs on torch {torch.__version__}"


def test_fake_tensor_mode_makes_tensors_with_shapes_and_no_memory_behind_them():
    with compat.FakeTensorMode():
        fake = torch.empty(1024, 1024)
    assert fake.shape == (1024, 1024) and fake.device.type == "cpu", _broke("FakeTensorMode")
    # the storage lives on the meta device (nothing allocated), yet says how many bytes it would hold
    storage = fake.untyped_storage()
    assert storage.device.type == "meta" and storage.nbytes() == 1024 * 1024 * 4, _broke("FakeTensorMode")


def test_fake_tensor_failures_are_what_a_fake_run_raises_for_a_data_dependent_op():
    assert compat.FAKE_TENSOR_FAILURES, _broke("FAKE_TENSOR_FAILURES (none of the probed names exists)")
    assert all(issubclass(kind, Exception) for kind in compat.FAKE_TENSOR_FAILURES), _broke("FAKE_TENSOR_FAILURES")
    with compat.FakeTensorMode():
        try:
            torch.nonzero(torch.ones(4))  # output shape depends on the data: a fake tensor cannot know it
        except compat.FAKE_TENSOR_FAILURES:
            return
        except Exception as error:
            pytest.fail(f"{_broke('FAKE_TENSOR_FAILURES')}: a fake nonzero raised {type(error).__name__}")
    pytest.fail(f"{_broke('FAKE_TENSOR_FAILURES')}: a fake nonzero raised nothing")


def test_fake_tensor_failures_unlogged_drops_the_logged_traceback_and_keeps_the_error(caplog):
    def failing_fake_matmul():
        with compat.FakeTensorMode():
            torch.mm(torch.empty(3, 5), torch.empty(4, 8))  # a meta kernel that raises

    with caplog.at_level(logging.DEBUG, logger="torch._subclasses.fake_tensor"):
        with pytest.raises(RuntimeError):
            failing_fake_matmul()
        assert any(record.exc_info for record in caplog.records), _broke(
            "fake_tensor_failures_unlogged (FakeTensorMode no longer logs through torch._subclasses.fake_tensor.log)")
        caplog.clear()
        with compat.fake_tensor_failures_unlogged(), pytest.raises(RuntimeError, match="3, 5"):
            failing_fake_matmul()
        assert not [record for record in caplog.records if record.exc_info], _broke("fake_tensor_failures_unlogged")
    assert not logging.getLogger("torch._subclasses.fake_tensor").filters, "the filter outlived its block"


def test_a_missing_version_probe_name_is_left_out_and_a_missing_module_is_a_clear_error():
    assert compat.present("torch", ("_foreach_norm", "_no_such_api")) == (compat.foreach_norm,)
    with pytest.raises(compat.TorchCompatError, match=re.escape(f"torch {torch.__version__} has no module")):
        compat.present("torch._no_such_module", ("anything",))


def test_torch_dispatch_mode_sees_every_aten_op():
    class Names(compat.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.name())
            return func(*args, **(kwargs or {}))

    with Names() as names:
        torch.ones(3).mul(2)
    assert "aten::mul.Tensor" in names.seen, _broke("TorchDispatchMode")


def test_pytree_flattens_maps_and_rebuilds_nested_containers():
    tree = {"a": [torch.ones(2), 3], "b": (torch.zeros(1),)}
    leaves, spec = compat.tree_flatten(tree)
    assert sum(isinstance(leaf, torch.Tensor) for leaf in leaves) == 2, _broke("tree_flatten")
    rebuilt = compat.tree_unflatten(leaves, spec)
    assert rebuilt["a"][1] == 3 and torch.equal(rebuilt["b"][0], tree["b"][0]), _broke("tree_unflatten")
    doubled = compat.tree_map_only(torch.Tensor, lambda t: t * 2, tree)
    assert torch.equal(doubled["a"][0], torch.full((2,), 2.0)) and doubled["a"][1] == 3, _broke("tree_map_only")


def test_aten_ops_keeps_the_overloads_this_build_has():
    ops = compat.aten_ops(("convolution", "no_such_op"))
    assert ops == frozenset({torch.ops.aten.convolution.default}), _broke("aten_ops")


def test_aten_arguments_reads_the_lstm_kernels_train_and_hidden_size_by_schema_name():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN, so nn.LSTM does not call aten::mkldnn_rnn_layer")
    calls = []

    class Record(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mkldnn_rnn_layer.default:
                calls.append(compat.aten_arguments(func, args, kwargs, "train", "hidden_size", "input"))
            return func(*args, **(kwargs or {}))

    lstm, x = torch.nn.LSTM(4, 6), torch.randn(5, 2, 4)
    with Record():
        lstm(x)
        with torch.no_grad():
            lstm.eval()(x)
    assert [(train, hidden, tuple(inputs.shape)) for train, hidden, inputs in calls] == [
        (True, 6, (5, 2, 4)), (False, 6, (5, 2, 4))], _broke("aten_arguments")


def test_aten_arguments_binds_keywords_and_defaults_and_names_a_missing_argument():
    add = torch.ops.aten.add.Tensor
    assert compat.aten_arguments(add, (torch.ones(1),), {"other": torch.ones(1)}, "other", "alpha")[1] == 1
    with pytest.raises(compat.TorchCompatError, match=r"has no argument trian in its schema \(self, other, alpha\)"):
        compat.aten_arguments(add, (torch.ones(1), torch.ones(1)), {}, "trian")


def test_raw_saved_tensors_finds_the_handles_on_a_real_graph_node_without_unpacking_them():
    x = torch.randn(3, requires_grad=True)
    y = x.exp()  # ExpBackward keeps its output
    handles = compat.raw_saved_tensors(y.grad_fn)
    assert len(handles) == 1 and isinstance(handles[0], compat.SavedTensor), _broke("raw_saved_tensors")
    assert handles[0].unpack_hook is None and torch.equal(handles[0].data, y), _broke("SavedTensor")

    def unpack(tensor):
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, unpack):
        hooked = x.exp()
    assert compat.raw_saved_tensors(hooked.grad_fn)[0].unpack_hook is unpack, _broke("SavedTensor.unpack_hook")


def test_mem_tracker_class_tracks_a_step_by_category():
    tracker_class = compat.mem_tracker_class()
    if tracker_class is None:
        pytest.skip(f"torch {torch.__version__} has no MemTracker; labkit falls back to its own timeline")
    model = torch.nn.Linear(64, 64)
    tracker = tracker_class()
    tracker.track_external(model)
    with tracker:
        model(torch.randn(8, 64)).sum().backward()
    snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    categories = {str(getattr(key, "value", key)): nbytes for key, nbytes in snapshot.items()}
    assert categories.get("Parameter") == (64 * 64 + 64) * 4, _broke("mem_tracker_class")


def test_profiler_event_tree_shows_a_cpu_allocation_of_the_size_made():
    from torch.profiler import ProfilerActivity, profile

    assert not compat.profiler_enabled(), _broke("profiler_enabled")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert compat.profiler_enabled(), _broke("profiler_enabled")
        kept = torch.empty(12345, dtype=torch.uint8)
    stack, sizes = compat.profiler_event_tree(prof), []
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if (event := compat.cpu_allocation(node)) is not None:
            sizes.append(event[2])
    assert kept.untyped_storage().nbytes() in sizes, _broke("profiler_event_tree / cpu_allocation")


PRIVATE_TORCH = re.compile(r"torch\._[A-Za-z]|torch\.utils\._|_C\.|torch\.distributed\._|_raw_saved_|kineto")


def test_no_labkit_module_but_the_compat_layer_names_a_private_torch_api():
    package = Path(compat.__file__).parent
    found = [f"{path.relative_to(package.parent)}:{number}: {line.strip()}"
             for path in sorted(package.rglob("*.py")) if path.name != "_torch_compat.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE_TORCH.search(line)]
    assert not found, "private torch APIs outside labkit/_torch_compat.py (route them through it):\n" + "\n".join(found)


# A fresh interpreter, so that nothing else has imported inductor yet: repro.setup turns
# deterministic mode on without importing it, and inductor, imported afterwards, is deterministic too.
_SETUP_LEAVES_INDUCTOR_UNIMPORTED = """
import sys, torch
from labkit import repro
repro.setup(seed=0, device="cpu")
print("inductor imported by setup:", "torch._inductor.config" in sys.modules)
print("eager:", torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
import torch._inductor.config as inductor_config
print("inductor after setup:", inductor_config.deterministic)
with repro.fastest_kernels():
    print("inside fastest_kernels:", torch.are_deterministic_algorithms_enabled(), inductor_config.deterministic)
print("after fastest_kernels:", torch.are_deterministic_algorithms_enabled(), inductor_config.deterministic)
"""


def test_deterministic_mode_is_set_without_importing_inductor_and_inductor_still_follows_it():
    root = Path(compat.__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != compat.INDUCTOR_DETERMINISTIC_VARIABLE}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _SETUP_LEAVES_INDUCTOR_UNIMPORTED], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "inductor imported by setup: False",
        "eager: True True",
        "inductor after setup: True",
        "inside fastest_kernels: False False",
        "after fastest_kernels: True True",
    ], _broke("use_deterministic_algorithms")


def test_deterministic_mode_sets_an_imported_inductor_and_the_eager_flags_as_torch_does():
    import torch._inductor.config as inductor_config

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              inductor_config.deterministic)
    try:
        for mode, warn_only in [(True, True), (False, False), (True, False)]:
            torch.use_deterministic_algorithms(not mode, warn_only=not warn_only)
            compat.use_deterministic_algorithms(mode, warn_only=warn_only)
            ours = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                    inductor_config.deterministic)
            torch.use_deterministic_algorithms(mode, warn_only=warn_only)
            theirs = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                      inductor_config.deterministic)
            assert ours == theirs == (mode, warn_only, mode), _broke("use_deterministic_algorithms")
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        inductor_config.deterministic = before[2]


def test_every_torch_attribute_labkit_names_exists_in_this_torch():
    # Public names too, read statically: labkit's GPU branches (CUDA events, memory statistics) never
    # run on CPU CI, so a name an upgrade removed, or a misspelt one, would first fail on a GPU.
    root = Path(__file__).resolve().parents[1]
    missing = [entry for source in sorted((root / "labkit").rglob("*.py"))
               for entry in missing_torch_attributes(str(source.relative_to(root)), [ast.parse(source.read_text())])]  # fmt: skip
    assert missing == [], "\n".join(missing)


def test_compiled_original_is_the_module_torch_compile_wraps():
    model = torch.nn.Linear(2, 2)
    assert compat.compiled_original(model) is None
    assert compat.compiled_original(torch.compile(model, backend="eager")) is model
