"""``python -m polar_training --model DIR -t TRAJ.parquet -o RUN`` (or ``torchrun ... -m polar_training``):
the ``polar train`` command on its own, without the rest of the CLI."""

import typer

from polar_training.commands import train_command

if __name__ == "__main__":
    typer.run(train_command)
