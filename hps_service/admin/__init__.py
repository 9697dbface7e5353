"""Admin operations the REST API starts: model imports (``importer``), background jobs with progress (``jobs``) and
RocksDB checkpoints in a local directory (``checkpoints``)."""
