"""``python cli.py ...`` from a checkout: the same typer app as the ``mlx-stream`` command.

The command line lives in :mod:`mlx_stream.cli` (installed with the package); this file
only runs it, so a checkout and an installed package behave alike.
"""

from mlx_stream.cli import main

if __name__ == "__main__":
    main()
