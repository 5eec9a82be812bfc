"""``python -m hemiola``: the same as the ``hemiola`` command."""

import sys

from hemiola.cli import main

sys.exit(main())
