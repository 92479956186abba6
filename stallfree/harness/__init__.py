"""The stall harness behind ``stallfree bench``: N ranks run a DDP-like loop (next batch, step,
all-reduce) over each loader in turn and report the time blocked on data per rank.

Programmatic entry::

    from stallfree.harness.runner import BenchConfig, run_bench
    from stallfree.harness.report import format_table

    report = run_bench(BenchConfig(dataset="./shards", loaders=["stallfree", "torch"], nproc=2, steps=20))
    print(format_table(report))

Modules: config (BenchConfig, frozen), plan (the bench resolved once: BenchPlan of PhaseRuns,
and BenchData, the datasets opened once per process), phases (the measured runs, typed), runner
(launch on loopback, run the plan's phases), errors (RankFailed, one error line), metrics (stall
accounting), loaders (adapters), steps (the step), datasets / fixtures (bench data), analyze
(differential analysis, what-if), tune (workers x prefetch sweep), report (table, JSON, PNG),
placement (where each batch was made, with remote workers; report writes its text).
runner imports analyze, plan, report and tune; plan imports analyze, datasets and tune; at
module level analyze and tune import only config and phases, and inside functions loaders
(loader_available), datasets (analyze) and report (phase_entry); loaders imports report for the
decode column's recipe label; report imports placement, which imports only config.
"""
