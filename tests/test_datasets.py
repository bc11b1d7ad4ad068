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


def test_the_digits_are_read_without_scikit_learn_and_equal_its_load_digits(monkeypatch):
    import numpy as np
    import sklearn.datasets

    expected = sklearn.datasets.load_digits()

    def refuse():
        raise AssertionError("the digits were read through load_digits, which imports scikit-learn")

    monkeypatch.setattr(sklearn.datasets, "load_digits", refuse)
    table = datasets._digits_table()
    assert np.array_equal(table[:, :-1], expected.data) and np.array_equal(table[:, -1], expected.target)
    x, y = datasets._load_digits()
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, torch.tensor(expected.data, dtype=torch.float32) / 16.0)
    assert torch.equal(y, torch.tensor(expected.target, dtype=torch.int64))


def test_without_the_csv_where_scikit_learn_keeps_it_load_digits_answers(monkeypatch):
    import numpy as np
    import sklearn.datasets

    expected = sklearn.datasets.load_digits()
    calls = []
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda: calls.append(1) or expected)
    monkeypatch.setattr(datasets, "_DIGITS_CSV", ("datasets", "data", "no_such_digits.csv.gz"))
    table = datasets._digits_table()
    assert calls == [1]
    assert np.array_equal(table[:, :-1], expected.data) and np.array_equal(table[:, -1], expected.target)
