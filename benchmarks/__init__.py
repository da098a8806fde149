"""The benchmark scripts, run as modules (`python -m benchmarks.<script>`), and their records."""
