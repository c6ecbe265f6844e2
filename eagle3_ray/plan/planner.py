"""The planner's single entry for the modules that import it as one (serve.app, serve.profile,
bench.serving, bench.quality, gpu_check): every public name of the plan package's four rooms,
re-exported unchanged. New code imports the room itself:

    profiles.py     node profiles: YAML, validation, with_draft_layer, measuring helpers
    cost.py         the cost model: round prices per drafter kind, best depth, DynamicDepth,
                    plan(), the sweeps, choose_drafting()
    acceptance.py   acceptance sources (runs, bench JSON, /metrics, lists), extrapolation,
                    curves derived from a chain's
    output.py       reasons in words, tables, plots, the files `plan` writes
    load.py         depth by load: the per-batch-size schedule (not re-exported here)
    roofline.py     the model behind the packaged Kimi profiles' verify tables

    eagle3-ray plan --acceptance 0.8,0.75,0.7 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 \\
        --out /tmp/plan                                            # CPU, a second
"""
from eagle3_ray.plan.acceptance import (  # noqa: F401
    BLOCK_FIRST_RATIO, BLOCK_REST_RATIO, EXTRAPOLATION_DECAY, EXTRAPOLATION_WINDOW,
    PARALLEL_FIRST_RATIO, PARALLEL_REST_RATIO, _from_metrics_text,
    acceptance_from, block_from_chain, cond_from_counts, draft_config_int, drafting_of,
    extend_acceptance, parallel_from_chain, parse_metrics, train_costs_from)
from eagle3_ray.plan.cost import (  # noqa: F401
    BLOCK_LAYERS, BLOCK_SIZE, DRAFTING, WHAT_IF, DynamicDepth, allreduce_curve_us, best_depth,
    depth_bound,
    block_collectives, block_forward_model, choose_drafting, comm_s, compute_s, decided_by,
    draft_block_compute_s, draft_comm_s, draft_parallel_compute_s, draft_round_collectives,
    draft_round_comm_s, draft_round_s, draft_s, plan, round_s, sweep, sweep_drafting, verify_s)
from eagle3_ray.plan.output import (  # noqa: F401
    allreduce_model, compare_text, decided_text, format_sweep, format_sweep_drafting,
    format_table, kind_summary, plot_plan, why, why_drafting, write_json, write_plan)
from eagle3_ray.plan.profiles import (  # noqa: F401
    CURVE_TOKENS, DRAFT_COLLECTIVES_FIXED, DRAFT_COLLECTIVES_PER_LAYER, DRAFT_COLLECTIVES_TP,
    PROFILE_DIR, Interconnect, NodeProfile, add_allreduce_curve, draft_collectives_tp,
    fit_alpha_beta, load_profile, measure_allreduce_curve, message_bytes, monotone_curve,
    packaged_profiles, profile_from_dict, profile_path, profile_to_dict, save_profile,
    single_device_profile, with_draft_layer, with_interconnect)
