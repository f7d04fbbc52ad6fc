"""``python -m radixkv``: the command line of :mod:`radixkv.apps.cli`."""

import sys

from radixkv.apps.cli import main

sys.exit(main())
