"""``python -m kvstore.cli``: the ``kvstore`` command."""

import sys

from kvstore.cli.main import main

sys.exit(main())
