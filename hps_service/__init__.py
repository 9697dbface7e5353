"""hps-service: a hierarchical parameter server for recommendation and MoE embeddings."""

from importlib.metadata import PackageNotFoundError, version

try:  # one version source: pyproject.toml, as installed
    __version__ = version("hps-service")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
