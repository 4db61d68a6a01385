"""The fast tier (``make test-fast``; issue 21 and 36 ask for 2 minutes on the 2-core CI machine, it takes
about 4.5).

``make test`` runs every test but the launches (marked ``launch`` in their files: they start the
``fullshard`` command or a script in fresh processes; ``make test-launch`` runs them). ``make test-fast``
also leaves out the tests marked ``slow``: those that replace a rank pool (marked in their files), and
the ones listed here, whose code path a faster sibling already takes in the fast tier. The lists live in
one place so that the tier is one decision, made from measured durations (``pytest --durations``), not
a marker scattered over 50 files.

- ``FAST_CASES``: parametrized tests of which only the listed cases (pytest ids) stay fast; the others
  (every combination, seed cases included) run in ``make test``. The kept cases take each value of
  each parameter at least once where the parameters are independent settings.
- ``SLOW_TESTS``: whole tests moved, each with the sibling that covers its path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

FAST_CASES: dict[str, tuple[str, ...]] = {
    # 10 settings (each strategy with a row of flags and its complement): one per strategy, each flag
    # (use_orig_params, offload, mixed) both ways.
    "test_wrapper.py::test_parity_matrix": (
        "ShardingStrategy.FULL_SHARD-False-False-False",
        "ShardingStrategy.FULL_SHARD-True-True-True",
        "ShardingStrategy.SHARD_GRAD_OP-True-True-False",
        "ShardingStrategy.NO_SHARD-True-False-True",
        "ShardingStrategy.HYBRID_SHARD-True-False-False",
        "ShardingStrategy._HYBRID_SHARD_ZERO2-False-True-True",
    ),
    # Compilation dominates (up to 25 s a case on a cold inductor cache): each code and each input dtype once.
    "test_quantize_fused.py::test_fused_codec_gives_the_eager_codecs_bits": ("int8-bf16", "float8-fp32"),
    # Compilation dominates (7 to 23 s a case): one case per front end.
    "test_compile.py::test_wrapper_under_compile": ("torch.compile(model)-False",),
    "test_compile.py::test_fully_shard_under_compile": ("unit.compile()",),
    # Measured steps: one per front end; the other strategies' predictions are checked without running.
    "test_plan.py::test_prediction_matches_measured_step": (
        "full-2-False-fully_shard-False",
        "full-2-False-wrapper-False",
    ),
    # The fused (compiled) case runs in make test; test_quantize_fused keeps the compiled codec fast.
    "test_plan.py::test_prediction_matches_measured_step_with_quantized_all_gather": ("int8-2",),
    "test_grad_scaler.py::test_fsdp_ddp_parity_with_grad_scaler": (
        "offloadFalse-FULL_SHARD-mpTrue-origTrue",
        "offloadTrue-SHARD_GRAD_OP-mpFalse-origFalse",
    ),
    "test_grad_scaler.py::test_sharded_grad_scaler_found_inf": ("True-True",),
    # The world sizes of the fake process group: 8 and 64 take the same path as 1024.
    "test_fake_pg.py::test_per_rank_memory_matches_plan": tuple(
        f"{world}-{case}"
        for world in (8, 64)
        for case in ("fully_shard-full-False", "wrapper-full-False", "fully_shard-hybrid-False")
    )
    + ("8-fully_shard-full-True", "64-wrapper-full-True"),
    "test_hf_models.py::test_parity": ("llama",),  # GPT-2 takes 24 s for the same path (tied head: its own test)
    "test_hf_models.py::test_parity_mixed_precision": ("llama",),
    "test_wrapper_hybrid_shard.py::test_fsdp_hybrid_shard_parity": ("ShardingStrategy.HYBRID_SHARD-True",),
    "test_wrapper_hybrid_shard.py::test_fsdp_hybrid_shard_basic_setup": (
        "ShardingStrategy.HYBRID_SHARD-Mode.ALL_HYBRID_SHARD-False-False",
        "ShardingStrategy.HYBRID_SHARD-Mode.MIXED_HYBRID_FULL_SHARD-True-True",
        "ShardingStrategy._HYBRID_SHARD_ZERO2-Mode.ALL_HYBRID_SHARD-True-False",
        "ShardingStrategy._HYBRID_SHARD_ZERO2-Mode.MIXED_HYBRID_FULL_SHARD-False-True",
    ),
    "test_fully_shard_training.py::test_parity_activation_checkpointing": (
        "unit inside-True",
        "torch wrapper, non-reentrant-False",
    ),
    "test_fully_shard_training.py::test_step_cut_short_by_an_exception": (
        "forward-next forward",
        "backward-reset_iter_state",
    ),
    "test_train.py::test_training_equals_one_process": ("2-full", "4-hybrid", "2-offload"),
    "test_fully_shard_comm_settings.py::test_dp_mesh_dims_with_whole_mesh_dtensor_parameters": ("dim_names1",),
    "test_state_dict_optim.py::test_wrapper_optim_state_dict_round_trip": (
        "adam-False-StateDictType.FULL_STATE_DICT",
        "adam-True-StateDictType.SHARDED_STATE_DICT",
        "adamw-False-StateDictType.SHARDED_STATE_DICT",
        "sgd-True-StateDictType.FULL_STATE_DICT",
    ),
    "test_checkpoint.py::test_parameters_without_optimizer_state_stay_without": ("True",),
    "test_quantized_all_gather.py::test_about_half_the_bytes_of_a_bf16_gather": ("code0",),
    "test_train.py::test_quantized_all_gather_trains_close_to_the_exact_gather": ("int8",),
    "test_clip_grad_norm.py::test_fully_shard_meshes": ("fsdp-2.0", "hsdp-inf", "hsdp_blocks_fsdp_root-1.0"),
    "test_clip_grad_norm.py::test_wrapper": (
        "False-ShardingStrategy.FULL_SHARD",
        "True-ShardingStrategy.HYBRID_SHARD",
        "True-ShardingStrategy.NO_SHARD",
        "False-mixed",
    ),
    "test_fully_shard_settings.py::test_gradient_divide_factor_matches_fsdp2": (
        "1.0-reduce_dtype0",
        "3.0-reduce_dtype1",
    ),
    "test_wrapper_legacy_optim_state_dict.py::test_full_optim_state_dict_round_trip": (
        "False-shard",
        "True-shard-no-optim",
        "False-shard-optim-input",
        "True-scatter",
        "False-scatter-group",
    ),
}

SLOW_TESTS: dict[str, str] = {
    "test_harness.py::test_crashed_rank_is_reported": "kills a rank and rebuilds the pool (22 s); "
    "test_failure_names_rank_and_traceback reports a failing rank",
    "test_checkpoint.py::test_resume_across_world_sizes_and_strategies": "23 s; "
    "test_train.py::test_resume_at_another_world_size_and_strategy resumes across world sizes",
    "test_fully_shard_training.py::test_parity_gradient_accumulation_mixed_precision": "16 s; "
    "test_parity_gradient_accumulation and test_parity_mixed_precision take each path",
    "test_bucketed_collectives.py::test_bucketed_training_equals_unbucketed_and_one_process_at_4": "5 s and a "
    "4-rank pool; test_bucketed_training_equals_unbucketed_and_one_process_at_2 takes each bucket path",
    "test_train.py::test_wrapper_front_end_trains_exactly_as_fully_shard": "3 s; the wrapper front end's "
    "other paths are test_wrapper.py's fast matrix cases",
    "test_quantize_fused.py::test_training_with_the_fused_codec_equals_the_eager_codec_compiled_blocks_too": "6 s "
    "(compiles); test_fused_codec_gives_the_eager_codecs_bits gives the eager codec's bits, with which "
    "test_quantized_all_gather.py trains",
    "test_train.py::test_resume_moves_between_the_front_ends": "3 s; "
    "test_train.py::test_resume_after_ctrl_c_continues_the_loss_curve_exactly resumes",
}


def _key(item: pytest.Item) -> str:
    function = getattr(item, "originalname", None) or item.name
    return f"{Path(str(item.fspath)).name}::{function}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    collected: dict[str, set[str]] = {}
    for item in items:
        key = _key(item)
        callspec = getattr(item, "callspec", None)
        kept = FAST_CASES.get(key)
        if kept is not None and callspec is not None:
            collected.setdefault(key, set()).add(callspec.id)
        if key in SLOW_TESTS or (kept is not None and callspec is not None and callspec.id not in kept):
            item.add_marker(pytest.mark.slow)
    # A renamed case would silently leave its test without a fast representative.
    for key, ids in collected.items():
        missing = set(FAST_CASES[key]) - ids
        if missing and len(ids) > len(FAST_CASES[key]):  # the whole parametrization was collected
            raise pytest.UsageError(f"tests/conftest.py FAST_CASES[{key!r}] names cases that do not exist: {missing}")
