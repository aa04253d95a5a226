"""DynaResize: dynamic rollout/training GPU split for disaggregated RL post-training.

Kept import-light on purpose: engines spawn processes that re-import modules, and the offline
analysis imports the timeline schema from here on machines without torch or MPI.
"""
__version__ = "0.1.0"

import os as _os

# The Hydra configs ship inside the package (package data), so a wheel install has them too.
CONF_DIR = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "conf")
