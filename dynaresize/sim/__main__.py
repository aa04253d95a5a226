"""`python -m dynaresize.sim` is `python -m dynaresize.sim.cli` (the console script dynaresize-sim)."""
from .cli import main

if __name__ == "__main__":       # not in a process spawned from it (policy.pricing_workers)
    main()
