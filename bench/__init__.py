"""The agentfast benchmark (issue 6): checkpoint cost, throughput, resume latency, peak RSS.

Run it with ``bash bench/run.sh`` (or ``python -m bench`` from the repository root); see
docs/benchmarks.md for what each part measures and the latest figures.
"""
