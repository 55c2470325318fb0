"""``python -m bench.bounds``."""

import sys

from bench.bounds import main

sys.exit(main())
