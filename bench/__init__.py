"""Benchmarks: ratios measured side by side in one run (``make bench``, ``make bench-quick``)."""
