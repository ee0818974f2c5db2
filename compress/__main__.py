"""``python -m compress``: also how torchrun starts it (``torchrun --nproc-per-node N -m compress apply ...``)."""

import sys

from .cli import main

sys.exit(main())
