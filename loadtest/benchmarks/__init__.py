"""The parts of ``make bench``, one module each (``loadtest/README.md`` maps the parts to them)."""
