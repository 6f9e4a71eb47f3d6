"""``python -m wds_pad``: the ``wds-pad`` command (so ``torchrun -m wds_pad index ...`` works)."""

import sys

from .cli.app import main

sys.exit(main())
