"""Run the command line as `python -m quantkit`."""

from quantkit.cli import main

main()
