"""``python -m distserve.cli``."""

import sys

from distserve.cli import main

sys.exit(main())
