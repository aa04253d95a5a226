"""`python -m dynaresize.sim` is `python -m dynaresize.sim.cli` (the console script dynaresize-sim)."""
from .cli import main

main()
