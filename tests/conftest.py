"""The suite's three tiers, decided here in one place from measured durations (``pytest --durations``;
issue 36 asks ``make test`` under 8 minutes and the inner loop under 2 on the 2-core CI machine).

- ``make test`` (the README's): every test but those marked ``exhaustive``, ``launch`` (they start the
  ``fullshard`` command or a script in fresh processes: ``make test-launch``) and ``libraries``. Each test
  function runs, every seed case (tests/SEEDS.md) and every upstream case (tests/UPSTREAM.md) with it.
- ``make test-exhaustive``: the tests marked ``exhaustive``, which CI runs after ``make test`` (.ci/run): the
  rest of a parametrized test's cross product (``MAKE_TEST_CASES`` keeps, in ``make test``, cases that take
  each value of each independent parameter at least once), whole tests whose path a sibling in ``make test``
  takes (``EXHAUSTIVE_TESTS``), the conformance matrix beyond its fast chunks and focus groups.
- ``make test-fast``, the inner loop: ``make test`` without the tests marked ``slow``: those listed in
  ``SLOW_TESTS`` (a second or more each, grouped by the sibling that keeps their path in the inner loop),
  the cases of a test that ``INNER_LOOP_CASES`` does not keep, and the tests marked slow in their files
  (replaced rank pools, fresh processes, torch's oracle on upstream cases, other projects' libraries and
  models, whose files ``make test-fast`` does not even collect: the Makefile's ``INNER_LOOP_SKIPS``). It
  keeps one parity test per front end and strategy family, the one-process unit tests and the mutation
  catchers (tests/test_mutants_values.py); ``tools/mutants.py`` runs this tier.

An exhaustive test is also slow. A name here that matches no test fails the collection
(``pytest_collection_modifyitems``) or ``tests/test_tiers.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

MAKE_TEST_CASES: dict[str, tuple[str, ...]] = {
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
    # Compilation dominates (up to 25 s a case on a cold inductor cache): int8 from bf16 here; float8's fused
    # codec is test_float8_fused_codec_on_every_code_and_at_the_edges, fp32 input test_fp32_shards_encode_....
    "test_quantize_fused.py::test_fused_codec_gives_the_eager_codecs_bits": ("int8-bf16",),
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
    # The world sizes of the fake process group: 8 and 64 take the same path as 1024.
    "test_fake_pg.py::test_per_rank_memory_matches_plan": (
        "8-fully_shard-full-False",
        "64-wrapper-full-False",
        "64-fully_shard-hybrid-False",
        "8-wrapper-full-True",
    ),
    "test_hf_models.py::test_parity_mixed_precision": ("llama",),
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
    # Peaks measured on the fake group: one model; every model and world in make test-exhaustive.
    "test_plan_any_model.py::test_predicted_peak_matches_fake_group": ("gpt2-64",),
    # A world of 4 takes what 2 does, plus the int reshard (2) and a replica dimension.
    "test_fully_shard_training.py::test_parity_world4": ("2",),
    "test_fully_shard_training.py::test_parity_hsdp_2x2": ("True",),
    "test_fully_shard_training.py::test_parity_gradient_accumulation": ("True",),
}

# Cases of a test that the inner loop keeps; its other ``make test`` cases are slow. Seed tests keep every
# case in ``make test`` (tests/SEEDS.md), so their cross products are cut here, not in MAKE_TEST_CASES.
INNER_LOOP_CASES: dict[str, tuple[str, ...]] = {
    "test_grad_scaler.py::test_fsdp_ddp_parity_with_grad_scaler": (
        "offloadFalse-FULL_SHARD-mpTrue-origTrue",
        "offloadTrue-SHARD_GRAD_OP-mpFalse-origFalse",
    ),
    "test_wrapper_hybrid_shard.py::test_fsdp_hybrid_shard_basic_setup": (
        "ShardingStrategy._HYBRID_SHARD_ZERO2-Mode.MIXED_HYBRID_FULL_SHARD-False-True",
    ),
    "test_wrapper.py::test_parity_matrix": (
        "ShardingStrategy.FULL_SHARD-True-True-True",
        "ShardingStrategy.HYBRID_SHARD-True-False-False",
    ),
    "test_train.py::test_training_equals_one_process": ("2-full",),
    "test_plan.py::test_prediction_matches_measured_step": ("full-2-False-fully_shard-False",),
    "test_fake_pg.py::test_per_rank_memory_matches_plan": ("8-fully_shard-full-False", "8-wrapper-full-True"),
    "test_state_dict_optim.py::test_wrapper_optim_state_dict_round_trip": (
        "adam-True-StateDictType.SHARDED_STATE_DICT",
    ),
    "test_state_dict_model.py::test_state_dict_save_load_flow": ("True-True",),
    "test_clip_grad_norm.py::test_wrapper": ("False-ShardingStrategy.FULL_SHARD",),
    "test_wrapper_legacy_optim_state_dict.py::test_full_optim_state_dict_matches_torch": ("orig-adam",),
    "test_wrapper_legacy_optim_state_dict.py::test_full_optim_state_dict_round_trip": ("True-scatter",),
    "test_quantized_flat.py::test_gathered_weights_are_the_dequantized_pieces": ("4-hybrid-int8",),
    "test_wrapper_comm_hook.py::test_torch_hooks_train_like_torch_fsdp1": ("fp16_compress",),
    "conformance/test_matrix.py::test_conformance": ("fast-w2-0",),
}

EXHAUSTIVE_TESTS: dict[str, str] = {
    "test_harness.py::test_crashed_rank_is_reported": "kills a rank and rebuilds the pool (22 s); "
    "test_failure_names_rank_and_traceback reports a failing rank",
    "test_checkpoint.py::test_resume_across_world_sizes_and_strategies": "23 s; "
    "test_train.py::test_resume_at_another_world_size_and_strategy resumes across world sizes",
    "test_fully_shard_training.py::test_parity_gradient_accumulation_mixed_precision": "16 s; "
    "test_parity_gradient_accumulation and test_parity_mixed_precision take each path",
    "test_bucketed_collectives.py::test_bucketed_training_equals_unbucketed_and_one_process_at_4": "5 s and a "
    "4-rank pool; test_bucketed_training_equals_unbucketed_and_one_process_at_2 takes each bucket path",
    "test_train.py::test_wrapper_front_end_trains_exactly_as_fully_shard": "3 s; the wrapper front end's "
    "other paths are test_wrapper.py's parity matrix cases",
    "test_quantize_fused.py::test_training_with_the_fused_codec_equals_the_eager_codec_compiled_blocks_too": "6 s "
    "(compiles); test_fused_codec_gives_the_eager_codecs_bits gives the eager codec's bits, with which "
    "test_quantized_all_gather.py trains",
    "test_train.py::test_resume_moves_between_the_front_ends": "3 s; "
    "test_train.py::test_resume_after_ctrl_c_continues_the_loss_curve_exactly resumes",
    "test_plan_any_model.py::test_plan_picks_a_choice_that_fits_and_explains": "8 s; test_plan.py's searches "
    "and test_the_choices_code_runs take the planner's path",
    "test_plan_any_model.py::test_cli_hf_config": "2 s; test_cli_bad_flags and test_plan.py's CLI tests",
    "test_hf_models.py::test_parity": "5 s a model; test_parity_mixed_precision[llama] trains the same model",
    "test_bench_units.py::test_fake_world_smoke": "6 s, a benchmark's plumbing; the engine's fake-world path is "
    "test_fake_pg.py's",
    "test_bench_device_mode.py::test_fake_world_smoke": "4 s, a benchmark's plumbing; as above",
    "test_harness.py::test_hang_is_reported_with_stacks": "6 s, kills the hung pool and starts a fresh one; "
    "test_rank_killed_by_a_signal_is_named_and_the_test_runs_again replaces a pool",
    "test_plan_any_model.py::test_predicted_peak_matches_gloo_ranks": "6 to 15 s a model; "
    "test_plan.py::test_prediction_matches_measured_step measures on gloo ranks",
}

# Whole tests out of the inner loop (in ``make test``): a second or more each, by the inner-loop sibling
# that takes their path.
SLOW_TESTS: dict[str, tuple[str, ...]] = {
    "4 ranks, HSDP, TP: test_parity_world2, test_parity_cpu_offload, test_hsdp_broadcast_across_replicas": (
        "test_fully_shard_training.py::test_parity_world4",
        "test_fully_shard_training.py::test_parity_tensor_parallel",
        "test_fully_shard_training.py::test_parity_hsdp_2x2",
        "test_fully_shard_training.py::test_parity_gradient_accumulation",
        "test_fully_shard_training.py::test_parity_degenerate_hsdp",
        "test_wrapper_hybrid_shard.py::test_fsdp_hybrid_shard_parity",
        "test_fully_shard_strategy.py::test_hybrid_strategy_builds_node_groups",
        "test_fully_shard_comm_settings.py::test_dp_mesh_dims_with_whole_mesh_dtensor_parameters",
        "test_clip_grad_norm.py::test_fully_shard_with_tensor_parallel_and_plain_parameters",
        "test_wrapper_sharded_tensor.py::test_sharded_tensors_equal_torchs_shard_by_shard",
        "test_wrapper_sharded_tensor.py::test_dcp_round_trip_at_another_world_size_and_into_fully_shard",
    ),
    "the fullshard command: test_training_equals_one_process[2-full], test_resume_after_ctrl_c_...": (
        "test_train.py::test_resume_at_another_world_size_and_strategy",
        "test_train.py::test_model_does_not_depend_on_world_size_or_strategy",
        "test_train.py::test_quantized_all_gather_trains_close_to_the_exact_gather",
        "test_train.py::test_fp16_with_loss_scaling_trains",
        "test_train.py::test_demo_peak_matches_the_plan",
        "test_plan.py::test_cli_plot",
        "test_plan.py::test_prediction_matches_the_demo_step",
        "test_plan.py::test_prediction_matches_measured_step_with_quantized_all_gather",
        "test_plan.py::test_units_are_the_models_parameters",
        "test_plan_any_model.py::test_a_long_stack_is_traced_as_four_blocks",
        "test_plan_any_model.py::test_units_are_the_repeated_blocks",
        "test_cli_errors.py::test_torch_fsdp_below_names_torch_fsdp",
    ),
    "compiled (inductor) and fused codecs: test_codec_kernel.py's eager and C++ codecs": (
        "test_compile.py::test_wrapper_under_compile",
        "test_compile.py::test_fully_shard_under_compile",
        "test_quantize_fused.py::test_fused_codec_gives_the_eager_codecs_bits",
        "test_quantize_fused.py::test_fp32_shards_encode_as_their_bf16_cast_eager_and_fused",
        "test_quantize_fused.py::test_float8_fused_codec_on_every_code_and_at_the_edges",
        "test_quantized_flat.py::test_fused_codec_gives_the_eager_codecs_bits_on_flat_pieces",
        "test_codec_kernel.py::test_the_library_is_built_once_and_cached",
    ),
    "quantized gathers on subgroups: test_trains_close_to_exact_and_can_be_turned_off": (
        "test_quantized_all_gather.py::test_backward_regather_within_a_smaller_group_is_quantized_too",
        "test_quantized_all_gather.py::test_hybrid_mesh_quantizes_the_shard_group_gather",
    ),
    "buckets trained and planned: test_prefetched_bucket_left_unused_by_a_changed_order_is_freed": (
        "test_bucketed_collectives.py::test_bucketed_training_equals_unbucketed_and_one_process_at_2",
        "test_bucketed_collectives.py::test_plan_models_buckets_within_1_percent",
    ),
    "settings against torch's FSDP2: test_fully_shard_comm.py, test_mutants_values.py's reductions": (
        "test_fully_shard_settings.py::test_all_reduce_hook_matches_fsdp2",
        "test_fully_shard_settings.py::test_requires_all_reduce_accumulates_with_one_all_reduce",
        "test_fully_shard_settings.py::test_gradient_divide_factor_matches_fsdp2",
        "test_fully_shard_settings.py::test_force_sum_reduction_uses_only_sums",
        "test_fully_shard_settings.py::test_set_reshard_after_forward_replaces_an_int",
        "test_fully_shard_settings.py::test_gradient_divide_factor_hsdp_matches_fsdp2",
        "test_torch_parity_autograd.py::test_optimizer_in_backward_steps_after_reduction",
        "test_torch_parity_autograd.py::test_set_is_last_backward_for_micro_batches",
        "test_torch_parity_autograd.py::test_backward_keeps_parameters_every_use_needs",
        "test_torch_parity_autograd.py::test_half_after_wrapping_trains_in_half",
        "test_torch_parity_autograd.py::test_two_forwards_one_backward_with_checkpointed_nested_units",
        "test_kept_forms.py::test_fully_shard_evaluation_forward_before_step",
        "test_exec_order.py::test_invalid_later_iter_order",
        "test_exec_order.py::test_train_eval",
        "test_copy_count.py::test_copies_per_unit_at_most_torch_native_path",
        "test_copy_count.py::test_copies_per_unit_at_most_torch_gloo",
    ),
    "checkpoints across torch and fullshard: test_state_dict_model.py, test_state_dict_optim.py": (
        "test_torch_parity_state_dict.py::test_dcp_checkpoints_load_across_torch_and_fullshard",
        "test_torch_parity_state_dict.py::test_dcp_checkpoints_with_adam_state_resume_across_torch_fsdp2_and_fully_shard",
        "test_torch_parity_state_dict.py::test_optim_state_calls_walk_the_model_order",
        "test_checkpoint.py::test_parameters_without_optimizer_state_stay_without",
    ),
    "more of a path the inner loop takes once (test_parity_world2, test_wrapper.py's parity matrix, NF4)": (
        "test_tensor_subclass_params.py::test_float8_all_gather_sends_fp8_bytes_and_trains_as_torch_fsdp2",
        "test_fully_shard_init.py::test_meta_device_1d_init",
        "test_fully_shard_init.py::test_meta_device_2d_init",
        "test_wrapper.py::test_activation_checkpointing_applied_after_wrapping",
        "test_clip_grad_norm.py::test_fully_shard_meshes",
        "test_wrapper_param_contract.py::test_parameters_types_shapes_identity_and_attributes_as_fsdp1",
        "test_wrapper_param_contract.py::test_requires_grad_and_summon_writeback_as_fsdp1",
    ),
    "the suite's own measures (fresh processes, whole-tree scans, replaced pools): test_boundaries.py": (
        "test_traced_step.py::test_a_step_enters_few_files",
        "test_imports.py::test_rooms_have_no_cycle",
        "test_upstream_inventory.py::test_every_upstream_test_has_a_status_and_real_references",
        "test_harness.py::test_rank_killed_by_a_signal_is_named_and_the_test_runs_again",
        "test_harness.py::test_a_tasks_meshes_never_serve_the_next_task",
        "test_grad_scaler.py::test_sharded_grad_scaler_found_inf",
    ),
}



def _key(item: pytest.Item) -> str:
    """``file.py::test`` (``conformance/file.py::test`` below tests/), the form the lists above use."""
    function = getattr(item, "originalname", None) or item.name
    path = Path(str(item.fspath))
    folder = "" if path.parent.name == "tests" else f"{path.parent.name}/"
    return f"{folder}{path.name}::{function}"


def _slow_tests() -> set[str]:
    return {test for tests in SLOW_TESTS.values() for test in tests}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_tests = _slow_tests()
    collected: dict[str, set[str]] = {}
    for item in items:
        key = _key(item)
        callspec = getattr(item, "callspec", None)
        case = callspec.id if callspec is not None else None
        for cases in (MAKE_TEST_CASES, INNER_LOOP_CASES):
            if key in cases and case is not None:
                collected.setdefault(key, set()).add(case)
        exhaustive = (
            key in EXHAUSTIVE_TESTS
            or (case is not None and key in MAKE_TEST_CASES and case not in MAKE_TEST_CASES[key])
            or item.get_closest_marker("exhaustive") is not None
        )
        slow = exhaustive or key in slow_tests or (case is not None and case not in INNER_LOOP_CASES.get(key, (case,)))
        if exhaustive:
            item.add_marker(pytest.mark.exhaustive)
        if slow:
            item.add_marker(pytest.mark.slow)
    # A renamed case would silently leave its test without a representative in its tier.
    for key, ids in collected.items():
        for name, cases in (("MAKE_TEST_CASES", MAKE_TEST_CASES), ("INNER_LOOP_CASES", INNER_LOOP_CASES)):
            missing = set(cases.get(key, ())) - ids
            if missing and len(ids) > len(cases[key]):  # the whole parametrization was collected
                raise pytest.UsageError(f"tests/conftest.py {name}[{key!r}] names cases that do not exist: {missing}")
