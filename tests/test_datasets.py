import pytest
import torch

from labkit import LabkitError, datasets


def test_digits_split_is_seeded_scaled_and_complete():
    a, b = datasets.digits(seed=1), datasets.digits(seed=1)
    assert torch.equal(a.x_train, b.x_train) and not torch.equal(a.x_train, datasets.digits(seed=2).x_train)
    assert len(a.y_train) + len(a.y_test) == 1797 and a.classes == 10
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0
    assert datasets.digits(images=True).x_train.shape[1:] == (1, 8, 8)


def test_tasks_split_the_classes_and_relabel_them():
    pretrain, finetune = datasets.digits_tasks()
    assert pretrain.classes == finetune.classes == 5
    assert set(finetune.y_train.tolist()) == {0, 1, 2, 3, 4}
    assert len(pretrain.y_train) + len(pretrain.y_test) == 178 + 182 + 177 + 183 + 181


@pytest.mark.parametrize("kwargs", [dict(classes=(3, 3)), dict(classes=(11,)), dict(test_fraction=1.0)])
def test_bad_digit_arguments_are_refused(kwargs):
    with pytest.raises(LabkitError):
        datasets.digits(**kwargs)


def test_generated_data_is_seeded():
    assert torch.equal(datasets.regression(seed=4)[1], datasets.regression(seed=4)[1])
    points, labels = datasets.spirals(samples=90, arms=3)
    assert points.shape == (90, 2) and labels.bincount().tolist() == [30, 30, 30]
