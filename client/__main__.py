"""``python -m twinstep`` is the ``twinstep`` command."""

import sys

from twinstep.cli.main import main

sys.exit(main())
