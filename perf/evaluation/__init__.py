"""The evaluation suite (perf/evaluate.py): workloads, policy calibration, the systems compared, the report."""
