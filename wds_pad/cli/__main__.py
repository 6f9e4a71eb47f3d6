"""``python -m wds_pad.cli``: the ``wds-pad`` command."""

import sys

from .app import main

sys.exit(main())
