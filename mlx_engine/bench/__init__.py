"""`mlx-engine bench`: a load generator for any OpenAI-compatible server (docs/benchmarks.md).

workload.py builds the requests (seeded), client.py streams them over HTTP and stamps times,
metrics.py turns the stamps into figures, report.py prints/saves them, servers.py starts the
servers under test.
"""
