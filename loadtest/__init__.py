"""Benchmarks, probes and soak of hps-service; ``loadtest/README.md`` maps the parts of ``make bench`` to modules."""
