"""Detector and call-site-tree speed over a large synthetic store (1M requests, 20M calls).

    python benchmarks/findings.py [--requests 1000000] [--calls-per-request 20]

The generator and the timings live in :mod:`perfsleuth.analysis.bench` (the UI benchmark
reuses its generator); this is the one-command entry point (`make bench-findings`).
"""

from perfsleuth.analysis.bench import main

if __name__ == "__main__":
    main()
