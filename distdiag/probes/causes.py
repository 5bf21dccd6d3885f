"""The probes' causes: every word a probe writes in a finding's `cause`, named once.

A member is its word wherever it is compared, hashed, printed or written as JSON
(`ProbeCause.IDENTICAL_DATA == "identical_data"`; a report reads as it did), so tools that
read reports keep matching the same strings. The hang analysis's causes are
distdiag.hang.records.Cause; docs/numerics.md, docs/probes.md and
docs/sequence_moe_checkpoint.md say what each of these means.
"""

from __future__ import annotations

from distdiag.report.model import Words

__all__ = ["ProbeCause"]


class ProbeCause(Words):
    """Why a probe's finding happened, as a stable snake_case word (report/model.py Finding.cause)."""

    # data_shards
    BATCH_COUNT_DIFFERS = "batch_count_differs"
    DATA_SHARDED_BY_LOCAL_RANK = "data_sharded_by_local_rank"
    IDENTICAL_DATA = "identical_data"
    OVERLAPPING_DATA = "overlapping_data"
    SAME_ORDER_EVERY_EPOCH = "same_order_every_epoch"

    # checkpoint
    BUFFER_NOT_SAVED = "buffer_not_saved"

    # setup_sync: the model as built and after parallelize
    SETUP_DIVERGENCE = "setup_divergence"
    SETUP_DIVERGENCE_BUFFER_PER_RANK = "setup_divergence_buffer_per_rank"
    SETUP_DIVERGENCE_INIT_ORDER = "setup_divergence_init_order"
    SETUP_DIVERGENCE_PARTIAL_TENSOR = "setup_divergence_partial_tensor"
    SETUP_DIVERGENCE_LOADED_ON_ONE_RANK = "setup_divergence_loaded_on_one_rank"
    SETUP_DIVERGENCE_RANK_SEEDED = "setup_divergence_rank_seeded"
    SETUP_DIVERGENCE_HEALED_BY_PARALLELIZE = "setup_divergence_healed_by_parallelize"
    SETUP_DIVERGENCE_REPLICAS_DIFFER = "setup_divergence_replicas_differ"
    EXPERT_WEIGHTS_RANK_DISTINCT = "expert_weights_rank_distinct"
    DTYPE_DIFFERS_ACROSS_RANKS = "dtype_differs_across_ranks"
    SHAPE_DIFFERS_ACROSS_RANKS = "shape_differs_across_ranks"
    REQUIRES_GRAD_DIFFERS_ACROSS_RANKS = "requires_grad_differs_across_ranks"
    TRAINING_MODE_DIFFERS_ACROSS_RANKS = "training_mode_differs_across_ranks"
    MIXED_PRECISION_DIFFERS_ACROSS_RANKS = "mixed_precision_differs_across_ranks"
    LEFT_ON_META = "left_on_meta"
    MODULE_ON_WRONG_DEVICE = "module_on_wrong_device"
    RANKS_SHARE_A_DEVICE = "ranks_share_a_device"
    LOW_PRECISION_MASTER_WEIGHTS = "low_precision_master_weights"
    LOSS_IN_LOW_PRECISION = "loss_in_low_precision"

    # fsdp_plan: a weight tied in build_model's model, two tensors after parallelize
    TIE_SHARDED_APART = "tie_sharded_apart"
    TIE_BROKEN_BEFORE_SHARDING = "tie_broken_before_sharding"

    # param_sync: drift between the copies of a parameter
    RNG_OUT_OF_STEP = "rng_out_of_step"
    BUFFER_NOT_SYNCHRONISED = "buffer_not_synchronised"
    UNMANAGED_PARAMS_NOT_REDUCED = "unmanaged_params_not_reduced"
    UPDATED_OUTSIDE_OPTIMIZER_PER_RANK = "updated_outside_optimizer_per_rank"
    REPLICAS_NOT_REDUCED = "replicas_not_reduced"

    # loss_parity: the differential diagnosis
    HOOK_DEPENDS_ON_RANK = "hook_depends_on_rank"
    SHARDS_DO_NOT_PARTITION_BATCH = "shards_do_not_partition_batch"
    GRADS_NOT_REDUCED = "grads_not_reduced"
    PARALLELIZE_CHANGES_TRAINABLE = "parallelize_changes_trainable"
    UNMANAGED_PARAMS = "unmanaged_params"
    GRAD_ACCUMULATION_MEANS = "grad_accumulation_means"
    GRAD_ACCUMULATION_DROPS_MICROBATCHES = "grad_accumulation_drops_microbatches"
    GRAD_CLIP_INSIDE_ACCUMULATION = "grad_clip_inside_accumulation"
    GRAD_ACCUMULATION_SCALED = "grad_accumulation_scaled"
    LOSS_SCALED_WRONG_GROUP = "loss_scaled_wrong_group"
    LOSS_NORMALISED_PER_RANK = "loss_normalised_per_rank"
    GRAD_CLIP_PER_RANK = "grad_clip_per_rank"
    GRAD_CLIP_NORM_SUMMED = "grad_clip_norm_summed"
    GRAD_SCALED_UNIFORMLY = "grad_scaled_uniformly"
    GRAD_AVERAGED_TWICE = "grad_averaged_twice"
    GRAD_SUMMED_NOT_AVERAGED = "grad_summed_not_averaged"
    GRAD_SCALE_WRONG_GROUP = "grad_scale_wrong_group"
    GRAD_SYNC_MICRO_STEP = "grad_sync_micro_step"
    GRAD_REDUCTION = "grad_reduction"
    OPTIMIZER_STEP_DIFFERS = "optimizer_step_differs"
    PARITY_UNEXPLAINED = "parity_unexplained"
    MECHANISM_NOT_IDENTIFIED = "mechanism_not_identified"

    # loss_parity: the module-by-module comparison
    DROPOUT_DIFFERS = "dropout_differs"
    MODULE_ATTRIBUTE_DIFFERS = "module_attribute_differs"
    FORWARD_HOOK_ALTERS_OUTPUT = "forward_hook_alters_output"
    COMPUTE_PRECISION_LOWER = "compute_precision_lower"
    MODULE_CALLED_EXTRA = "module_called_extra"
    MODULE_FORWARD_DIFFERS = "module_forward_differs"
    GRAD_HOOK_ALTERS_GRADIENT = "grad_hook_alters_gradient"
    EXTRA_REDUCTION = "extra_reduction"

    # sequence_parallel
    SPLIT_BAD_OUTPUT = "split_bad_output"
    SPLIT_NEEDS_DIVISIBLE_LENGTH = "split_needs_divisible_length"
    SPLIT_WRONG_TOKENS = "split_wrong_tokens"
    SPLIT_WRONG_TARGETS = "split_wrong_targets"
    SPLIT_DROPS_TOKENS = "split_drops_tokens"
    SPLIT_DUPLICATES_TOKENS = "split_duplicates_tokens"
    LABELS_SHIFTED_AFTER_SPLIT = "labels_shifted_after_split"
    SP_POSITIONS_RESTART = "sp_positions_restart"
    SP_MASK_NOT_SPLIT = "sp_mask_not_split"
    SP_MASK_MISALIGNED = "sp_mask_misaligned"
    SP_GATHER_WRONG_DIM = "sp_gather_wrong_dim"
    SP_ATTENTION_CONTEXT = "sp_attention_context"
    SP_GRAD_REDUCTION = "sp_grad_reduction"
    TRANSPORT_CORRUPTS_DATA = "transport_corrupts_data"
    EMPTY_BATCH_ZERO_DIVISION = "empty_batch_zero_division"
    EMPTY_SHARD_ZERO_DIVISION = "empty_shard_zero_division"
