"""``python -m hps_service.trainer`` = ``hps train``; the entry point torchrun starts once per process."""

import typer

from hps_service.trainer.cli import train_command

if __name__ == "__main__":
    typer.run(train_command)
