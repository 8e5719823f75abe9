"""`python -m reference_impl.bench NAME ...`: see the package docstring."""

import sys

from reference_impl.bench import main

sys.exit(main())
