"""The results record: every published figure read from a recorded run.

    python -m tools.results record [--repo .] [--record results/runs.jsonl] [--sitting ID] [--lever NAME]
    python -m tools.results tables [--record results/runs.jsonl] [--check]

`results/runs.jsonl` holds one JSON object a line, one line a run (store.py names
and checks every field). `record` appends the line of a finished pipeline run,
read from that run's own records in its repository (record.py): dvc.lock and
params.yaml (commit, preset, params hash, seed), metrics/*.json (steps, tokens,
FLOPs, stopped_by, precision, scores, decoding speed) and the MLflow store
(each stage's wall time, the stages' span); the machine (CPU model, class,
threads, an ISA cap or thread cap set in the environment) is read where record
runs, so run it on the machine and in the shell that ran the pipeline.

`tables` rewrites the figures that README.md and docs/results.md publish,
between `<!-- results:NAME -->` and `<!-- /results:NAME -->` markers, from the
record (tables.py): means and standard deviations over seeds, time ratios only
between runs of one sitting (the same `sitting` id), each naming the runs it
pairs. `--check` writes nothing and exits 1 naming every marked place that
differs from what the record gives (tests/project/test_results.py runs it).

Lines marked `transcribed` were not recorded by `record`: their figures were
copied from the issue note that reported them, whose commit, command, machine
and date they carry (`transcribed.source`).
"""
