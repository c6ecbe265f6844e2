"""Benchmarks over the stages; each writes JSON and a plot under runs/bench (eagle3-ray bench).

stages       extract, train step, regen, fp8 storage
serving      bench serve: the decoder at each depth beside transformers' own
engines      bench engines: the builtin decoder and vLLM, same drafter, acceptance side by side
quality      drafters compared by served acceptance (bench quality / recipe)
online       online against offline training
sweep        recipe arms at equal minutes
load         bench load: many users on a served app of each engine, by `vllm bench serve`
cli          the `eagle3-ray bench <name>` subcommands, each with its own flags
verify_cost  one round's verify and draft cost, two code versions side by side
"""
