"""``python -m dynaresize.analysis``: the dynaresize-analyze command line."""
import sys

from .cli import main

sys.exit(main())
