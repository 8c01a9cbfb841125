"""``python -m kvsm.replay LOG...``: the ``kvsm-replay`` command."""

import sys

from kvsm.replay.cli import main

sys.exit(main())
