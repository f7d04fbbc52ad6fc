"""``python -m radixkv``: the command line of :mod:`radixkv.cli`."""

import sys

from radixkv.cli import main

sys.exit(main())
