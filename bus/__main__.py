"""`python -m bus`: the command line."""

from bus.cli import main

main()
