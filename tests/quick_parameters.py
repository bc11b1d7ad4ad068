"""The smallest parameters each notebook runs top to bottom with, for tests that check how a notebook runs
(every cell executes, checks fail gracefully) rather than what it measures.

A notebook at its defaults is nbval's job (the stored outputs), and its verdicts at small sizes are the
job of tests/test_nbNN_*.py, whose parameters are chosen to drive a verdict. These are smaller still: a
structural run pays for the kernel and the cells, not for training long enough to decide a claim, so
the student editions (17 executions in `make test`) cost about 270 s on a slow 2-core host against
about 340 s at the defaults: what is left is mostly each kernel's start (torch, dynamo).
`test_quick_parameters_name_every_notebook_and_only_declared_parameters` keeps the table in step with the
notebooks' parameters cells.
"""

from __future__ import annotations

QUICK_PARAMETERS: dict[str, dict[str, object]] = {
    "00_start_here": {"steps": 5},
    "01_computation_graph": {"hidden": 8, "steps": 3, "depth": 4, "width": 8, "timing_seconds": 0.02},
    "02_gradients_accumulate": {"hidden": 8, "steps": 5},
    "03_inplace_ops": {"norm_steps": 4, "triplet_steps": 5},
    "04_autograd_modes": {"batch": 8, "actor_steps": 3, "vit_steps": 2},
    "05_batchnorm_finetuning": {"seeds": 1, "batch_size": 2, "pretrain_steps": 20, "finetune_steps": 10},
    "06_optimizers_weight_decay": {"hidden": 16, "steps": 20, "epochs": 2, "seeds": 1},
    "07_gradient_clipping": {"steps": 10, "cnn_steps": 5, "seeds": 1},
    "08_gradient_health": {"width": 16, "steps": 60, "micro_batches": 2, "timing_seconds": 0.02},
    "09_residual_design": {"depths": [4], "seeds": 1, "train_depths": [4], "train_steps": 3, "train_seeds": 1},
    "10_mixed_precision": {"pretrain_steps": 10, "amp_steps": 2, "scaler_steps": 50, "nan_burst_steps": 10},
    "11_compile_drift": {"backend": "aot_eager", "hidden": 8, "batch": 32, "drift_steps": 5},
    "12_batch_size": {
        "noise_batches": [8, 16], "noise_draws": 2, "timing_batches": [32], "timing_width": 64,
        "scheduler_batches": [16, 32], "steps_per_batch": 2,
    },
    "13_memory": {"k1_batches": [1], "vit_batches": [1], "resnet_batch": 2, "validation_rows": 16,
                  "validation_steps": 1},
    "14_data_loading": {"samples": 32, "batch_size": 16, "epochs": 1, "sleep_ms": 1.0, "worker_counts": [0, 2],
                        "noisy_samples": 8},
    "15_distributed": {"per_rank_batch": 4, "steps": 2, "hidden": 8},
    "16_speed_and_memory": {"ffn_blocks": 2, "ffn_width": 16, "ffn_rows": 4, "attention_lengths": [32, 64]},
}
