"""The trainer on a real public log (MovieLens 100K) beside two baselines: ``python -m loadtest.real_data``."""
