"""``python -m hps_service.cli``: the ``hps`` command."""

from hps_service.cli.main import app

app(prog_name="hps")
