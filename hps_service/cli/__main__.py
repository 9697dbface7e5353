"""``python -m hps_service.cli``: the ``hps`` command."""

from hps_service.cli.main import app

if __name__ == "__main__":
    app(prog_name="hps")
