"""The ``hps`` command (``main``) and ``hps demo`` (``demo``)."""
